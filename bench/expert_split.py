"""Does kt-kernel read a decode step's experts faster when each expert is handed over as `s` narrower ones?

An expert's output is down(silu(gate(x)) * up(x)); cutting its intermediate dimension into s slices gives s
experts whose outputs add up to exactly that (each slice's rows of gate and up, and its columns of down). A
token that picks k experts then picks k * s slices with the same weights. The bytes read are the same; only
how kt-kernel spreads the work over its threads changes. This times one V2-Lite MoE layer cold (several
layers in rotation, fresh random experts every call, as in bench.expert_floor) for each (method, s).

    python -m bench.expert_split [--methods AMXINT8,AMXINT4] [--splits 1,2,11] [--tokens 1,4] [--layers 6]

Prints one JSON line per measurement."""
from __future__ import annotations

import argparse
import json
import time

import torch

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 1408, 64, 6


def random_experts(experts: int, inter: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random bf16 gate / up [E, inter, HIDDEN] and down [E, HIDDEN, inter] on the CPU, drawn on a GPU where there
    is one (milliseconds for a V2-Lite layer's 0.55 G values, where the CPU's spare cores take seconds)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(seed)
    return tuple((torch.randn(experts, *shape, generator=g, device=device, dtype=torch.bfloat16) * 0.02).cpu()
                 for shape in ((inter, HIDDEN), (inter, HIDDEN), (HIDDEN, inter)))


def main() -> None:
    from engines.kt.experts.cpuinfer import default_cpu_threads
    from engines.kt.experts.methods import METHODS
    from engines.kt.experts.cpu import RoutedExpertsCPU

    p = argparse.ArgumentParser(prog="python -m bench.expert_split")
    p.add_argument("--methods", default="AMXINT8,AMXINT4")
    p.add_argument("--splits", default="1,2,11")
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    threads = args.threads or default_cpu_threads()
    for method in args.methods.split(","):
        for s in (int(v) for v in args.splits.split(",")):
            inter = INTER // s
            if INTER % s or inter % METHODS[method].size_multiple:
                print(json.dumps({"method": method, "split": s, "skipped": f"{inter} is not a multiple of "
                                  f"{METHODS[method].size_multiple}"}), flush=True)
                continue
            layers = []
            for i in range(args.layers):
                layer = RoutedExpertsCPU(layer_idx=800 + i, num_experts=EXPERTS * s, top_k=TOP_K * s,
                                         hidden_size=HIDDEN, intermediate_size=inter, method=method,
                                         threads=threads, max_tokens=64)
                layer.load_weights(*random_experts(EXPERTS * s, inter, seed=i))
                layers.append(layer)
            g = torch.Generator().manual_seed(1)
            for tokens in (int(t) for t in args.tokens.split(",")):
                calls = []
                for _ in range(args.calls):
                    picked = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
                    ids = (picked.unsqueeze(-1) * s + torch.arange(s)).reshape(tokens, TOP_K * s)
                    w = torch.rand(tokens, TOP_K, generator=g).repeat_interleave(s, dim=1)
                    calls.append((torch.randn(tokens, HIDDEN, generator=g).bfloat16(), ids, w))
                for x, ids, w in calls[:8]:
                    layers[0].forward(x, ids, w)
                started = time.perf_counter()
                for i, (x, ids, w) in enumerate(calls):
                    layers[i % len(layers)].forward(x, ids, w)
                per_call = (time.perf_counter() - started) / len(calls)
                distinct = EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** tokens)
                nbytes = distinct * 3 * HIDDEN * INTER * METHODS[method].bits / 8
                print(json.dumps({"method": method, "split": s, "tokens": tokens, "threads": threads,
                                  "ms_per_layer": round(per_call * 1e3, 4),
                                  "GB_s": round(nbytes / per_call / 1e9, 1)}), flush=True)
            del layers


if __name__ == "__main__":
    main()
