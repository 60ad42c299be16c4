"""Builds the decode kernel's shared library with the C compiler: `python -m engines.kt.experts.decode_kernel.build`.

Plain C and a ctypes library, so a fresh clone needs only Python and gcc (gcc 11 or later for AVX-VNNI; no
Python headers, no C++ compiler, no torch headers). One library holds every vector half (AVX-512 with and
without VNNI, AVX2 with and without AVX-VNNI), each file compiled with its own target flags (never
-march=native), so the same build runs on AMX and AVX-512 Xeons and on AVX2-only CPUs; the dispatcher picks a
half at run time from cpuid. The library's name carries a hash of the sources and flags: a changed source builds
anew, and processes never load a stale one. scripts/install.sh runs this; a process that finds no library
builds it on first use (a few seconds), and where that fails the engine keeps kt-kernel."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).parent / "src"
COMMON = ["-O3", "-fPIC", "-std=gnu11", "-Wall", "-Wno-unused-function", "-ffp-contract=off",
          "-fno-strict-aliasing"]
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
UNITS = {  # source -> its own target flags (dk.c runs a unit's code only where cpuid reports its features)
    "dk.c": [],
    "avx512vnni.c": [*AVX512, "-mavx512vnni"],
    "avx512.c": AVX512,
    "avx2vnni.c": [*AVX2, "-mavxvnni"],
    "avx2.c": AVX2,
}
LINK = ["-shared", "-lpthread", "-lm"]


def compiler() -> str:
    return os.environ.get("CC", "gcc")


def source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(SRC.iterdir()):
        if path.suffix in (".c", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(repr((COMMON, UNITS, LINK)).encode())
    return h.hexdigest()[:16]


def library_name() -> str:
    return f"libktserve_decode-{source_hash()}.so"


def candidate_dirs() -> list[Path]:
    """Where the library is looked for and built: beside the sources, else the user's cache."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ktserve" / "decode_kernel"
    return [Path(__file__).parent / "_build", cache]


def find_library() -> Path | None:
    for d in candidate_dirs():
        path = d / library_name()
        if path.is_file():
            return path
    return None


def build(verbose: bool = False) -> Path:
    """Compile the library (if no current one exists) and return its path; RuntimeError saying why not."""
    found = find_library()
    if found is not None:
        return found
    cc = compiler()
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler: {cc!r} is not on PATH (set CC, or install gcc)")
    errors = []
    for out_dir in candidate_dirs():
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                objects = []
                for unit, flags in UNITS.items():
                    obj = Path(tmp) / (Path(unit).stem + ".o")
                    _run([cc, *COMMON, *flags, "-c", str(SRC / unit), "-o", str(obj)], verbose)
                    objects.append(str(obj))
                lib = Path(tmp) / library_name()
                _run([cc, *objects, "-o", str(lib), *LINK], verbose)
                target = out_dir / library_name()
                os.replace(lib, target)  # atomic: concurrent builders each leave a whole library
                return target
        except (OSError, RuntimeError) as exc:
            errors.append(f"{out_dir}: {exc}")
    raise RuntimeError("; ".join(errors))


def _run(cmd: list[str], verbose: bool) -> None:
    if verbose:
        print(" ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:2])} ... failed: {done.stderr.strip()[-2000:]}")


if __name__ == "__main__":
    try:
        print(build(verbose="-v" in sys.argv))
    except RuntimeError as exc:
        print(f"decode kernel not built: {exc}", file=sys.stderr)
        sys.exit(1)
