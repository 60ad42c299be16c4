"""`python -m bench.v4_shares`: DeepSeek-V4 decode steps by the GPU's share of each layer's routed experts.

    python -m bench.v4_shares [--v4-layers 4] [--configs 112:128,144:128,112:0,144:0] [--batches 1,4]
                              [--prompt 512] [--steps 24] [--quick] [--out DIR]

Each config is `share:prefill`: `kt_gpu_read_experts=share` (the first `share` experts of each layer read by the
GPU in decode calls) with `kt_gpu_prefill_tokens=prefill` (0: no streamed copies, so the GPU owns those experts and
kt-kernel holds the rest; N: prompts stream copies of every expert, which decode calls read the share of). One KT
engine per config, started in turn in this process on the checkpoint of `python -m bench.run --shape v4-flash`
(bench/v4_flash.py; `--quick`: the tiny demo V4's dimensions, a CPU check of the phases). For each config, four
sequences are prefilled with `--prompt` tokens, then decode steps of each `--batches` count of them run back to
back as the engine runs them (its CUDA graphs where it captured them) after a few unmeasured ones: `batchN_step_ms`
is their mean wall time, the stream synchronized at both ends.

Tells which share suits a machine: `kt_gpu_read_experts` (docs/models/deepseek-v4.md) takes what it prints best. Configs
that repeat one share in different places of the list show how much the order and the machine's drift move it.
Prints one JSON line per config and a last line with all of them (also written to --out/v4-shares.json)."""
from __future__ import annotations

import argparse
import json
import time

import torch

SEQUENCES = 4


def parse_configs(text: str) -> list[tuple[int, int]]:
    """`share:prefill,...` as whole numbers, or argparse's error naming the option."""
    configs = []
    for part in text.split(","):
        share, _, prefill = part.partition(":")
        if not (share.isdigit() and prefill.isdigit()):
            raise argparse.ArgumentTypeError(f"expected share:prefill pairs of whole numbers, got {part!r}")
        configs.append((int(share), int(prefill)))
    return configs


def parse_batches(text: str) -> list[int]:
    batches = [int(b) for b in text.split(",") if b.isdigit()]
    if len(batches) != len(text.split(",")) or not all(1 <= b <= SEQUENCES for b in batches):
        raise argparse.ArgumentTypeError(f"expected sequence counts of 1 to {SEQUENCES}, got {text!r}")
    return batches


def measure(root, config: dict, share: int, prefill: int, batches: list[int], prompt: int, steps: int) -> dict:
    from bench.v4_trace import _stream_sync, run_step
    from engines.base import EngineConfig
    from engines.kt.engine import KTEngine
    from engines.kt.families.deepseek_v4.batch import Piece

    length = prompt + 3 + len(batches) * (steps + 3)
    generator = torch.Generator().manual_seed(0)
    token_ids = [torch.randint(100, config["vocab_size"], (length,), generator=generator).tolist()
                 for _ in range(SEQUENCES)]
    engine = KTEngine(EngineConfig(model_path=str(root), model_name="bench-v4-shares", max_concurrent=SEQUENCES,
                                   max_model_len=length, chunk_size=prompt,
                                   settings={"kt_gpu_read_experts": share, "kt_gpu_prefill_tokens": prefill}))
    engine.start()
    try:
        runner = engine._runner
        sync = _stream_sync(runner.head_device)
        details = engine.info.details
        out = {"share": share, "prefill_tokens": prefill, "gpu_read_experts": details.get("gpu_read_experts"),
               "gpu_prefill_tokens": details.get("gpu_prefill_tokens")}

        with torch.inference_mode():
            caches = [runner._new_cache() for _ in range(SEQUENCES)]
            for ids, cache in zip(token_ids, caches):
                run_step(runner, [Piece(ids, 0, prompt, cache, None)])
            at = [prompt] * SEQUENCES

            def decode(n: int) -> None:
                run_step(runner, [Piece(token_ids[i], at[i], at[i] + 1, caches[i], None) for i in range(n)])
                for i in range(n):
                    at[i] += 1

            for n in batches:
                for _ in range(3):
                    decode(n)
                sync()
                started = time.perf_counter()
                for _ in range(steps):
                    decode(n)
                sync()
                out[f"batch{n}_step_ms"] = round((time.perf_counter() - started) / steps * 1e3, 3)
        return out
    finally:
        engine.stop()


def main() -> int:
    from bench.lib.report import print_and_write
    from bench.v4_flash import _checkpoint

    p = argparse.ArgumentParser(prog="python -m bench.v4_shares", description=__doc__.split("\n\n")[0])
    p.add_argument("--v4-layers", type=int, default=4, help="layers of the V4-Flash-shaped checkpoint")
    p.add_argument("--configs", type=parse_configs, default=parse_configs("112:128,144:128,112:0,144:0"),
                   help="share:prefill pairs (kt_gpu_read_experts : kt_gpu_prefill_tokens), comma-separated")
    p.add_argument("--batches", type=parse_batches, default=[1, 4], help="sequences per decode step, comma-separated")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens of each sequence")
    p.add_argument("--steps", type=int, default=24, help="decode steps measured per batch")
    p.add_argument("--model-dir", help="checkpoint folder (default /tmp/ktserve-bench/v4-flash[-quick])")
    p.add_argument("--quick", action="store_true", help="the tiny demo V4's dimensions (a CPU check)")
    p.add_argument("--out", help="also write v4-shares.json into this folder")
    args = p.parse_args()
    root, config, built = _checkpoint(args)
    runs = []
    for share, prefill in args.configs:
        runs.append(measure(root, config, share, prefill, args.batches, args.prompt, args.steps))
        print(json.dumps(runs[-1]), flush=True)
    print_and_write({"shape": "v4-flash-quick" if args.quick else "v4-flash", "layers": config["num_hidden_layers"],
                     "build_s": round(built, 1),
                     "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "runs": runs},
                    args.out, "v4-shares.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
