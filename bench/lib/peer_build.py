"""Building the peer engines (ik_llama.cpp, llama.cpp) from the source archives on PyPI, trimmed to what the
benchmark runs.

`pack` (on a machine with the archives) keeps only what the build and the GGUF converter read from each
archive's vendored tree and writes it as `<engine>.tar.xz`; llama-cpp-python's archive is 77 MB, over what a
device call carries, its tree without models/, docs/ and tests/ a few MB. `build` (on the GPU machine) unpacks
each tree, drops the CUDA matrix-multiplication kernels of the quantization types the benchmark does not run
(`KEEP_TYPES`), configures CMake for the machine's one GPU architecture and builds only the targets the
benchmark runs. A build that runs out of time stops cleanly; the next call continues it in the same folder
(ninja keeps what is done).

The trim: llama.cpp's CUDA backend instantiates its quantized matrix kernels (MMQ, and in ik_llama.cpp also
the matrix-vector MMVQ ones) once per type, one source file each under ggml-cuda/template-instances/ (74 MMQ
and 46 MMVQ files in ik_llama.cpp). Files of types outside KEEP_TYPES are deleted, and each call to their
kernels in the dispatching sources becomes an abort naming the type, so a tensor of such a type would stop
the program with a message rather than run some other code. FlashAttention keeps only the f16/q8_0/q4_0 K/V
variants (GGML_CUDA_FA_ALL_QUANTS off, ik's GGML_IQK_FA_ALL_QUANTS off)."""
from __future__ import annotations

import io
import re
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

# GGUF types whose CUDA matrix kernels the build keeps: the benchmark's files are Q8_0 and Q4_0 (their
# output and embedding tensors too: llama-quantize --output-tensor-type / --token-embedding-type); Q4_K and
# Q6_K stay for Q4_K_M files, whose quantizer also writes Q6_K.
KEEP_TYPES = ("q8_0", "q4_0", "q4_k", "q6_k")
CUDA_ARCH = "90-real"  # sm_90 machine code only (H100 / H200)


@dataclass(frozen=True)
class Engine:
    name: str  # also the packed archive's name and the tree's folder
    package: str  # the PyPI source archive holding it
    vendor: str  # its folder inside that archive
    targets: tuple[str, ...]
    cmake: tuple[str, ...]
    drop: tuple[str, ...]  # folders of the tree the build and the converter never read
    supply: tuple[tuple[str, str], ...] = ()  # (path, text): files the build reads that the archive lacks


COMMON_CMAKE = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_CCACHE=OFF",
                "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_CUDA_FA_ALL_QUANTS=OFF")
ENGINES = {  # built in this order: llama.cpp first, its llama-quantize makes the GGUF files
    "llama.cpp": Engine(
        "llama.cpp", "llama-cpp-python==0.3.36", "vendor/llama.cpp", ("llama-bench", "llama-server", "llama-quantize"),
        ("-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"),
        ("models", "docs", "media", "tests", "benches", "examples", "ci", "pocs", "skills")),
    "ik_llama.cpp": Engine(
        "ik_llama.cpp", "ik-llama-cpp-python==0.1.5", "vendor/ik_llama.cpp",
        ("llama-bench", "llama-server", "llama-quantize"),
        ("-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_EXAMPLES=ON", "-DGGML_IQK_FA_ALL_QUANTS=OFF"),
        ("models", "docs", "media", "github-data", "tests", "examples/llama.android", "spm-headers", "poetry.lock"),
        # common/CMakeLists.txt runs `cmake -P common/cmake/build-info-gen-cpp.cmake` (from the tree's root) to
        # write build-info.cpp, and the PyPI archive leaves that script out; this is the script as llama.cpp had it
        # (the tree has no git data, so the commit reads "unknown")
        (("common/cmake/build-info-gen-cpp.cmake",
          'include(${CMAKE_CURRENT_SOURCE_DIR}/cmake/build-info.cmake)\n'
          'set(TEMPLATE_FILE "${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp.in")\n'
          'set(OUTPUT_FILE "${CMAKE_CURRENT_SOURCE_DIR}/common/build-info.cpp")\n'
          'configure_file(${TEMPLATE_FILE} ${OUTPUT_FILE})\n'),)),
}

# a script a CMakeLists.txt runs or includes through its own folder: `-P "${CMAKE_CURRENT_SOURCE_DIR}/x"`,
# `include(${CMAKE_CURRENT_SOURCE_DIR}/x)` (a `-P` script's own paths are relative to the folder it runs in)
_CMAKE_READS = re.compile(r'(?:-P\s+|include\(\s*)"?\$\{CMAKE_CURRENT_SOURCE_DIR\}/([^"\s)$]+)')
_INSTANCE = re.compile(r"^(mmq|mmvq)-instance-(\w+?)(_id)?\.cu$")
_CALLS = (re.compile(r"\bmul_mat_q_case(?:_id)?<GGML_TYPE_(\w+)[^>]*>\([^;]*\);"),
          re.compile(r"\bmul_mat_vec_(\w+?)_q8_1_cuda\([^;]*\);"))


# ------------------------------------------------------------------------------------------------ pack
def sdist_stem(engine: Engine) -> str:
    """The PyPI source archive's name without .tar.gz, e.g. ik_llama_cpp_python-0.1.5."""
    package, version = engine.package.split("==")
    return f"{package.replace('-', '_')}-{version}"


def cmake_reads(scripts: dict[str, str]) -> set[str]:
    """The scripts that CMakeLists.txt files ({path in the tree: text}) run or include by their own folder's
    path, as paths in the tree."""
    reads = set()
    for path, text in scripts.items():
        folder = path.rpartition("/")[0]
        reads |= {f"{folder}/{m}" if folder else m for m in _CMAKE_READS.findall(text)}
    return reads


def pack(sdist: Path, out_dir: Path) -> Path:
    """The engine tree of one PyPI source archive, without ENGINES[...].drop and with ENGINES[...].supply, as
    out_dir/<engine>.tar.xz. A script its CMakeLists.txt files run or include that is in neither is an error here
    rather than in the build on the GPU machine."""
    engine = next((e for e in ENGINES.values() if sdist.name.startswith(sdist_stem(e))), None)
    if engine is None:
        raise ValueError(f"{sdist}: not one of {', '.join(e.package for e in ENGINES.values())}")
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{engine.name}.tar.xz"
    kept, scripts = set(), {}
    with tarfile.open(sdist) as src, tarfile.open(target, "w:xz", preset=6) as dst:
        for member in src:
            head, _, rest = member.name.partition("/")
            if not rest.startswith(engine.vendor + "/"):
                continue
            inner = rest[len(engine.vendor) + 1:]
            if inner == ".git" or any(inner == d or inner.startswith(d + "/") for d in engine.drop):
                continue
            member.name = f"{engine.name}/{inner}"
            member.pax_headers = {k: v for k, v in member.pax_headers.items() if k != "path"}  # a long name's
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
            kept.add(inner)
            if member.isfile() and inner.rpartition("/")[2] == "CMakeLists.txt":
                scripts[inner] = src.extractfile(member).read().decode("utf-8", "replace")
        for inner, text in engine.supply:
            if inner in kept:
                continue
            data = text.encode()
            info = tarfile.TarInfo(f"{engine.name}/{inner}")
            info.size, info.mode, info.mtime = len(data), 0o644, time.time()
            dst.addfile(info, io.BytesIO(data))
            kept.add(inner)
    missing = sorted(cmake_reads(scripts) - kept)
    if missing:
        target.unlink()
        raise ValueError(f"{sdist}: its CMake scripts read {', '.join(missing)}, which the archive lacks "
                         f"(bench/lib/peer_build.py ENGINES[{engine.name!r}].supply)")
    return target


# ------------------------------------------------------------------------------------------------ trim
def trim_cuda(tree: Path, keep: tuple[str, ...] = KEEP_TYPES) -> dict:
    """Delete the MMQ/MMVQ instance files of types outside `keep` and turn the calls to them into aborts."""
    ggml_src = tree / "ggml" / "src"
    removed = []
    for path in sorted((ggml_src / "ggml-cuda" / "template-instances").glob("*.cu")):
        m = _INSTANCE.match(path.name)
        if m and m.group(2).lower() not in keep:
            path.unlink()
            removed.append(path.name)
    aborted = 0
    for path in sorted((ggml_src / "ggml-cuda").glob("*.cu")) + sorted(ggml_src.glob("ggml-cuda.cu")):
        text = path.read_text()
        new, count = text, 0
        for pattern in _CALLS:
            def repl(m: re.Match) -> str:
                nonlocal count
                if m.group(1).lower() in keep:
                    return m.group(0)
                count += 1
                return f'GGML_ABORT("{m.group(1)}: type trimmed from this build (bench/lib/peer_build.py)");'
            new = pattern.sub(repl, new)
        if count:
            path.write_text(new)
            aborted += count
    return {"kept_types": list(keep), "instance_files_removed": len(removed), "calls_aborted": aborted}


# ------------------------------------------------------------------------------------------------ build
def unpack(archive: Path, work: Path) -> Path:
    """archive (<engine>.tar.xz, or a PyPI .tar.gz) unpacked under work/src; the engine tree's path."""
    name = archive.name.split(".tar")[0]
    engine = ENGINES.get(name)
    if engine is None:  # a PyPI archive as downloaded: pack it first
        archive = pack(archive, work / "packed")
        engine = ENGINES[archive.name.split(".tar")[0]]
    tree = work / "src" / engine.name
    if not (tree / "CMakeLists.txt").exists():
        shutil.rmtree(tree, ignore_errors=True)
        tree.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "-xf", str(archive), "-C", str(tree.parent), "--touch"], check=True)
        # a fixed, past mtime: archives from a machine whose clock runs ahead would leave ninja forever dirty
        subprocess.run(["find", str(tree), "-exec", "touch", "-h", "-d", "2026-01-01 00:00", "{}", "+"], check=True)
    return tree


def configure(engine: Engine, tree: Path, build: Path, cuda: bool) -> list[str]:
    cmd = ["cmake", "-S", str(tree), "-B", str(build), "-G", "Ninja", *COMMON_CMAKE, *engine.cmake]
    if cuda:
        cmd += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={CUDA_ARCH}"]
        nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
        if nvcc:
            cmd.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
    return cmd


_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")


def ninja(build: Path, targets: tuple[str, ...], jobs: int, deadline: float, log: Path, nice: int = 0) -> dict:
    """ninja on `targets` (at `nice`) until done or `deadline` (then stopped, resumable): seconds, steps,
    finished."""
    started = time.perf_counter()
    done = total = 0
    cmd = ["nice", "-n", str(nice)] * bool(nice) + ["ninja", "-C", str(build), f"-j{jobs}", *targets]
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                out.write(line)
                m = _PROGRESS.match(line)
                if m:
                    done, total = int(m.group(1)), int(m.group(2))
                if time.perf_counter() > deadline:
                    break
        finally:
            if proc.poll() is None:
                import os
                import signal

                os.killpg(proc.pid, signal.SIGTERM)
            rc = proc.wait()
    finished = rc == 0 and all((build / "bin" / t).exists() for t in targets)
    return {"seconds": round(time.perf_counter() - started, 1), "steps_done": done, "steps_total": total,
            "finished": finished, "returncode": rc}


def binaries(work: Path, engine: str) -> Path:
    return work / "build" / engine / "bin"


def built(work: Path, engine: str) -> bool:
    """Whether every target of `engine` is built in `work`."""
    return all((binaries(work, engine) / t).exists() for t in ENGINES[engine].targets)


def build_engine(engine: Engine, archive: Path, work: Path, jobs: int, deadline: float, cuda: bool,
                 nice: int = 0) -> dict:
    """Unpack, trim, configure (once) and build one engine; what it cost."""
    entry: dict = {"package": engine.package, "targets": list(engine.targets), "cuda_arch": CUDA_ARCH if cuda else None}
    build = work / "build" / engine.name
    log = work / f"build-{engine.name}.log"
    if built(work, engine.name):
        return {**entry, "finished": True, "reused": True}
    started = time.perf_counter()
    tree = unpack(archive, work)
    marker = tree / ".trimmed.json"
    if cuda and not marker.exists():
        import json

        marker.write_text(json.dumps(trim_cuda(tree)))
    if cuda and marker.exists():
        import json

        entry["trim"] = json.loads(marker.read_text())
    if not (build / "build.ninja").exists():
        cmd = configure(engine, tree, build, cuda)
        with open(log, "a") as out:
            subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=True)
        entry["cmake"] = cmd[3:]
    entry["unpack_configure_s"] = round(time.perf_counter() - started, 1)
    entry.update(ninja(build, engine.targets, jobs, deadline, log, nice))
    return entry


def build_all(archives: dict[str, Path], work: Path, jobs: int, deadline: float, cuda: bool, nice: int = 0) -> dict:
    """Every engine of `archives` (engine name -> archive), one after the other, all cores each; `nice` leaves
    the GGUF conversion, which runs beside the compilers in a build call, its core."""
    out = {}
    for name, archive in archives.items():
        try:
            out[name] = build_engine(ENGINES[name], archive, work, jobs, deadline, cuda, nice)
        except (subprocess.CalledProcessError, OSError, ValueError) as exc:
            out[name] = {"finished": False, "failed": f"{type(exc).__name__}: {exc}"}
    return out


def quantizer(work: Path) -> Path | None:
    """A built llama-quantize (llama.cpp's first, ik_llama.cpp's next); the GGUF types used are the same in both."""
    return next((q for q in (binaries(work, name) / "llama-quantize" for name in ENGINES) if q.exists()), None)


def find_archives(sources: Path, engines: tuple[str, ...] = tuple(ENGINES)) -> dict[str, Path]:
    """engine name -> its archive in `sources`, for those of `engines` found there: <engine>.tar.xz (packed) or
    the PyPI .tar.gz."""
    found = {}
    for name, engine in ENGINES.items():
        if name not in engines:
            continue
        packed = sources / f"{name}.tar.xz"
        pypi = sorted(sources.glob(sdist_stem(engine) + ".tar.gz"))
        if packed.exists():
            found[name] = packed
        elif pypi:
            found[name] = pypi[0]
    return found
