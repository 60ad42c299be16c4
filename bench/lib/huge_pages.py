"""Back the CPU experts' memory with 2 MiB pages, to measure whether page size limits them
(`python -m bench.expert_floor --pages 4k,2m`).

kt-kernel allocates each expert's quantized matrices on its own (`aligned_alloc`, ~3 MB each for V2-Lite):
glibc maps them with 4 KiB pages, and with transparent huge pages in `madvise` mode (the common distribution
default) nothing ever asks for larger ones. A decode step streams ~1.35 GB of them (INT8, V2-Lite) from cold
memory: with 4 KiB pages that is a TLB miss every 4 KiB and the hardware prefetchers stop at every page edge.

`collapse_anonymous_memory()` asks the kernel to rebuild the process's private anonymous mappings out of
huge pages now (`MADV_COLLAPSE`, Linux 6.1+), after marking them eligible (`MADV_HUGEPAGE`, which also lets
khugepaged do it later on older kernels). Memory the kernel cannot move (pinned buffers, device mappings)
is refused by the kernel and left as it is; nothing is allocated or freed. Run it once, after loading.

Measured on the H200 machine (2026-11-25, AMXINT8, 14 threads, six V2-Lite layers, cold): 0.99 ms per layer
with 4 KiB pages, 0.98 ms with 2.3 of 2.8 GiB collapsed. Page size is not what holds kt-kernel at ~50 GB/s,
so the engine does not do this.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import sys
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

HUGE_PAGE = 1 << 21
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25


@dataclass(frozen=True)
class CollapseReport:
    eligible_bytes: int  # whole 2 MiB ranges inside private anonymous writable mappings
    collapsed_bytes: int  # of those, now backed by huge pages (kernel's AnonHugePages difference)
    seconds: float
    supported: bool  # False: no MADV_COLLAPSE here (older kernel, not Linux): only MADV_HUGEPAGE was set
    refused: dict[str, int]  # bytes per error the kernel gave for ranges it did not collapse (e.g. EAGAIN)

    def describe(self) -> str:
        if not self.supported:
            return "huge pages: this kernel has no MADV_COLLAPSE; mappings marked for khugepaged instead"
        refused = ", ".join(f"{n / 2**30:.1f} GiB {name}" for name, n in self.refused.items())
        return (f"huge pages: {self.collapsed_bytes / 2**30:.1f} of {self.eligible_bytes / 2**30:.1f} GiB of "
                f"anonymous memory now in 2 MiB pages ({self.seconds:.1f}s)" + (f"; refused: {refused}" if refused else ""))


def anon_huge_bytes() -> int:
    """Bytes of this process backed by transparent huge pages (smaps_rollup's AnonHugePages)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _private_anonymous_ranges(min_bytes: int) -> list[tuple[int, int]]:
    """[start, end) of every private, writable, unnamed mapping, shrunk to whole huge pages."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 5 or not fields[1].startswith("rw") or fields[1][3] != "p":
                continue  # file-backed, [heap]/[stack]-named, shared or read-only
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            start, end = -(-lo // HUGE_PAGE) * HUGE_PAGE, hi // HUGE_PAGE * HUGE_PAGE
            if end - start >= min_bytes:
                ranges.append((start, end))
    return ranges


def collapse_anonymous_memory(min_bytes: int = 64 * HUGE_PAGE) -> CollapseReport | None:
    """Rebuild private anonymous mappings of at least `min_bytes` with huge pages; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    started, before = time.perf_counter(), anon_huge_bytes()
    eligible, collapsed_any, refused = 0, False, {}
    for start, end in _private_anonymous_ranges(min_bytes):
        if libc.madvise(start, end - start, _MADV_HUGEPAGE) != 0:
            continue  # a mapping that cannot take huge pages (e.g. locked for a device)
        eligible += end - start
        if libc.madvise(start, end - start, _MADV_COLLAPSE) == 0:
            collapsed_any = True
        else:
            name = errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
            refused[name] = refused.get(name, 0) + end - start
    # a kernel without MADV_COLLAPSE answers EINVAL for every range
    supported = collapsed_any or set(refused) != {"EINVAL"}
    return CollapseReport(eligible_bytes=eligible, collapsed_bytes=max(0, anon_huge_bytes() - before),
                          seconds=time.perf_counter() - started, supported=supported, refused=refused)
