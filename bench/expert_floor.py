"""The floor of the CPU experts at batch 1: one V2-Lite MoE layer (6 of 64 experts, 2048 x 1408) timed cold —
several layers in rotation and fresh random experts on every call, as in a real decode where one token
reads 1.35 GB (INT8) that no cache holds — for several kt-kernel thread counts, driven two ways:
`python`: submit + sync from Python (what the CPU-only engine does);
`stream`: submit_with_cuda_stream + sync_with_cuda_stream from a CUDA stream (what the GPU decode does),
with the copies into and out of pinned buffers on the stream, timed with CUDA events.

    python -m bench.expert_floor [--methods AMXINT8,AMXINT4] [--threads 10,12,14,15] [--pages 4k,2m] [--layers 6]

Each thread count runs in its own process (the worker pool is process-wide). Prints one JSON line per
measurement and a summary line last."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

import torch

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 1408, 64, 6
BYTES_PER_WEIGHT = {"AMXINT8": 1.0, "AMXINT4": 0.5, "BF16": 2.0, "LLAMAFILE": 34 / 32}  # LLAMAFILE: Q8_0 blocks


def cold_layers(method: str, count: int, threads: int) -> list:
    """`count` V2-Lite MoE layers of random experts in `method` (layers taken in turn read cold experts), with
    torch kept off kt-kernel's cores."""
    from bench.expert_split import random_experts
    from engines.kt.experts.cpuinfer import physical_cores
    from engines.kt.experts.cpu import RoutedExpertsCPU

    torch.set_num_threads(max(1, physical_cores() - threads))  # as the engine does: torch off kt-kernel's cores
    layers = []
    for i in range(count):
        layer = RoutedExpertsCPU(layer_idx=900 + i, num_experts=EXPERTS, top_k=TOP_K, hidden_size=HIDDEN,
                                 intermediate_size=INTER, method=method, threads=threads, max_tokens=64)
        layer.load_weights(*random_experts(EXPERTS, INTER, seed=i))
        layers.append(layer)
    return layers


def _inputs(calls: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, HIDDEN, generator=g, dtype=torch.bfloat16),
             torch.randperm(EXPERTS, generator=g)[:TOP_K].view(1, TOP_K),
             torch.rand(1, TOP_K, generator=g)) for _ in range(calls)]


def child(method: str, threads: int, layers: int, calls: int, huge_pages: bool) -> None:
    stack = cold_layers(method, layers, threads)
    pages = "4k"
    if huge_pages:
        from bench.lib.huge_pages import collapse_anonymous_memory

        report = collapse_anonymous_memory()
        print(json.dumps({"huge_pages": report.describe() if report else "not Linux"}), flush=True)
        pages = "2m"
    bytes_per_call = 3 * HIDDEN * INTER * TOP_K * BYTES_PER_WEIGHT[method]
    inputs = _inputs(calls, seed=threads)
    for x, ids, w in inputs[:8]:  # warm-up
        stack[0].forward(x, ids, w)
    started = time.perf_counter()
    for i, (x, ids, w) in enumerate(inputs):
        stack[i % layers].forward(x, ids, w)
    per_layer = (time.perf_counter() - started) / calls
    print(json.dumps({"method": method, "threads": threads, "driver": "python", "layers": layers, "pages": pages,
                      "ms_per_layer": round(per_layer * 1e3, 4),
                      "GB_s": round(bytes_per_call / per_layer / 1e9, 1)}), flush=True)
    if not torch.cuda.is_available():
        return
    dev = torch.device("cuda")
    gpu_inputs = [(x.to(dev), ids.to(dev), w.to(dev)) for x, ids, w in inputs]
    for x, ids, w in gpu_inputs[:8]:
        stack[0].submit(x, ids, w)
        stack[0].sync()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i, (x, ids, w) in enumerate(gpu_inputs):
        layer = stack[i % layers]
        layer.submit(x, ids, w)
        layer.sync()
    end.record()
    end.synchronize()
    per_layer = start.elapsed_time(end) / 1e3 / calls
    print(json.dumps({"method": method, "threads": threads, "driver": "stream", "layers": layers, "pages": pages,
                      "ms_per_layer": round(per_layer * 1e3, 4),
                      "GB_s": round(bytes_per_call / per_layer / 1e9, 1)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--methods", default="AMXINT8,AMXINT4")
    p.add_argument("--threads", default="10,12,14,15")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--pages", default="4k,2m", help="4k: as allocated; 2m: collapsed into huge pages first")
    p.add_argument("--child", nargs=2, metavar=("METHOD", "THREADS"))
    p.add_argument("--huge-pages", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.layers, args.calls, args.huge_pages)
        return
    rows = []
    for method, threads, pages in itertools.product(args.methods.split(","), (int(t) for t in args.threads.split(",")),
                                                args.pages.split(",")):
        run = subprocess.run([sys.executable, "-m", "bench.expert_floor", "--child", method, str(threads),
                              "--layers", str(args.layers), "--calls", str(args.calls)]
                             + (["--huge-pages"] if pages == "2m" else []),
                             capture_output=True, text=True, env=os.environ.copy(), timeout=600)
        lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        for line in lines:
            print(json.dumps(line), flush=True)
        rows += [line for line in lines if "ms_per_layer" in line]
        if run.returncode:
            print(json.dumps({"method": method, "threads": threads, "failed": run.stderr[-2000:]}), flush=True)
    print(json.dumps({"summary": [(r["method"], r["threads"], r["pages"], r["driver"], r["ms_per_layer"]) for r in rows]}))


if __name__ == "__main__":
    main()
