"""Where a long prompt's time goes on the GPU machine: the KT engine (AMXINT8) on bench.run's random-weight
checkpoint, one prompt timed to its first token and profiled (torch.profiler, CPU and CUDA), after a warm-up
prompt of the same length.

    python -m bench.run --only baseline        # builds the checkpoint when it is missing
    python -m bench.prefill_profile [--tokens 2048] [--chunk-size 2048] [--gpu-prefill-tokens 128] [--out DIR]

Prints the time to first token as JSON, then the CUDA kernels and the CPU operators that took the most time;
with --out, also a Chrome trace."""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="default: where bench.run keeps its v2-lite checkpoint")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk-size", type=int, default=2048)
    p.add_argument("--gpu-prefill-tokens", type=int, default=0)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    from bench.run import default_model_dir
    from bench.lib.shapes import SHAPES

    from bench.lib.engine_runs import generate
    from engines.base import EngineConfig
    from engines.kt.engine import KTEngine

    model_dir = args.model_dir or str(default_model_dir(SHAPES["v2-lite"]))
    engine = KTEngine(EngineConfig(model_path=model_dir, max_concurrent=4, max_model_len=args.tokens + 64,
                                   chunk_size=args.chunk_size, settings={
                                       "kt_method": "AMXINT8", "kv_cache_tokens": 3 * (args.tokens + 64),
                                       "kt_gpu_prefill_tokens": args.gpu_prefill_tokens}))
    engine.start()
    try:
        vocab = 100_000
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, vocab, (args.tokens,), generator=g).tolist() for _ in range(3)]
        deadline = time.perf_counter() + 300
        asyncio.run(generate(engine, prompts[0], 2, deadline))  # warm-up
        plain = asyncio.run(generate(engine, prompts[1], 1, deadline)).ttft
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            profiled = asyncio.run(generate(engine, prompts[2], 1, deadline)).ttft
        print(json.dumps({"tokens": args.tokens, "chunk_size": args.chunk_size,
                          "gpu_prefill_tokens": args.gpu_prefill_tokens, "ttft_s": round(plain, 4),
                          "ttft_profiled_s": round(profiled, 4), "details": engine.info.details}), flush=True)
        table = prof.key_averages()
        for key in ("self_device_time_total", "self_cuda_time_total"):
            try:
                print(table.table(sort_by=key, row_limit=args.rows))
                break
            except (AttributeError, KeyError, ValueError):
                continue
        print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(args.out / f"prefill_{args.tokens}.json"))
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
