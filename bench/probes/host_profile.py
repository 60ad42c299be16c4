"""Host time of the generation thread between decode steps: cProfile of the engine's loop while decoding.

    python -m bench.probes.host_profile --batch 32 --tokens 96      (bench/results/nvidia-h200-2026-11-26-host/)

Without `--model-dir` it builds (once) the 4-layer V2-Lite-shaped random checkpoint bench.decode_trace uses."""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path


def model(model_dir: str, layers: int, method: str) -> tuple[str, dict]:
    if model_dir:
        return model_dir, {}
    from bench.lib.checkpoint import build_checkpoint, existing_model
    from bench.lib.shapes import V2_LITE_CONFIG
    config = {**V2_LITE_CONFIG, "num_hidden_layers": layers}
    out = Path("/tmp/ktserve-bench/v2-lite-trace")
    if existing_model(out, config) is None:
        build_checkpoint(out, config, shard_bytes=2 << 30)
    return str(out), {"kt_method": method, "kv_cache_tokens": 8192}


def print_stats(prof: cProfile.Profile, order: str, rows: int, chars: int) -> None:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(order).print_stats(rows)
    print(s.getvalue()[:chars])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", default="")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--method", default="AMXINT8")
    args = p.parse_args(argv)

    from bench.decode_profile import _decode
    from engines.base import EngineConfig
    from engines.kt.engine import KTEngine

    model_dir, settings = model(args.model_dir, args.layers, args.method)
    engine = KTEngine(EngineConfig(model_path=model_dir, max_concurrent=max(4, args.batch), max_model_len=4096,
                                   settings=settings))
    engine.start()
    prof = cProfile.Profile()
    try:
        asyncio.run(_decode(engine, args.batch, 512, 32))  # warm-up
        # cProfile profiles the thread that enables it: enable it on the generation thread, between two steps
        engine.run_on_engine_thread(prof.enable)
        started = time.perf_counter()
        rate = asyncio.run(_decode(engine, args.batch, 16, args.tokens))
        wall = time.perf_counter() - started
        engine.run_on_engine_thread(prof.disable)
        print_stats(prof, "tottime", 45, 12000)
        print_stats(prof, "cumulative", 60, 14000)
        print(json.dumps({"rate": rate, "wall": wall, "tokens": args.tokens, "batch": args.batch}))
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
