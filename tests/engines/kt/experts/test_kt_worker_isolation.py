"""WorkerIsolation (engines/kt/experts/cpuinfer.py): with the non-expert model on a GPU, the server's own threads leave
the cores kt-kernel's pinned workers run on, and get them back when the engine stops.

Each case runs in a child process, whose threads' cores it changes; a "worker" there is a thread pinned to one
core, as kt-kernel pins its own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]

if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
    pytest.skip("needs Linux and at least two usable CPUs", allow_module_level=True)

SCRIPT = textwrap.dedent('''
    import json, os, sys, threading
    from engines.kt.experts.cpuinfer import WorkerIsolation

    allowed = sorted(os.sched_getaffinity(0))
    pinned = allowed[:int(sys.argv[1])]
    with_watcher = sys.argv[3:] == ["watcher"]
    stop, ready = threading.Event(), threading.Barrier(len(pinned) + 2 + with_watcher)
    found = {}

    def watcher():  # as the decode kernel's watcher: named so, on the one CPU the workers leave
        import ctypes
        ctypes.CDLL(None).prctl(15, b"ktserve-dk-bell", 0, 0, 0)  # PR_SET_NAME
        os.sched_setaffinity(0, {allowed[-1]})
        ready.wait()
        stop.wait()
        found["watcher"] = sorted(os.sched_getaffinity(0))

    def worker(cpu):
        os.sched_setaffinity(0, {cpu})
        ready.wait()
        stop.wait()
        found["worker_%d" % cpu] = sorted(os.sched_getaffinity(0))

    def other():
        ready.wait()
        stop.wait()
        found["other"] = sorted(os.sched_getaffinity(0))

    threads = [threading.Thread(target=worker, args=(c,)) for c in pinned] + [threading.Thread(target=other)]
    threads += [threading.Thread(target=watcher)] if with_watcher else []
    for t in threads:
        t.start()
    ready.wait()
    isolation = WorkerIsolation()
    found["message"] = isolation.apply()
    found["main"] = sorted(os.sched_getaffinity(0))
    later = threading.Thread(target=lambda: found.__setitem__("later", sorted(os.sched_getaffinity(0))))
    later.start(); later.join()
    if sys.argv[2] == "restore":
        isolation.restore()
        found["main_restored"] = sorted(os.sched_getaffinity(0))
    stop.set()
    for t in threads:
        t.join()
    found["allowed"] = allowed
    print(json.dumps(found))
''')


def run_case(pinned: int, then: str = "keep", *extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(pinned), then, *extra], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_thread_but_the_pinned_workers_moves_off_their_cores():
    found = run_case(pinned=1)
    worker_core, spare = found["allowed"][0], found["allowed"][1:]

    assert found["worker_%d" % worker_core] == [worker_core]  # the worker stays where it was pinned
    assert found["main"] == spare and found["other"] == spare
    assert found["later"] == spare  # a thread started afterwards inherits its creator's cores
    assert "moved to cores" in found["message"]


def test_the_decode_kernels_watcher_on_the_one_cpu_left_is_not_taken_for_a_worker():
    allowed = sorted(os.sched_getaffinity(0))
    found = run_case(len(allowed) - 1, "keep", "watcher")

    assert found["watcher"] == [allowed[-1]]
    assert found["main"] == [allowed[-1]] and found["other"] == [allowed[-1]]  # the server keeps that CPU
    assert "moved to cores" in found["message"]


def test_stopping_gives_the_moved_threads_their_cores_back():
    found = run_case(pinned=1, then="restore")

    assert found["main_restored"] == found["allowed"]
    assert found["other"] == found["allowed"]


def test_workers_on_every_core_leave_the_other_threads_alone():
    found = run_case(pinned=len(os.sched_getaffinity(0)))

    assert found["main"] == found["allowed"] and found["other"] == found["allowed"]
    assert "every core" in found["message"]


def test_server_threads_avoid_the_hyperthread_siblings_of_worker_cores():
    from engines.kt.experts.cpuinfer import server_cores

    # 4 cores, 2 threads each: CPU n and n + 4 share a core; workers pinned to CPUs 0-2
    def siblings(cpu: int) -> set[int]:
        return {cpu % 4, cpu % 4 + 4}

    assert server_cores(set(range(8)), {0, 1, 2}, siblings) == {3, 7}
    # workers on every core: the remaining siblings are better than nothing
    assert server_cores(set(range(8)), {0, 1, 2, 3}, siblings) == {4, 5, 6, 7}
