"""One MoE layer per experts method on this CPU's kt-kernel build: what each method costs per call.

    PYTHONPATH=. python -m bench.expert_methods [--experts 64 --hidden 2048 --inter 1408 --top-k 6]
                                                [--threads N] [--methods FP8,BF16] [--tokens 1,4,16,64]

Prints one JSON line per (method, tokens) with the median milliseconds of a call, the bytes of expert weights
one token reads (top_k experts x 3 matrices) and the bandwidth that implies; then one summary line. The
default shape is one DeepSeek-V2-Lite MoE layer. `KT_KERNEL_CPU_VARIANT=avx2` measures the build an AVX2-only
CPU gets. The fallback order in engines/kt/experts/methods.py (AMXINT8 -> FP8 -> BF16) follows these figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    from engines.kt.experts.cpuinfer import default_cpu_threads
    from engines.kt.experts.methods import METHODS, available_methods, cpu_variant
    from engines.kt.experts.cpu import RoutedExpertsCPU

    p = argparse.ArgumentParser(prog="python -m bench.expert_methods")
    for name, default in (("experts", 64), ("hidden", 2048), ("inter", 1408), ("top-k", 6)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--threads", type=int, default=None, help="kt-kernel threads (default: physical cores - max(2, cores / 8))")
    p.add_argument("--methods", help="comma-separated (default: every method this build runs, LLAMAFILE where "
                                     "the sizes allow)")
    p.add_argument("--tokens", default="1,4,16,64")
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    E, H, I, K = args.experts, args.hidden, args.inter, args.top_k
    methods = args.methods.split(",") if args.methods else [
        m for m in available_methods() if H % METHODS[m].size_multiple == 0 and I % METHODS[m].size_multiple == 0]
    gen = torch.Generator().manual_seed(0)
    weights = tuple((torch.rand(E, *shape, generator=gen) - 0.5).mul_(0.05).bfloat16()
                    for shape in ((I, H), (I, H), (H, I)))
    threads = args.threads or default_cpu_threads()
    from engines.kt.experts.cpuinfer import physical_cores

    torch.set_num_threads(max(1, physical_cores() - threads))  # as the engine does: torch off kt's cores
    summary = {"cpu_variant": cpu_variant(), "threads": threads, "shape": [E, H, I, K]}
    for method in methods:
        started = time.perf_counter()
        experts = RoutedExpertsCPU(layer_idx=900, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                                   method=method, threads=threads, max_tokens=max(int(t) for t in args.tokens.split(",")))
        experts.load_weights(*weights)
        load_s = time.perf_counter() - started
        per_token = K * 3 * H * I * METHODS[method].bits / 8
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, H, generator=gen).bfloat16()
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
            w = torch.rand(tokens, K, generator=gen)
            for _ in range(3):
                experts(x, ids, w)
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                experts(x, ids, w)
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1000
            row = {"method": method, "tokens": tokens, "ms": round(ms, 3), "load_s": round(load_s, 1),
                   "weight_bytes_per_token": int(per_token),
                   "gb_s_at_1_token": round(per_token / (ms / 1000) / 1e9, 2) if tokens == 1 else None}
            print(json.dumps(row), flush=True)
            summary.setdefault(method, {})[tokens] = round(ms, 3)
        del experts
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
