"""The CPU memory-bandwidth ceiling on decode speed with CPU experts.

Decoding one token reads every chosen routed expert's weights once: (MoE layers) x top_k x 3 matrices of
hidden x moe_intermediate weights, at 1 byte (INT8), 0.5 (INT4) or 2 (BF16) per weight. Those bytes over
the CPU's memory bandwidth bound batch-1 decode from above (BASELINES.md). Bandwidth is measured as
BASELINES.md did: a large float32 copy with torch on the kt-kernel thread count, counting bytes read plus
bytes written; a read-only pass (a sum) is reported beside it."""
from __future__ import annotations

import statistics
import time

import torch

from bench.lib.report import fig
from bench.lib.shapes import Shape

BYTES_PER_WEIGHT = {"AMXINT8": 1.0, "AMXINT4": 0.5, "BF16": 2.0}


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: page faults and thread start-up stay out of the timing
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_host_bandwidth(threads: int, nbytes: int, repeats: int = 10) -> dict:
    """Copy (bytes read + written) and read-only bandwidth of host memory on `threads` threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_(-1, 1)  # not zeros: see METHOD.md
        dst = torch.empty_like(src)
        copy_s = _median_seconds(lambda: dst.copy_(src), repeats)
        read_s = _median_seconds(lambda: src.sum(), repeats)
    finally:
        torch.set_num_threads(previous)
    return {
        "threads": threads, "buffer": fig(nbytes / 1e9, "GB"),
        "copy_bandwidth": fig(2 * nbytes / copy_s / 1e9, "GB/s",
                              note="torch float32 copy, bytes read + bytes written, median"),
        "read_bandwidth": fig(nbytes / read_s / 1e9, "GB/s", note="torch float32 sum, bytes read, median"),
    }


def measure_cpu_bandwidth(shape: Shape, threads: int, nbytes: int, repeats: int = 10) -> dict:
    result = {**measure_host_bandwidth(threads, nbytes, repeats),
              "expert_bytes_per_token": {}, "expert_bytes": {}, "ceiling": {}}
    for method, bpw in BYTES_PER_WEIGHT.items():
        per_token = shape.routed_expert_bytes_per_token(bpw)
        result["expert_bytes_per_token"][method] = fig(per_token / 1e9, "GB")
        result["expert_bytes"][method] = fig(shape.routed_expert_bytes(bpw) / 1e9, "GB", note="all routed experts")
        result["ceiling"][method] = fig(batch_ceiling(shape, result, method, 1), "tok/s",
                                        note="copy bandwidth / routed-expert bytes per token, batch 1")
    return result


def ceiling_for(cpu_bandwidth: dict | None, method: str) -> float | None:
    if not cpu_bandwidth:
        return None
    return cpu_bandwidth["ceiling"].get(method, {}).get("value")


def batch_ceiling(shape: Shape, cpu_bandwidth: dict | None, method: str, batch: int) -> float | None:
    """tok/s that decode steps of `batch` sequences cannot pass: `batch` tokens per step, each step reading the
    routed experts its tokens chose (Shape.routed_expert_bytes_per_step) at the measured copy bandwidth."""
    if not cpu_bandwidth or method not in BYTES_PER_WEIGHT:
        return None
    step_bytes = shape.routed_expert_bytes_per_step(BYTES_PER_WEIGHT[method], batch)
    return batch * cpu_bandwidth["copy_bandwidth"]["value"] * 1e9 / step_bytes


def with_decode_ceiling(rounds: list[dict], shape: Shape, cpu_bandwidth: dict | None, method: str) -> list[dict]:
    """Streaming rounds with each one's decode rate (clients / TPOT median: the rate while every client decodes)
    beside the bandwidth ceiling of decode steps that large, so a round shows how far the experts' reads allow."""
    for r in rounds:
        tpot = (r.get("tpot_median") or {}).get("value")
        if tpot:
            r["decode_rate"] = fig(r["concurrency"] / tpot * 1e3, "tok/s", note="clients / TPOT median")
        ceiling = batch_ceiling(shape, cpu_bandwidth, method, r["concurrency"])
        if ceiling is not None:
            r["decode_ceiling"] = fig(ceiling, "tok/s", note="copy bandwidth / routed-expert bytes of a decode step "
                                      "of this many sequences (uniform routing, as with random weights)")
    return rounds
