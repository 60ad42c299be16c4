"""The process-wide kt-kernel worker pool (`CPUInfer`) that every CPU MoE layer shares.

kt-kernel runs each submitted task on one pool of pinned worker threads; a second pool would fight the
first for the same cores, so there is exactly one per process. It is created on first use with the thread
count of that first caller; later callers that ask for another count keep the existing pool and get a
warning. The default thread count is `default_thread_choice()`: physical cores minus max(2, cores / 8).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

import logging
import os
import threading
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_pool: Any = None
_pool_threads: int | None = None


def load_ext() -> ModuleType:
    """kt-kernel's compiled extension; importing `kt_kernel` first picks the build for this CPU."""
    try:
        import kt_kernel  # noqa: F401  (registers the CPU-specific build as `kt_kernel_ext`)
        import kt_kernel_ext
    except ImportError as exc:
        raise ImportError("kt-kernel is not installed; install it with `pip install --no-deps kt-kernel`") from exc
    _restore_float_environment()
    return kt_kernel_ext


def _restore_float_environment() -> None:
    """Loading kt-kernel (built with fast-math) turns on flush-to-zero in the importing thread, so Python
    floats in that thread silently lose subnormals (2.2e-308 / 2 == 0.0). Put the thread back to IEEE
    defaults; kt-kernel's own worker threads keep their mode."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        libm.fesetenv(ctypes.c_void_p(-1))  # glibc's FE_DFL_ENV
    except OSError:
        pass


def physical_cores() -> int:
    """Physical cores this process may run on; hyper-thread siblings count once."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


def default_thread_choice(cores: int | None = None) -> tuple[int, str]:
    """The default worker count for `cores` physical cores (this process's by default), and why.

    Cores left free: max(2, cores // 8), at least one worker. Two threads besides the workers are busy during
    a decode step: the generation thread (Python, launching GPU work, sampling) and the CUDA callback thread
    that starts kt-kernel's work and spins in its stream wait. Measured on 16 cores (V2-Lite INT8 decode,
    BASELINES.md): 16 workers cost 8 ms per layer; 15 gave bimodal decode (8-29 tok/s, TPOT p99 228 ms);
    14 gave 33.5 tok/s (p99 49 ms); 10-12 about 29-30 tok/s with p99 within 1.2x of the median. The
    eighth of larger machines leaves room for the OS and the server's own threads. (Since the engine keeps
    its other threads off the workers' cores, `WorkerIsolation`, one run had 15 workers at 33.4 tok/s, as
    fast as 14: docs/performance.md, "Threads".)
    """
    cores = physical_cores() if cores is None else cores
    spare = max(2, cores // 8)
    threads = max(1, cores - spare)
    why = (f"{cores} physical cores less {spare} for the generation thread and the CUDA callback thread "
           f"(on 16 cores 14 ran 33.5 tok/s; 15 stalled, p99 228 ms, while other threads could take a worker's core)")
    return threads, why


def default_cpu_threads() -> int:
    """The default worker count (see default_thread_choice)."""
    return default_thread_choice()[0]


def check_thread_count(threads: object) -> None:
    """ValueError unless `threads` is a positive integer."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")


def resolve_thread_count(threads: int | None) -> int:
    """The worker count to use for a requested `threads` (None = the default).

    More threads than physical cores are cut to the core count: kt-kernel pins one worker per core and
    leaves the surplus unpinned, where they only contend (3 threads on 2 cores ran a layer 2.3x slower
    than 2). All cores is allowed but warned about.
    """
    if threads is None:
        return default_cpu_threads()
    check_thread_count(threads)
    cores = physical_cores()
    if threads > cores:
        log.warning("threads=%d exceeds the %d physical cores; using %d", threads, cores, cores)
        return cores
    if threads == cores and cores > 1:
        log.warning("threads=%d uses every physical core, leaving none for the Python thread; "
                    "%d is usually faster", threads, cores - 1)
    return threads


def shared_cpu_infer(threads: int | None = None) -> Any:
    """The one `kt_kernel_ext.CPUInfer` of this process, created on first call with `threads` workers."""
    global _pool, _pool_threads
    with _lock:
        if _pool is None:
            ext = load_ext()
            count = resolve_thread_count(threads)
            why = default_thread_choice()[1] if threads is None else "as configured (cpu_infer)"
            config = ext.WorkerPoolConfig()
            # One subpool on NUMA node 0: the machines we target have one node (BASELINES.md).
            config.subpool_count = 1
            config.subpool_numa_map = [0]
            config.subpool_thread_count = [count]
            _pool = ext.CPUInfer(config)
            _pool_threads = count
            log.info("kt-kernel worker pool started with %d threads: %s", count, why)
        elif threads is not None:
            check_thread_count(threads)
            if min(threads, physical_cores()) != _pool_threads:
                log.warning("kt-kernel worker pool already runs %d threads; ignoring a request for %d",
                            _pool_threads, threads)
        return _pool


IDLE_SPIN_NICE = 19  # kt-kernel's workers where ktserve's decode kernel shares their cores (yield_idle_spin)


def yield_idle_spin() -> int:
    """Give kt-kernel's worker threads the lowest priority (nice 19); returns how many there were.

    An idle kt-kernel worker spins for ~50 ms after its last task before it sleeps, on the core the decode kernel's
    worker of that core is pinned to, so a decode step right after a kt-kernel call (a prompt chunk) ran at half
    speed: V2-Lite's MoE shape, 6 layers, one thread, a 2-core box, `python -m bench.decode_calls` in its
    alternating order: a one-token step 58.0 ms right after a kt-kernel step, against 29.7 ms after a pause; with
    the workers at nice 19, 29.9 ms, and kt-kernel's own steps unchanged (32.0 ms both ways; nice 10 left 38.1 ms).
    A niced worker yields its core to any runnable thread of normal priority there: the decode kernel's workers
    (the point of it), torch's threads where the placement computes on the CPU (between the layers' expert calls,
    and beside them for the shared experts), and other processes of the host; on GPU placements WorkerIsolation
    keeps the server's own threads off those cores. Served on the 2-core box (a probe: a 4-layer V2-Lite-shaped
    model on the CPU, one request decoding while 256-token prompts arrive) TPOT and the prompts' TTFT did not move.
    The nice value cannot be taken back without CAP_SYS_NICE, so this is for the process's life."""
    count = 0
    for tid in _task_ids():
        if not _thread_name(tid).startswith(KT_WORKER_PREFIX):
            continue
        try:
            os.setpriority(os.PRIO_PROCESS, tid, IDLE_SPIN_NICE)
            count += 1
        except OSError:  # ended meanwhile
            continue
    return count


def pool_threads() -> int | None:
    """Worker threads of the shared pool, or None before it exists."""
    return _pool_threads


class WorkerIsolation:
    """Keeps this process's other threads off the cores kt-kernel's workers are pinned to.

    kt-kernel pins one worker per core; every other thread (the generation thread, the CUDA thread that runs
    kt-kernel's stream callbacks, the event loop, torch's pool) may still be scheduled onto a worker's core,
    and a layer's experts then wait for the preempted worker. `apply()` moves every thread that is not a
    pinned worker onto the cores the workers leave (`server_cores`: not the hyper-thread siblings of worker
    CPUs either, where other CPUs remain); threads started later inherit that from their creator.
    `restore()` gives each thread it moved its former cores back, and the threads started meanwhile the cores
    the process had. Linux only; a no-op elsewhere, when no worker is pinned, or when the workers leave no
    core."""

    def __init__(self) -> None:
        self.moved: dict[int, set[int]] = {}
        self.spare: set[int] = set()
        self.allowed: set[int] = set()

    @staticmethod
    def _threads() -> list[tuple[int, set[int]]]:
        tasks = []
        for tid in _task_ids():
            try:
                tasks.append((tid, os.sched_getaffinity(tid)))
            except OSError:  # a thread that ended meanwhile
                continue
        return tasks

    def apply(self) -> str:
        """Confine the non-worker threads; returns what was done, for the start-up log."""
        if not sys.platform.startswith("linux") or not hasattr(os, "sched_setaffinity"):
            return "not on Linux: threads left where the scheduler puts them"
        threads = self._threads()
        # kt-kernel's workers are the threads pinned to one core (it names them numa_<node>_...), as are the decode
        # kernel's (ktserve-dk-<n>); its watcher thread (WATCHER_NAME) keeps to the CPUs they leave, which may be one
        workers = {tid: cpus for tid, cpus in threads if len(cpus) == 1 and _thread_name(tid) != WATCHER_NAME}
        worker_cores = set().union(*workers.values()) if workers else set()
        allowed = self.allowed = os.sched_getaffinity(0)
        self.spare = server_cores(allowed, worker_cores)
        if not worker_cores or not self.spare:
            self.spare = set()
            return (f"kt-kernel's workers take every core this process may use ({len(allowed)}): other threads "
                    "share them" if worker_cores else "no pinned kt-kernel worker found: threads left as they are")
        for tid, cpus in threads:
            if tid in workers or cpus <= self.spare:
                continue
            try:
                os.sched_setaffinity(tid, self.spare)
                self.moved[tid] = cpus
            except OSError:  # ended meanwhile, or the cpuset forbids it
                continue
        return (f"{len(self.moved)} threads moved to cores {_cpu_list(self.spare)}, off the "
                f"{len(worker_cores)} cores of kt-kernel's workers")

    def restore(self) -> None:
        if not self.spare:
            return
        for tid, cpus in self._threads():
            if cpus == self.spare:  # moved, or started by a moved thread
                try:
                    os.sched_setaffinity(tid, self.moved.get(tid, self.allowed))
                except OSError:
                    continue
        self.moved, self.spare = {}, set()


def server_cores(allowed: set[int], worker_cores: set[int], siblings: Any = None) -> set[int]:
    """The CPUs of `allowed` for the threads that are not workers: those whose physical core holds no worker
    (a hyper-thread sibling of a worker's CPU shares its core's execution units), or, where that leaves
    none, every CPU without a worker."""
    siblings = siblings or _siblings
    free = allowed - worker_cores
    whole = {cpu for cpu in free if not siblings(cpu) & worker_cores}
    return whole or free


WATCHER_NAME = "ktserve-dk-bell"  # the decode kernel's watcher thread (decode_kernel/src/dk.c DK_WATCHER_NAME)
KT_WORKER_PREFIX = "numa_"  # kt-kernel names its workers numa_<node>_...


def _task_ids() -> list[int]:
    """This process's thread ids (Linux)."""
    return [int(entry.name) for entry in os.scandir(f"/proc/{os.getpid()}/task")]


def _thread_name(tid: int) -> str:
    try:
        with open(f"/proc/{os.getpid()}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _siblings(cpu: int) -> set[int]:
    """The logical CPUs that share `cpu`'s physical core (itself included), from sysfs."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            text = f.read().strip()
    except OSError:
        return {cpu}
    cpus = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _cpu_list(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
