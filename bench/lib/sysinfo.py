"""What the figures were measured on, and the memory probes every phase uses.

GPU memory is read two ways: torch's allocator peak (`torch.cuda.max_memory_allocated`, what our tensors
needed) and `nvidia-smi` (what the process really holds: allocator cache and CUDA context included).
Host memory is the process's resident set (VmRSS) and its peak (VmHWM), which is reset between phases
through /proc/self/clear_refs where the kernel allows it."""
from __future__ import annotations

import contextlib
import datetime
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import torch


def _package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def gpu_name() -> str | None:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def device_slug() -> str:
    """A short name for the results folder: the GPU (e.g. nvidia-h100-80gb-hbm3), or cpu-<cores>c."""
    name = gpu_name()
    if name is None:
        from engines.kt.experts.cpuinfer import physical_cores

        return f"cpu-{physical_cores()}c"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def environment(cpu_threads: int) -> dict:
    """Versions, machine and date, for the top of bench.json."""
    from engines.kt.experts.cpuinfer import physical_cores

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu_name(), "gpu_count": torch.cuda.device_count(), "cpu": cpu_model(),
        "physical_cores": physical_cores(), "logical_cpus": os.cpu_count(), "host_memory_GB": _meminfo_gb("MemTotal"),
        "kt_cpu_threads": cpu_threads, "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": _package_version("transformers"), "accelerate": _package_version("accelerate"),
        "kt_kernel": _package_version("kt-kernel") or _package_version("kt_kernel"),
        "openai": _package_version("openai"), "uvicorn": _package_version("uvicorn"),
        "flashinfer": _package_version("flashinfer-python"),
        "command": " ".join([Path(sys.executable).name, "-m", "bench.run", *sys.argv[1:]]),
    }
    with contextlib.suppress(ImportError, AttributeError):
        import kt_kernel

        info["kt_kernel_cpu_variant"] = str(kt_kernel.__cpu_variant__)
    if torch.cuda.is_available():
        info["gpu_memory_GB"] = torch.cuda.get_device_properties(0).total_memory / 1e9
        smi = nvidia_smi("driver_version")
        info["nvidia_driver"] = smi[0] if smi else None
    return info


def _meminfo_gb(key: str) -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


def page_cache_state() -> dict:
    """Dirty / under-writeback page cache (GB): what a just-written checkpoint still owes the disk."""
    return {k: _meminfo_gb(k) for k in ("Cached", "Dirty", "Writeback")}


def nvidia_smi(*fields: str) -> list[str] | None:
    """First GPU's values of `fields` (nvidia-smi --query-gpu), or None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                              "-i", "0"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [v.strip() for v in out.strip().splitlines()[0].split(",")]


def _status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peaks() -> bool:
    """Reset the GPU allocator peak and the process's peak RSS; False if the RSS peak could not be reset."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def memory_snapshot(rss_peak_reset: bool = True) -> dict:
    """GPU and host memory now and at their peaks since `reset_peaks()`, in GB."""
    from bench.lib.report import fig

    snap = {"host_rss": fig(_status_kb("VmRSS") * 1024 / 1e9, "GB"),
            "host_rss_peak": fig(_status_kb("VmHWM") * 1024 / 1e9, "GB",
                                 note=None if rss_peak_reset else "peak since process start (reset refused)")}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        snap["gpu_allocated"] = fig(torch.cuda.memory_allocated() / 1e9, "GB")
        snap["gpu_peak_allocated"] = fig(torch.cuda.max_memory_allocated() / 1e9, "GB",
                                         note="torch.cuda.max_memory_allocated")
        snap["gpu_reserved"] = fig(torch.cuda.memory_reserved() / 1e9, "GB")
        used = nvidia_smi("memory.used")
        if used:
            snap["gpu_used_nvidia_smi"] = fig(float(used[0]) * 1024 ** 2 / 1e9, "GB",
                                              note="whole GPU, CUDA context and allocator cache included")
    return snap


@contextlib.contextmanager
def stdout_to(path: Path) -> Iterator[None]:
    """Send file descriptor 1 (kt-kernel's C++ prints, per layer) to `path` for the duration."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
