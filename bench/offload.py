"""The baseline users know for a model larger than their GPU: plain transformers with accelerate offload
(`device_map="auto"`, GPU memory capped), decoding greedily with its own KV cache. Not one of our engines:
it shows what the KT engine is compared against. Prefill and every decode step are timed separately."""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import torch

from bench.lib.engine_runs import Generation, release_memory
from bench.lib.report import fig
from bench.lib.shapes import prompt_ids
from bench.lib.sysinfo import memory_snapshot, reset_peaks, stdout_to


def run_offload(model_dir: Path, model_bytes: int, gpu_memory: str, prompt_len: int, tokens: int, vocab: int,
                deadline: float, log_path: Path) -> dict:
    from transformers import AutoModelForCausalLM, DynamicCache

    cuda = torch.cuda.is_available()
    # Room for the whole model on the host, so nothing spills to disk; MemTotal can read low on these VMs.
    host = f"{-(-2 * model_bytes // 2 ** 30)}GiB"
    max_memory = {0: gpu_memory, "cpu": host} if cuda else {"cpu": host}
    rss_reset = reset_peaks()
    started = time.perf_counter()
    with stdout_to(log_path):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, device_map="auto",
                                                     max_memory=dict(max_memory)).eval()
    load_time = time.perf_counter() - started
    placement = Counter(str(d) for d in (getattr(model, "hf_device_map", None) or {}).values())
    device = torch.device("cuda:0" if cuda else "cpu")
    ids = torch.tensor([prompt_ids(prompt_len, vocab, seed=1)], device=device)
    run = Generation(prompt_len, time.perf_counter())
    try:
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            for _ in range(tokens):
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                token.item()  # waits for the GPU
                run.token_times.append(time.perf_counter())
                if len(run.token_times) == tokens:
                    break
                if time.perf_counter() > deadline:
                    run.stopped_early = True
                    break
                out = model(input_ids=token.to(device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        result = {"load_time": fig(load_time, "s"), "decode": run.figures(),
                  "placement": dict(placement), "max_memory": {str(k): v for k, v in max_memory.items()},
                  "memory": memory_snapshot(rss_reset)}
        if not cuda:
            result["note"] = "no GPU: everything on the CPU; not an offload measurement"
        return result
    finally:
        del model
        release_memory()
