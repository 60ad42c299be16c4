"""Where the GPU's part of a batch-1 decode step goes: a CUDA trace of CUDA-graph decode steps, the GPU's
activities (kernels, copies) split into time busy, short gaps between them (launch latency, host callbacks,
small copies) and long gaps (the stream waiting on the CPU experts), per step and per MoE layer.

    python -m bench.decode_trace [--layers 4] [--method AMXINT8] [--steps 32] [--sequence] [--model-dir DIR]
                                 [--setting KEY=VALUE]

Builds a V2-Lite-shaped checkpoint with `--layers` layers (every per-layer figure is V2-Lite's; a few layers
build in seconds), starts the KT engine at its default settings, decodes a warm-up, then traces `--steps`
decode steps with torch.profiler. Prints one JSON line: kernels and copies per step and per MoE layer, busy
time, the gaps by size, the most expensive kernels; with `--sequence` also one step's activities in order, each
with its time and the idle time before it."""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time
from pathlib import Path

import torch

LONG_GAP_US = 100.0  # a gap this long is the stream waiting on the CPU experts, not a launch


def gpu_activities(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every kernel and copy the trace saw on a GPU, in time order."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.time_range.start, e.time_range.end, e.name))
    return sorted(out)


def summarize(acts: list[tuple[float, float, str]], steps: int, moe_layers: int) -> dict:
    busy = sum(end - start for start, end, _ in acts)
    gaps = [b[0] - a[1] for a, b in zip(acts, acts[1:])]
    short = [g for g in gaps if 0 < g < LONG_GAP_US]
    long_ = [g for g in gaps if g >= LONG_GAP_US]
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for start, end, name in acts:
        per_name[name].append(end - start)
    top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:25]
    copies = sum(1 for *_, n in acts if "memcpy" in n.lower() or "memset" in n.lower())
    return {
        "steps": steps, "moe_layers": moe_layers,
        "activities_per_step": round(len(acts) / steps, 1),
        "copies_per_step": round(copies / steps, 1),
        "activities_per_moe_layer": round(len(acts) / steps / moe_layers, 1),
        "busy_ms_per_step": round(busy / steps / 1e3, 3),
        "short_gap_ms_per_step": round(sum(short) / steps / 1e3, 3),
        "short_gaps_per_step": round(len(short) / steps, 1),
        "long_gap_ms_per_step": round(sum(long_) / steps / 1e3, 3),
        "long_gaps_per_step": round(len(long_) / steps, 1),
        "span_ms_per_step": round((acts[-1][1] - acts[0][0]) / steps / 1e3, 3) if acts else 0.0,
        "top_us_per_step": [(name[:90], len(d) / steps, round(sum(d) / steps, 1)) for name, d in top],
    }


def one_step(acts: list[tuple[float, float, str]], steps: int) -> list[tuple[str, float, float]]:
    """A middle step's activities in order: (name, microseconds busy, microseconds idle before it)."""
    per_step = len(acts) // steps
    first = per_step * (steps // 2)
    window = acts[first:first + per_step]
    return [(name[:70], round(end - start, 1), round(start - acts[first + i - 1][1], 1) if first + i else 0.0)
            for i, (start, end, name) in enumerate(window)]


def main() -> None:
    from bench.lib.checkpoint import build_checkpoint, existing_model
    from bench.decode_profile import _decode
    from bench.run import engine_settings
    from bench.lib.shapes import V2_LITE_CONFIG
    from engines.base import EngineConfig
    from engines.kt.engine import KTEngine

    p = argparse.ArgumentParser(prog="python -m bench.decode_trace")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (the first is dense, as in V2-Lite)")
    p.add_argument("--method", default="AMXINT8")
    p.add_argument("--steps", type=int, default=32, help="tokens generated while traced")
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/ktserve-bench/v2-lite-trace"))
    p.add_argument("--sequence", action="store_true", help="also print one step's activities in order")
    p.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE", help="any KT engine setting, VALUE read as JSON where it parses")
    args = p.parse_args()
    config = {**V2_LITE_CONFIG, "num_hidden_layers": args.layers}
    if existing_model(args.model_dir, config) is None:
        build_checkpoint(args.model_dir, config, shard_bytes=2 << 30)
    settings = {"kt_method": args.method, "kv_cache_tokens": 8192, **engine_settings(p, args.setting)}
    engine = KTEngine(EngineConfig(model_path=str(args.model_dir), max_concurrent=4, max_model_len=4096,
                                   settings=settings))
    engine.start()
    try:
        asyncio.run(_decode(engine, 1, 512, 32))  # warm-up: graphs captured, kernels chosen
        from torch.profiler import ProfilerActivity, profile

        # a 16-token prompt: its one prefill step costs about what a decode step does, so every step of the
        # trace counts as one (steps = tokens generated)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            started = time.perf_counter()
            rate = asyncio.run(_decode(engine, 1, 16, args.steps))
            wall = time.perf_counter() - started
        moe_layers = args.layers - config["first_k_dense_replace"]
        acts = gpu_activities(prof)
        result = summarize(acts, steps=args.steps, moe_layers=moe_layers)
        if args.sequence:
            result["one_step"] = one_step(acts, args.steps)
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        result.update(method=args.method, layers=args.layers, decode_tok_s_while_traced=round(rate, 1),
                      traced_wall_s=round(wall, 2), gpu=gpu, details=engine.info.details)
        print(json.dumps(result, default=str), flush=True)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
