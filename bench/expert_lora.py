"""Cost of expert LoRA on the CPU experts (engines/lora/cpu_experts.py), one MoE layer, random weights.

    PYTHONPATH=. python -m bench.expert_lora [--experts 64 --hidden 1024 --inter 512 --top-k 6 --rank 16]

Prints the memory one adapter adds (its padded LoRA tensors), the one-time memory of the shared SFT kernel
(process RSS before/after building it), and the time of one layer's routed experts for decode-sized (4
tokens) and prefill-sized (128 tokens) batches: base only, all rows on one adapter, half the rows on each of
two adapters (the rest base)."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def timed(fn, repeat: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat * 1000


def main() -> None:
    from engines.kt.experts.cpu import RoutedExpertsCPU
    from engines.lora.adapter import ExpertLora
    from engines.lora.cpu_experts import CPUExpertsLora
    from engines.lora.modules import AdapterRows, LoraContext

    p = argparse.ArgumentParser()
    for name, default in (("experts", 64), ("hidden", 1024), ("inter", 512), ("top-k", 6), ("rank", 16),
                          ("threads", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--method", default="BF16")
    args = p.parse_args()
    from engines.kt.experts.cpuinfer import physical_cores

    torch.set_num_threads(max(1, physical_cores() - args.threads))  # as the engine does: torch off kt's cores
    E, H, I, K, R = args.experts, args.hidden, args.inter, args.top_k, args.rank
    gen = torch.Generator().manual_seed(0)
    weights = {f"model.layers.1.mlp.experts.{e}.{w}.weight": (torch.randn(*shape, generator=gen) / shape[1] ** 0.5
                                                              ).bfloat16()
               for e in range(E) for w, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))}
    with tempfile.TemporaryDirectory() as tmp:
        save_file(weights, str(Path(tmp) / "model.safetensors"))
        experts = RoutedExpertsCPU(layer_idx=1, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                                   method=args.method, threads=args.threads, max_tokens=128, checkpoint=tmp)
        stack = lambda w: torch.stack([weights[f"model.layers.1.mlp.experts.{e}.{w}.weight"] for e in range(E)])  # noqa: E731
        experts.load_weights(stack("gate_proj"), stack("up_proj"), stack("down_proj"))
        del weights
        context = LoraContext()

        def install(name: str) -> None:
            updates = {p: ExpertLora(torch.randn(E, R, i) * 0.05, torch.randn(E, o, R) * 0.05, 2.0)
                       for p, (o, i) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))}
            prepared = CPUExpertsLora.prepare(experts, updates)
            if experts.lora is None:
                experts.lora = CPUExpertsLora(experts, context)
            experts.lora.install(name, prepared)
        before = rss_mib()
        install("a")
        backend_mib = rss_mib() - before
        before = rss_mib()
        install("b")
        second_mib = rss_mib() - before
        print(json.dumps({"method": args.method, "backend": type(experts.lora.backend).__name__, "experts": E,
                          "hidden": H, "inter": I, "top_k": K, "rank": R, "threads": args.threads,
                          "lora_mib_per_adapter_layer": round(experts.lora.nbytes("a") / 2**20, 2),
                          "rss_growth_second_adapter_mib": round(second_mib, 1),
                          "rss_growth_backend_once_per_layer_mib": round(backend_mib, 1),
                          "base_bf16_experts_mib": round(3 * E * H * I * 2 / 2**20, 1)}), flush=True)
        for tokens in (4, 128):
            x = torch.randn(tokens, H)
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
            w = torch.rand(tokens, K, generator=gen)
            half = tokens // 2
            cases = {"base only": AdapterRows([(None, 0, tokens)]), "one adapter": AdapterRows([("a", 0, tokens)]),
                     "a / b / base mixed": AdapterRows([("a", 0, half // 2), ("b", half // 2, half - half // 2),
                                                        (None, half, tokens - half)])}
            for label, rows in cases.items():
                def step(rows=rows):
                    with context.step(rows):
                        experts(x, ids, w)
                print(json.dumps({"tokens": tokens, "case": label,
                                  "ms": round(timed(step, 20 if tokens == 4 else 5), 2)}), flush=True)


if __name__ == "__main__":
    main()
