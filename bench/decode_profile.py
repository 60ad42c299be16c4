"""Where decode time goes on the GPU machine: steady decode at several batch sizes and context lengths,
with and without CUDA graphs, plus one MoE layer of CPU experts alone.

    python -m bench.decode_profile --model-dir /tmp/ktserve-bench/v2-lite [--method AMXINT8]
Prints one JSON line per measurement."""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch


async def _decode(engine, batch: int, context: int, tokens: int) -> float:
    from engines.base import GenerationRequest, SamplingParams

    handles = [engine.submit(GenerationRequest(prompt_token_ids=[100 + (i * 7 + j) % 90000 for j in range(context)],
                                               sampling=SamplingParams(max_tokens=tokens, temperature=0,
                                                                       ignore_eos=True))) for i in range(batch)]
    stamps: list[float] = []

    async def drain(h):
        async for out in h:
            if out.token_ids:
                stamps.append(time.perf_counter())
    await asyncio.gather(*(drain(h) for h in handles))
    stamps.sort()
    steady = stamps[len(stamps) // 4:]  # after every prompt is in
    return (len(steady) - 1) / (steady[-1] - steady[0])


def profile_engine(model_dir: str, method: str, graphs: bool) -> None:
    from engines.base import EngineConfig
    from engines.kt.engine import KTEngine

    engine = KTEngine(EngineConfig(model_path=model_dir, max_concurrent=16, max_model_len=8448, settings={
        "kt_method": method, "kv_cache_tokens": 40000, "kt_use_cuda_graph": graphs}))
    engine.start()
    try:
        for batch, context in ((1, 512), (1, 2048), (1, 8000), (4, 512), (16, 512)):
            rate = asyncio.run(_decode(engine, batch, context, 48))
            print(json.dumps({"method": method, "cuda_graphs": graphs, "batch": batch, "context": context,
                              "decode_tok_s": round(rate, 2)}), flush=True)
    finally:
        engine.stop()


def profile_experts(method: str) -> None:
    from engines.kt.experts.cpu import RoutedExpertsCPU

    experts = RoutedExpertsCPU(layer_idx=500, num_experts=64, top_k=6, hidden_size=2048, intermediate_size=1408,
                               method=method, max_tokens=64)
    experts.load_weights(*(torch.randn(64, *shape, dtype=torch.bfloat16) * 0.02
                           for shape in ((1408, 2048), (1408, 2048), (2048, 1408))))
    for tokens in (1, 4, 16):
        x = torch.randn(tokens, 2048, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(64)[:6] for _ in range(tokens)])
        w = torch.rand(tokens, 6)
        for _ in range(3):
            experts(x, ids, w)
        started = time.perf_counter()
        for _ in range(20):
            experts(x, ids, w)
        ms = (time.perf_counter() - started) / 20 * 1000
        print(json.dumps({"method": method, "one_moe_layer_tokens": tokens, "ms": round(ms, 3),
                          "torch_threads": torch.get_num_threads()}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--method", default="AMXINT8")
    p.add_argument("--experts-only", action="store_true")
    args = p.parse_args()
    profile_experts(args.method)
    if not args.experts_only:
        profile_engine(args.model_dir, args.method, graphs=True)
        profile_engine(args.model_dir, args.method, graphs=False)


if __name__ == "__main__":
    main()
