"""`python -m bench.v4_batch`: aggregate decode speed of a small DeepSeek-V4 at 1 / 4 / 8 concurrent sequences
on the CPU, the KT engine as the server runs it (CPU rule file: MXFP4 experts in kt-kernel, the rest in torch).

The model is the demo V4 (engines/kt/families/deepseek_v4/demo_model.py: released layout, FP8 + UE8M0 projections, MXFP4 experts, each
attention kind) widened to a small V4 shape: hidden 1024, 64 routed experts top-6 of width 512, 16 heads of 128,
a sliding window of 64. Written once under --model-dir (default /tmp/ktserve-bench/v4-small) and reused while its
config matches. Each level runs its sequences concurrently, greedy, `--tokens` each after a `--prompt`-token
prompt, after a warm-up request. Prints one JSON object (also written to --out/v4-batch.json):

* `decode_tok_s_total` — the sum over sequences of (tokens - 1) / (last token - first token): what the level
  decodes per second once its prompts are in;
* `wall_tok_s` — all tokens / (last token - submission), prompts included;
* `expert_calls_per_step` — the routed-expert calls a step makes, per layer (1: the step's rows in one call).

`--decode-caches per-sequence,paged` runs every level with decode rows attending each sequence over its own
transformers cache, as before the paged caches, then over the paged caches (engines/kt/families/deepseek_v4/paged.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

SMALL_V4 = dict(hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=4, num_attention_heads=16,
                head_dim=128, qk_rope_head_dim=64, q_lora_rank=256, o_groups=4, o_lora_rank=256, n_routed_experts=64,
                num_experts_per_tok=6, num_hash_layers=1, compress_ratios=[0, 4, 128, 4], sliding_window=64,
                index_n_heads=8, index_head_dim=64, index_topk=16)


def small_model(root: Path, layers: int) -> Path:
    from engines.kt.families.deepseek_v4.demo_model import make_demo_model_v4

    config = {**SMALL_V4, "num_hidden_layers": layers,
              "compress_ratios": (SMALL_V4["compress_ratios"] * layers)[:layers]}
    marker = root / "config.json"
    if marker.is_file() and all(json.loads(marker.read_text()).get(k) == v for k, v in config.items()):
        return root
    return make_demo_model_v4(root, **config)


class _CallCounter:
    """Counts the routed-expert calls of one layer (its kt-kernel submits) beside the engine's steps."""

    def __init__(self, runner) -> None:
        from engines.kt.experts.protocol import RoutedExperts

        self.layer = next(m for m in runner.model.modules() if isinstance(m, RoutedExperts))
        self.calls = 0
        submit = self.layer.submit

        def counted(*args, **kwargs):
            self.calls += 1
            return submit(*args, **kwargs)

        self.layer.submit = counted


def run(args: argparse.Namespace) -> dict:
    from bench.lib.engine_runs import generate
    from bench.lib.shapes import prompt_ids
    from bench.v4_flash import decode_caches
    from engines.base import EngineConfig
    from engines.kt.engine import KTEngine

    root = small_model(Path(args.model_dir), args.layers)
    levels = [int(n) for n in args.clients.split(",")]
    settings = {"cpu_infer": args.threads} if args.threads else {}
    engine = KTEngine(EngineConfig(model_path=str(root), model_name="bench-v4-small", max_concurrent=max(levels),
                                   max_model_len=4096, chunk_size=512, settings=settings))
    engine.start()
    vocab = json.loads((root / "config.json").read_text())["vocab_size"]
    counter = _CallCounter(engine._runner)
    results: dict = {"shape": "v4-small", "config": {**SMALL_V4, "num_hidden_layers": args.layers},
                     "cpu_threads": os.cpu_count(), "kt_kernel_variant": _variant(), "prompt_tokens": args.prompt,
                     "tokens": args.tokens, "levels": []}

    def level(clients: int, tokens: int) -> dict:
        async def many():
            return await asyncio.gather(*(generate(engine, prompt_ids(args.prompt, vocab, seed=1000 * clients + i),
                                                   tokens, float("inf")) for i in range(clients)))
        started, calls = time.perf_counter(), counter.calls
        steps = engine.stats().steps
        gens = asyncio.run(many())
        last = max(g.token_times[-1] for g in gens)
        decode = [(len(g.token_times) - 1) / (g.token_times[-1] - g.token_times[0]) for g in gens]
        out = {"clients": clients, "decode_tok_s_total": sum(decode),
               "decode_tok_s_per_client": sum(decode) / clients,
               "wall_tok_s": sum(len(g.token_times) for g in gens) / (last - started),
               "ttft_s_median": sorted(g.ttft for g in gens)[clients // 2],
               "expert_calls_per_step": (counter.calls - calls) / max(1, engine.stats().steps - steps)}
        return out

    level(1, 4)  # warm-up
    for mode in args.decode_caches.split(","):  # the same engine, its decode rows attending one way then the other
        decode_caches(engine, mode)
        for clients in levels:
            results["levels"].append({"decode_caches": mode, **level(clients, args.tokens)})
    engine.stop()
    return results


def _variant() -> str:
    import kt_kernel

    return kt_kernel.__cpu_variant__


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=os.environ.get("KTSERVE_BENCH_DIR", "/tmp/ktserve-bench") + "/v4-small")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--clients", default="1,4,8", help="concurrency levels, comma-separated")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per sequence")
    p.add_argument("--threads", type=int, help="kt-kernel threads (cpu_infer); default: the engine's")
    p.add_argument("--decode-caches", default="paged", metavar="MODE,MODE",
                   help="where decode rows attend, in turn: paged (the engine's default), per-sequence "
                        "(transformers' cache of each sequence, as before the paged caches); e.g. per-sequence,paged")
    p.add_argument("--out", help="also write v4-batch.json into this folder")
    args = p.parse_args()
    from bench.lib.report import print_and_write

    print_and_write(run(args), args.out, "v4-batch.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
