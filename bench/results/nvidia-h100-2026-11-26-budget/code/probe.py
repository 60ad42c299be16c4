"""Why a budget's end-to-end TTFT gain is smaller than its per-layer one: per budget, an AMXINT8 engine on the
bench's V2-Lite checkpoint runs 8,192-token prompts; records the share of each prompt chunk's token-experts that
fall below the held count, and the step timer's split (GPU / expert wait) over the prompt."""
import asyncio, json, statistics, sys, time
from pathlib import Path

import torch

from bench.engine_runs import EngineRun, generate, prompt_ids
from engines.base import EngineConfig
from engines.kt.experts_cpu import RoutedExpertsCPU

model = sys.argv[1]
out = Path(sys.argv[2])
budgets = sys.argv[3].split(",")
shares: list[float] = []
orig = RoutedExpertsCPU.submit


def submit(self, hidden, topk_ids, topk_weights, *a, **k):
    if topk_ids.shape[0] >= 1024:
        held = self.stream_experts if self.streamer is not None else 22
        shares.append(float((topk_ids < held).float().mean()))
    return orig(self, hidden, topk_ids, topk_weights, *a, **k)


RoutedExpertsCPU.submit = submit
for budget in budgets:
    settings = {"kt_method": "AMXINT8", "kv_cache_tokens": 40000}
    if budget != "off":
        settings["kt_gpu_prefill_tokens"] = 1024
        if budget != "all":
            settings["kt_gpu_prefill_memory"] = float(budget)
    cfg = EngineConfig(model_path=model, model_name="probe", max_concurrent=32, max_model_len=16384,
                       chunk_size=2048, settings=settings)
    run = EngineRun("ktransformers", cfg, out / f"probe-{budget}.log", label=budget)
    run.warm_up(102400)
    rows = []
    for seed in range(3):
        shares.clear()
        before = run.engine.stats().times
        b = (before.gpu, before.expert_wait)
        gen = run.run(generate(run.engine, prompt_ids(8192, 102400, seed=100 + seed), 1, float("inf")))
        after = run.engine.stats().times
        rows.append({"ttft": round(gen.ttft, 3), "gpu_s": round(after.gpu - b[0], 3),
                     "expert_wait_s": round(after.expert_wait - b[1], 3),
                     "share_below_held": round(statistics.mean(shares), 3) if shares else None,
                     "layer_calls": len(shares)})
    print(json.dumps({"budget": budget, "details": {k: v for k, v in run.engine.info.details.items() if "prefill" in k},
                      "runs": rows}), flush=True)
    run.close()
