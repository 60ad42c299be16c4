"""Host time of the generation thread between decode steps: cProfile of the engine's loop while decoding."""
import argparse, asyncio, cProfile, io, json, pstats, time
from pathlib import Path
import torch

p = argparse.ArgumentParser()
p.add_argument("--model-dir", default="")
p.add_argument("--layers", type=int, default=4)
p.add_argument("--batch", type=int, default=1)
p.add_argument("--tokens", type=int, default=96)
p.add_argument("--method", default="AMXINT8")
args = p.parse_args()

from bench.decode_profile import _decode
from engines.base import EngineConfig
from engines.kt.engine import KTEngine

if args.model_dir:
    model_dir = args.model_dir
    settings = {}
else:
    from bench.checkpoint import build_checkpoint, existing_model
    from bench.shapes import V2_LITE_CONFIG
    config = {**V2_LITE_CONFIG, "num_hidden_layers": args.layers}
    out = Path("/tmp/ktserve-bench/v2-lite-trace")
    if existing_model(out, config) is None:
        build_checkpoint(out, config, shard_bytes=2 << 30)
    model_dir = str(out)
    settings = {"kt_method": args.method, "kv_cache_tokens": 8192}

prof = cProfile.Profile()

engine = KTEngine(EngineConfig(model_path=model_dir, max_concurrent=max(4, args.batch), max_model_len=4096,
                               settings=settings))
engine.start()
try:
    asyncio.run(_decode(engine, args.batch, 512, 32))  # warm-up
    # cProfile profiles the thread that enables it: enable it on the generation thread, between two steps
    engine.run_on_engine_thread(lambda: prof.enable())
    started = time.perf_counter()
    rate = asyncio.run(_decode(engine, args.batch, 16, args.tokens))
    wall = time.perf_counter() - started
    engine.run_on_engine_thread(lambda: prof.disable())
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(45)
    print(s.getvalue()[:12000])
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("cumulative").print_stats(60)
    print(s.getvalue()[:14000])
    print(json.dumps({"rate": rate, "wall": wall, "tokens": args.tokens, "batch": args.batch}))
finally:
    engine.stop()
