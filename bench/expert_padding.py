"""Is a small batch of tokens faster through kt-kernel's matrix kernels, padded up to them?

kt-kernel's AMX-family MoE kernels compute a call of up to 4 x experts / top_k tokens (42 for V2-Lite) on a
vector path whose cost grows with every token an expert gets, and larger calls with matrix kernels that read
each chosen expert once (engines/kt/experts/methods.py, `matrix_tokens`). A decode step of 16-42 sequences picks
most of a layer's experts, several tokens each, on the vector path. This times one V2-Lite MoE layer cold
(several layers in rotation, fresh inputs every call, as bench.expert_floor does) for each method and token
count, as it comes and padded with expert-less rows to the matrix path, and checks both give the same output.

    python -m bench.expert_padding [--methods AMXINT8,AMXINT4] [--tokens 1,2,4,8,16,24,32,42] [--layers 6]

Prints one JSON line per (method, tokens) and a summary line: the fewest tokens from which padding was faster
at every larger count measured."""
from __future__ import annotations

import argparse
import json
import time

import torch

from bench.expert_split import EXPERTS, HIDDEN, TOP_K


def _time(layers: list, inputs: list) -> float:
    for x, ids, w in inputs[:2]:  # warm-up
        layers[-1].forward(x, ids, w)
    started = time.perf_counter()
    for i, (x, ids, w) in enumerate(inputs):
        layers[i % len(layers)].forward(x, ids, w)
    return (time.perf_counter() - started) / len(inputs)


def measure(method: str, tokens: list[int], layer_count: int, calls: int, threads: int) -> list[dict]:
    from bench.expert_floor import cold_layers
    from engines.kt.experts.methods import matrix_tokens

    layers = cold_layers(method, layer_count, threads)
    g = torch.Generator().manual_seed(1)
    rows = []
    for count in tokens:
        inputs = [(torch.randn(count, HIDDEN, generator=g, dtype=torch.bfloat16),
                   torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(count)]),
                   torch.rand(count, TOP_K, generator=g)) for _ in range(calls)]
        row: dict = {"method": method, "threads": threads, "tokens": count,
                     "matrix_tokens": matrix_tokens(EXPERTS, TOP_K)}
        outputs = []
        for pad_from, key in ((0, "ms"), (1, "ms_padded")):
            for layer in layers:
                layer.pad_from = pad_from
            outputs.append(layers[0].forward(*inputs[0]).float())
            row[key] = round(_time(layers, inputs) * 1e3, 3)
        row["max_rel_diff"] = round(((outputs[0] - outputs[1]).abs().max() / outputs[0].abs().max()).item(), 5)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def pays_from(rows: list[dict]) -> int | None:
    """The fewest tokens from which the padded call was faster at every larger count measured (None: never)."""
    best = None
    for row in sorted((r for r in rows if r["tokens"] < r["matrix_tokens"]), key=lambda r: -r["tokens"]):
        if row["ms_padded"] >= row["ms"]:
            break
        best = row["tokens"]
    return best


def main() -> None:
    from engines.kt.experts.cpuinfer import default_cpu_threads

    p = argparse.ArgumentParser(prog="python -m bench.expert_padding")
    p.add_argument("--methods", default="AMXINT8,AMXINT4")
    p.add_argument("--tokens", default="1,2,4,8,12,16,24,32,42")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    threads = args.threads or default_cpu_threads()
    tokens = [int(t) for t in args.tokens.split(",")]
    summary = {}
    for method in args.methods.split(","):
        summary[method] = pays_from(measure(method, tokens, args.layers, args.calls, threads))
    print(json.dumps({"summary": {"pays_from_tokens": summary, "threads": threads}}), flush=True)


if __name__ == "__main__":
    main()
