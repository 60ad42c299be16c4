"""python -m bench.decode_calls: a decode step's routed experts through the engine's seam (`RoutedExpertsCPU`
submit / sync, kt_decode_kernel on) against the same layers with kt-kernel serving every call.

    python -m bench.decode_calls [--methods AMXINT8,AMXINT4] [--layers 26] [--threads 14] [--tokens 1,4,16]
                                 [--no-finish]

V2-Lite's MoE shape (64 experts, top-6, 2048 x 1408), `--layers` layers with random weights (one bf16 source, each
layer its own quantized copies, so every layer is cold in the caches as in a model). A step calls every layer once,
submit then sync, with fresh random routing. Two orders: `blocks`, each kernel's steps in a run of their own after
0.2 s without calls (a server that only decodes), and `alternate`, a kernel step right after a kt-kernel step and
the reverse. kt-kernel's idle workers spin for ~50 ms after their last task (measured on the CI box: 5 of 100 CPU
ticks in the second after a call, none in the next), on the cores our workers are pinned to, so `alternate` shows
what a decode step pays right after a prompt chunk (unless kt-kernel's workers are niced, as the engine does once
a model is loaded, which `--no-finish` skips). Prints and writes (--out) the median step time and the
experts-only tokens per second it implies (tokens / step time)."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

E, K, H, I = 64, 6, 2048, 1408


def build(method: str, layers: int, threads: int, finish: bool = True) -> list:
    from engines.kt.experts.cpu import RoutedExpertsCPU
    from engines.kt.experts.decode_calls import DecodeKernelPolicy

    gen = torch.Generator().manual_seed(0)
    gate = (torch.empty(E, I, H).uniform_(-1, 1, generator=gen) * (3 / H) ** 0.5).bfloat16()
    up = (torch.empty(E, I, H).uniform_(-1, 1, generator=gen) * (3 / H) ** 0.5).bfloat16()
    down = (torch.empty(E, H, I).uniform_(-1, 1, generator=gen) * (3 / I) ** 0.5).bfloat16()
    policy = DecodeKernelPolicy("on")
    made = []
    for index in range(layers):
        layer = RoutedExpertsCPU(layer_idx=index + 1, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                                 method=method, threads=threads, max_tokens=64, decode_kernel=policy)
        layer.load_weights(gate, up, down)
        made.append(layer)
    if finish:  # as the engine does once the model is loaded (kt-kernel's workers niced: cpuinfer.yield_idle_spin)
        policy.finish()
    return made


def step(layers: list, tokens: int, kernel: bool, gen: torch.Generator) -> float:
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    routing = [(torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)]),
                torch.rand(tokens, K, generator=gen)) for _ in layers]
    calls = [layer.decode_calls for layer in layers]
    for layer in layers:
        layer.decode_calls = layer.decode_calls if kernel else None
    try:
        started = time.perf_counter()
        for layer, (ids, weights) in zip(layers, routing):
            layer.submit(x, ids, weights)
            x = layer.sync()
        return time.perf_counter() - started
    finally:
        for layer, kept in zip(layers, calls):
            layer.decode_calls = kept


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.decode_calls", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="AMXINT8,AMXINT4")
    p.add_argument("--layers", type=int, default=26)
    p.add_argument("--threads", type=int, default=14)
    p.add_argument("--tokens", default="1,4,16")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", type=Path)
    p.add_argument("--no-finish", action="store_true", help="skip what the engine does once a model is loaded "
                   "(kt-kernel's workers keep their priority, as before 2026-12-04)")
    args = p.parse_args(argv)
    from engines.kt.experts import decode_kernel

    results: dict = {"shape": {"experts": E, "top_k": K, "hidden": H, "intermediate": I, "layers": args.layers},
                     "threads": args.threads, "isa": decode_kernel.isa(), "finish": not args.no_finish, "methods": {}}
    for method in args.methods.split(","):
        started = time.perf_counter()
        layers = build(method, args.layers, args.threads, finish=not args.no_finish)
        entry = results["methods"][method] = {"load_s": round(time.perf_counter() - started, 1),
                                              "pool_cpus": decode_kernel.shared_pool(args.threads).cpus}
        gen = torch.Generator().manual_seed(1)
        for tokens in (int(t) for t in args.tokens.split(",")):
            for _ in range(3):  # warm-up, both ways
                step(layers, tokens, True, gen), step(layers, tokens, False, gen)
            for order in ("blocks", "alternate"):
                times = {True: [], False: []}
                if order == "blocks":
                    for kernel in (True, False, True, False):
                        time.sleep(0.2)
                        times[kernel] += [step(layers, tokens, kernel, gen) for _ in range(args.steps // 2)]
                else:
                    for _ in range(args.steps):
                        for kernel in (True, False):
                            times[kernel].append(step(layers, tokens, kernel, gen))
                row = {}
                for kernel, name in ((True, "ktserve"), (False, "kt-kernel")):
                    ms = statistics.median(times[kernel]) * 1e3
                    row[name] = {"step_ms": round(ms, 3), "experts_tok_s": round(tokens / ms * 1e3, 1),
                                 "p90_ms": round(sorted(times[kernel])[int(0.9 * len(times[kernel]))] * 1e3, 3)}
                entry.setdefault(order, {})[str(tokens)] = row
                print(f"{method} {order:>9} {tokens:>2} tokens: ktserve {row['ktserve']['step_ms']:.2f} ms "
                      f"({row['ktserve']['experts_tok_s']} tok/s), kt-kernel {row['kt-kernel']['step_ms']:.2f} ms "
                      f"({row['kt-kernel']['experts_tok_s']} tok/s)", flush=True)
        del layers
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode_calls.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
