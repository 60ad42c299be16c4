"""Steady decode rate of the KT engine at several batch sizes on the 4-layer V2-Lite-shaped model."""
import argparse, asyncio, json, sys, time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--batches", default="1,16,32")
p.add_argument("--tokens", type=int, default=64)
p.add_argument("--label", default="")
p.add_argument("--layers", type=int, default=4)
args = p.parse_args()

from bench.checkpoint import build_checkpoint, existing_model
from bench.decode_profile import _decode
from bench.shapes import V2_LITE_CONFIG
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
