"""Steady decode rate of the KT engine (AMXINT8) at several batch sizes on a V2-Lite-shaped random model, two
rounds each, so two builds of the code can be alternated on one machine.

    python -m bench.probes.decode_rate --batches 1,16,32 --label before  (bench/results/nvidia-h200-2026-11-26-host/)"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,16,32")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--label", default="")
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)

    from bench.decode_profile import _decode
    from bench.lib.checkpoint import build_checkpoint, existing_model
    from bench.lib.shapes import V2_LITE_CONFIG
    from engines.base import EngineConfig
    from engines.kt.engine import KTEngine

    config = {**V2_LITE_CONFIG, "num_hidden_layers": args.layers}
    out = Path("/tmp/ktserve-bench/v2-lite-trace" if args.layers == 4 else f"/tmp/ktserve-bench/v2-lite-{args.layers}")
    if existing_model(out, config) is None:
        build_checkpoint(out, config, shard_bytes=2 << 30)
    engine = KTEngine(EngineConfig(model_path=str(out), max_concurrent=32, max_model_len=4096,
                                   settings={"kt_method": "AMXINT8", "kv_cache_tokens": 32768}))
    engine.start()
    try:
        asyncio.run(_decode(engine, 32, 64, 16))
        for b in [int(x) for x in args.batches.split(",")]:
            rates = [asyncio.run(_decode(engine, b, 64, args.tokens)) for _ in range(2)]
            print(json.dumps({"label": args.label, "batch": b, "tok_s": [round(r, 1) for r in rates]}), flush=True)
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
