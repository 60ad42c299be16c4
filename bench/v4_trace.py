"""`python -m bench.v4_trace`: where a DeepSeek-V4 step's time goes, part by part, for a prompt and for decode.

    python -m bench.v4_trace [--v4-layers 2] [--prompt 2048] [--steps 16] [--quick] [--mtp] [--out DIR]

Uses the V4-Flash-shaped checkpoint of `python -m bench.run --shape v4-flash` (bench/v4_flash.py; written unless
one with the same layer count is there; `--quick`: the tiny demo V4's dimensions, a CPU check), starts the KT
engine and drives its V4 steps directly (the runner's `V4Batch`, one sequence on a fresh cache): a `--prompt`-token
prefill in chunks of `--chunk` tokens, then `--steps` decode steps. Each part of the model is timed with the
device synchronized before and after it, so the parts add up but do not overlap (the CPU experts no longer run
beside the shared expert): the sum is slower than a real step, each part shows its own cost, launches included:

* `hyper_connections` — the mHC weights and collapse before each block (`attn_hc`, `ffn_hc`);
* `attention_linears` — attention's q / kv / output projections (with their LoRA wrappers, if any);
* `compressor` — the compressed-KV compressor with its lightning indexer (CSA and HCA layers);
* `router`, `shared_expert`, `experts_submit`, `experts_wait` — the MoE block (the wait: CPU experts still running);
* `embedding`, `head` — the token embedding and the LM head;
* `rest` — the step's wall time less the parts: norms, rope, masks, the sliding-window cache, the attention
  kernel itself, `_mix`, Python.

Then decode steps as the engine runs them (its CUDA graphs where it captured them: `path`), unsynchronized: the real
`decode_step_ms`; steps started with the stream idle, timed on the host and by CUDA events (`host_issue_ms`,
`step_from_idle_ms`, `timeline`: see `_issue_times`); and steps under torch.profiler: `kernels_per_step` (kernel
launches the GPU ran per decode step, per layer), `gpu_kernel_ms_per_step`, the top kernels and the top host ops.
With `--profile-prefill`, the prompt is prefilled once more under torch.profiler (`prefill_profiled`: its top
kernels and host ops); `prefill.chunk_ms` gives each chunk's time, so its growth with the context shows.
Last, `engine_decode`: one request decoded through the engine, where its step thread's time goes per token; where
the engine captured CUDA graphs, with its decode steps over the paged caches whole (their host part made ahead while
the GPU runs the step before, and made at its turn) and as segments, in turns.
Prints one JSON object (also to --out/v4-trace.json).
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

PARTS = ("embedding", "hyper_connections", "attention_linears", "compressor", "router", "shared_expert",
         "experts_submit", "experts_wait", "head")


def _stream_sync(device: torch.device):
    """Wait for the current stream only: the step and the CPU experts' stream callbacks run there (a device-wide
    synchronize would also wait for the engine's other streams)."""
    if device.type != "cuda":
        return lambda: None
    return lambda: torch.cuda.current_stream(device).synchronize()


class PartTimer:
    """Wall time of named parts, the device synchronized around each; a part inside another counts to the outer."""

    def __init__(self, device: torch.device):
        self.sync = _stream_sync(device)
        self.seconds: dict[str, float] = defaultdict(float)
        self.depth = 0
        self.on = False

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            if not self.on or self.depth:
                return fn(*args, **kwargs)
            self.sync()
            self.depth += 1
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.seconds[name] += time.perf_counter() - started
                self.depth -= 1
        return timed

    def hook(self, module: torch.nn.Module, name: str) -> None:
        module.forward = self.wrap(name, module.forward)


def instrument(runner, timer: PartTimer) -> None:
    model = runner.model
    timer.hook(model.model.embed_tokens, "embedding")
    timer.hook(model.lm_head, "head")
    for layer in model.model.layers:
        timer.hook(layer.attn_hc, "hyper_connections")
        timer.hook(layer.ffn_hc, "hyper_connections")
        attn = layer.self_attn
        for name in ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj"):
            timer.hook(getattr(attn, name), "attention_linears")
        if attn.compressor is not None:
            timer.hook(attn.compressor, "compressor")
        mlp = layer.mlp
        timer.hook(mlp.gate, "router")
        timer.hook(mlp.shared_experts, "shared_expert")
        if hasattr(mlp.experts, "submit"):
            mlp.experts.submit = timer.wrap("experts_submit", mlp.experts.submit)
            mlp.experts.wait = timer.wrap("experts_wait", mlp.experts.wait)


def _step(runner, ids: list[int], start: int, end: int, cache, graphs: bool = False) -> None:
    """One step of one sequence: eagerly (each part a call the timer sees), or as the engine runs it (`graphs`:
    the captured row-wise segments, where the engine has them and the step fits)."""
    from engines.kt.families.deepseek_v4.batch import Piece

    run_step(runner, [Piece(ids, start, end, cache, None)], graphs)


def run_step(runner, pieces: list, graphs: bool = True) -> None:
    """One step of `pieces` (batch.py's Piece) through the runner's V4 step, from its graphs where `graphs` and
    the step fits them, then the logits of each piece's last row, as a decode step computes them."""
    path = runner.graphs if graphs and runner.graphs is not None and runner.graphs.fits(pieces) else runner.batch
    streams = path.hidden_streams(pieces)
    last = [sum(p.end - p.start for p in pieces[:i + 1]) - 1 for i in range(len(pieces))]
    runner.model.lm_head(runner.batch.final(streams[last]).to(runner.head_device))


def _parts(timer: PartTimer, wall: float, count: int) -> dict:
    parts = {name: round(timer.seconds.get(name, 0.0) / count * 1e3, 3) for name in PARTS}
    parts["rest"] = round(wall / count * 1e3 - sum(parts.values()), 3)
    return {"wall_ms": round(wall / count * 1e3, 3), "parts_ms": parts}


def trace(runner, device: torch.device, vocab: int, prompt: int, chunk: int, steps: int,
          profile_prefill: bool = False) -> dict:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, vocab, (prompt + 5 * steps + 8,), generator=generator).tolist()
    timer = PartTimer(device)
    instrument(runner, timer)
    sync = timer.sync
    with torch.inference_mode():
        warm = runner._new_cache()
        _step(runner, ids, 0, min(chunk, prompt), warm)
        for at in range(min(chunk, prompt), min(chunk, prompt) + 2):
            _step(runner, ids, at, at + 1, warm)
        cache, out = runner._new_cache(), {}
        timer.on = True
        sync()
        started, chunks = time.perf_counter(), []
        for at in range(0, prompt, chunk):
            _step(runner, ids, at, min(at + chunk, prompt), cache)
            sync()
            chunks.append(round((time.perf_counter() - started) * 1e3 - sum(chunks), 1))
        out["prefill"] = {"tokens": prompt, "chunk": chunk, **_parts(timer, time.perf_counter() - started, 1),
                          "chunk_ms": chunks, "peak_gpu_gb": _peak_gb(device)}
        timer.seconds.clear()
        started = time.perf_counter()
        for at in range(prompt, prompt + steps):
            _step(runner, ids, at, at + 1, cache)
        sync()
        out["decode_synchronized"] = {"steps": steps, **_parts(timer, time.perf_counter() - started, steps)}
        timer.on = False
        out["decode"] = _profiled_decode(runner, ids, prompt + steps, steps, cache, device)
        if profile_prefill:
            out["prefill_profiled"] = _profiled_prefill(runner, ids, prompt, chunk, device)
    return out


def _peak_gb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 1e9, 2) if device.type == "cuda" else None


def _profiled_prefill(runner, ids: list[int], prompt: int, chunk: int, device: torch.device) -> dict:
    """The prompt's chunks again on a fresh cache under torch.profiler: the GPU's kernels (or the host's leaf ops)
    that take the most time, and the host ops, over the whole prefill."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync = _stream_sync(device)
    cache = runner._new_cache()
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for at in range(0, prompt, chunk):
            _step(runner, ids, at, min(at + chunk, prompt), cache)
        sync()
    events = prof.key_averages()
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    gpu_ms = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    return {"gpu_kernel_ms": round(gpu_ms, 1) if cuda else None,
            "top": [{"name": e.key[:90], "count": e.count, "self_ms": round(own(e) / 1e3, 1)}
                    for e in sorted(events, key=own, reverse=True)[:25]],
            "host_top": [{"name": e.key[:90], "count": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 1)}
                         for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]]}


def _profiled_decode(runner, ids: list[int], at: int, steps: int, cache, device: torch.device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    layers = len(runner.model.model.layers)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = _stream_sync(device)
    sync()
    started = time.perf_counter()
    for i in range(steps):  # unprofiled: the real step time
        _step(runner, ids, at + i, at + i + 1, cache, graphs=True)
    sync()
    wall = time.perf_counter() - started
    issued = _issue_times(runner, ids, at + steps, steps, cache, sync)
    with profile(activities=activities) as prof:
        for i in range(2 * steps, 3 * steps):
            _step(runner, ids, at + i, at + i + 1, cache, graphs=True)
        sync()
    events = prof.key_averages()
    if device.type == "cuda":
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    else:
        kernels = sum(e.count for e in events if e.key.startswith("aten::") and e.cpu_children == [])
    top = sorted(events, key=lambda e: e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total,
                 reverse=True)[:12]
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                    ) if device.type == "cuda" else 0.0
    return {"decode_step_ms": round(wall / steps * 1e3, 3), **issued,
            "gpu_kernel_ms_per_step": round(kernel_us / steps / 1e3, 3) if device.type == "cuda" else None,
            "path": getattr(runner.graphs, "describe", lambda: "eager")() if runner.graphs is not None else "eager",
            "kernels_per_step": round(kernels / steps, 1), "kernels_per_step_per_layer": round(kernels / steps / layers, 1),
            "kernels_counted": "CUDA kernels" if device.type == "cuda" else "leaf aten ops (no GPU)",
            "top": [{"name": e.key[:80], "count_per_step": round(e.count / steps, 1),
                     "self_us_per_step": round((e.self_device_time_total if device.type == "cuda"
                                                else e.self_cpu_time_total) / steps, 1)} for e in top],
            "host_top": [{"name": e.key[:80], "count_per_step": round(e.count / steps, 1),
                          "self_cpu_us_per_step": round(e.self_cpu_time_total / steps, 1)}
                         for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]]}


def _issue_times(runner, ids: list[int], at: int, steps: int, cache, sync) -> dict:
    """Decode steps as the engine runs them, each one started with the stream idle: how long the host takes to
    queue a step (`host_issue_ms`: until the step's call returns, nothing waited for), how much of that is each
    sequence's cached attention (`cached_attention_host_ms`, run eagerly between the graphs), and how long until
    the stream has run it (`step_from_idle_ms`). Where the first is close to the last, the step waits on the host.

    `timeline`: at each graph replay and cached attention of the step (in order), when the host reached it
    (`host_ms`, from the step's start) and when the stream had run everything queued before it (`gpu_ms`, a CUDA
    event recorded there): where `gpu_ms` is close to `host_ms`, the GPU sat waiting for the host to get there.
    `host_to_next_ms`: the host's time from there to the next mark over the steps (mean, min, max)."""
    issue = done = cached = 0.0
    batch, graphs = runner.batch, runner.graphs
    cuda = runner.head_device.type == "cuda"
    marks: list[tuple[str, float, object]] = []
    timeline: dict[str, list[float]] = {}
    started = 0.0

    def mark(name: str) -> None:
        event = None
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        marks.append((name, (time.perf_counter() - started) * 1e3, event))

    inner = batch.cached_attention

    def timed(*args, **kwargs):
        nonlocal cached
        mark(f"attention {sum(m[0].startswith('attention') for m in marks)}")
        begun = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            cached += time.perf_counter() - begun

    replays = []
    for k, graph in enumerate((graphs.graphs.get(1) or []) if graphs is not None else []):
        def replay(graph=graph, k=k, original=graph.replay):
            mark(f"replay {k}")
            return original()
        replays.append((graph, graph.replay))
        graph.replay = replay
    batch.cached_attention = timed
    try:
        for i in range(steps):
            sync()
            marks.clear()
            begin = torch.cuda.Event(enable_timing=True) if cuda else None
            started = time.perf_counter()
            if begin is not None:
                begin.record()
            _step(runner, ids, at + i, at + i + 1, cache, graphs=True)
            issue += time.perf_counter() - started
            mark("issued")
            sync()
            done += time.perf_counter() - started
            for (name, host_ms, event), after in zip(marks, marks[1:] + [("", 0.0, None)]):
                timeline.setdefault(name, []).append((host_ms, begin.elapsed_time(event) if cuda else 0.0,
                                                      after[1] - host_ms if after[0] else 0.0))
    finally:
        del batch.cached_attention
        for graph, original in replays:
            graph.replay = original
    means = {name: (sum(t[0] for t in v) / steps, sum(t[1] for t in v) / steps, sum(t[2] for t in v) / steps)
             for name, v in timeline.items()}
    return {"host_issue_ms": round(issue / steps * 1e3, 3), "cached_attention_host_ms": round(cached / steps * 1e3, 3),
            "step_from_idle_ms": round(done / steps * 1e3, 3),
            "timeline": [{"at": name, "host_ms": round(means[name][0], 3),
                          "gpu_ms": round(means[name][1], 3) if cuda else None,
                          "host_to_next_ms": {"mean": round(means[name][2], 3),
                                              "min": round(min(t[2] for t in v), 3),
                                              "max": round(max(t[2] for t in v), 3)}}
                         for name, v in timeline.items()],
            **(_by_layer_kind(means, runner.config.layer_types) if cuda and graphs is not None else {})}


def _by_layer_kind(means: dict[str, tuple[float, float, float]], kinds: list[str]) -> dict:
    """From the timeline's means (host ms, GPU ms, host ms to the next mark), each layer's host time (its cached
    attention, then the replay of the segment after it) and GPU time (from its cached attention to the next one, or
    to the step's end: the last layer's includes the head), averaged by attention kind; and those added up over
    V4-Flash's 43 layers (computed, not measured: whether a full-depth step would wait for the host)."""
    from transformers import DeepseekV4Config

    from bench.v4_flash import FLASH_LAYERS, flash_config

    per_kind: dict[str, list[tuple[float, float]]] = defaultdict(list)
    replays = [means[f"replay {k}"][2] for k in range(1, len(kinds)) if f"replay {k}" in means]
    for k, kind in enumerate(kinds):
        attention, replay = means.get(f"attention {k}"), means.get(f"replay {k + 1}")
        after = means.get(f"attention {k + 1}") or means.get("issued")
        if attention is None or replay is None or after is None:
            continue
        # the last replay's host time runs on into the head: the other replays' mean stands in for it
        host = replay[2] if k + 1 < len(kinds) or not replays else sum(replays) / len(replays)
        per_kind[kind].append((attention[2] + host, after[1] - attention[1]))
    by_kind = {kind: {"layers": len(v), "host_ms": round(sum(h for h, _ in v) / len(v), 3),
                      "gpu_ms": round(sum(g for _, g in v) / len(v), 3)} for kind, v in per_kind.items()}
    schedule = DeepseekV4Config(**flash_config(FLASH_LAYERS)).layer_types  # the released config's kinds, as read
    if not all(kind in by_kind for kind in schedule):
        return {"by_layer_kind": by_kind}
    return {"by_layer_kind": by_kind, "layers_43_computed": {
        "host_ms": round(sum(by_kind[kind]["host_ms"] for kind in schedule), 2),
        "gpu_ms": round(sum(by_kind[kind]["gpu_ms"] for kind in schedule), 2),
        "note": "each kind's per-layer figures above added over V4-Flash's 43 layers; where host_ms comes near "
                "gpu_ms, full-depth steps wait for the host"}}


def drafted(root, config: dict, threads: int | None, steps: int) -> dict:
    """Decode with `speculative: mtp` over a random MTP layer (bench/mtp.py's `random` variant), through the engine
    as a request runs: the time per generated token of the main model's steps (`execute`), the draft head's block
    (`head_block`) and its logits (`head_logits`), the stream synchronized around each, and the `rest` (proposal
    bookkeeping, sampling, scheduling). `execute_calls` splits the main steps by the rows they fed (the prompt's
    chunk, then verification steps of the last token and its draft) and `inside_execute` times their parts (each
    part synchronized too; parts nest in `execute`, not in each other). Then a second run of the same length under
    the profiler: its top kernels and host ops."""
    import asyncio

    from bench.lib.engine_runs import generate
    from bench.mtp import v4_variant
    from bench.lib.shapes import prompt_ids
    from engines.base import EngineConfig
    from engines.kt.engine import KTEngine
    from engines.kt.families.deepseek_v4.caches import SequenceCache

    path = v4_variant(root, config, "random")
    engine = KTEngine(EngineConfig(model_path=str(path), model_name="bench-v4-trace-mtp", max_concurrent=1,
                                   max_model_len=4096, chunk_size=2048,
                                   settings={"speculative": "mtp", **({"cpu_infer": threads} if threads else {})}))
    engine.start()
    begin, commit = SequenceCache.begin, SequenceCache.commit
    try:
        runner = engine._runner
        device = runner.head_device
        timer, inner = PartTimer(device), PartTimer(device)
        calls: list[tuple[int, float]] = []  # (rows fed, seconds) of each main step
        execute = timer.wrap("execute", runner.execute)

        def counted(chunks):
            started = time.perf_counter()
            try:
                return execute(chunks)
            finally:
                if timer.on:
                    calls.append((sum(c.num_tokens + len(c.draft) for c in chunks), time.perf_counter() - started))

        runner.execute = counted
        runner.head.forward = timer.wrap("head_block", runner.head.forward)
        runner.head.logits = timer.wrap("head_logits", runner.head.logits)
        SequenceCache.begin = inner.wrap("cache_begin", begin)  # rollback and replay of the rejected draft
        SequenceCache.commit = inner.wrap("cache_commit", commit)
        runner._logits = inner.wrap("logits", runner._logits)
        runner.batch.hidden_streams = inner.wrap("step_eager", runner.batch.hidden_streams)
        if runner.graphs is not None:
            runner.graphs.hidden_streams = inner.wrap("step_graphs", runner.graphs.hidden_streams)
        vocab = config["vocab_size"]
        asyncio.run(generate(engine, prompt_ids(64, vocab, seed=2), 4, float("inf")))
        before = engine.stats()
        replayed = getattr(runner.graphs, "replayed", 0)
        timer.on = inner.on = True
        started = time.perf_counter()
        run = asyncio.run(generate(engine, prompt_ids(64, vocab, seed=1), steps + 1, float("inf")))
        wall = time.perf_counter() - started
        timer.on = inner.on = False
        after = engine.stats()
        tokens = len(run.token_times)
        parts = {k: round(v / tokens * 1e3, 3) for k, v in timer.seconds.items()}
        parts["rest"] = round(wall / tokens * 1e3 - sum(parts.values()), 3)
        verify = [s for rows, s in calls if rows <= 8]
        result = {"tokens": tokens, "wall_ms_per_token": round(wall / tokens * 1e3, 3), "ms_per_token": parts,
                  "execute_calls": {"prompt": [{"rows": rows, "ms": round(s * 1e3, 2)} for rows, s in calls if rows > 8],
                                    "verify_count": len(verify),
                                    "verify_rows": sorted({rows for rows, _ in calls if rows <= 8}),
                                    "verify_ms_mean": round(sum(verify) / max(len(verify), 1) * 1e3, 3),
                                    "graph_replays": getattr(runner.graphs, "replayed", 0) - replayed},
                  "inside_execute_ms_per_call": {k: round(v / max(len(calls), 1) * 1e3, 3)
                                                 for k, v in inner.seconds.items()},
                  "draft_tokens": after.draft_tokens - before.draft_tokens,
                  "accepted_draft_tokens": after.accepted_draft_tokens - before.accepted_draft_tokens,
                  "cuda_graphs": engine.info.details.get("cuda_graphs")}
        result["profiled"] = _profiled_generate(engine, prompt_ids(64, vocab, seed=3), steps + 1, device)
        return result
    finally:
        SequenceCache.begin, SequenceCache.commit = begin, commit
        engine.stop()


def engine_decode(engine, vocab: int, tokens: int) -> dict:
    """Decode as the engine serves it: one greedy request of `tokens` tokens after a 64-token prompt, its steps on
    the engine's step thread. Per decode step, the host's time (nothing synchronized) in the runner's step
    (`execute`), inside it in the step's parts and the logits (`hidden_streams`, `logits`), and in the sampler
    (`sample_batch`: it waits for the GPU); `outside` is the rest of the time per token (the step loop, delivery). Set
    beside the trace's `host_issue_ms` and `step_from_idle_ms`, these say what the engine adds to a step."""
    import asyncio

    from bench.lib.engine_runs import generate
    from bench.lib.shapes import prompt_ids

    runner, sampler = engine._runner, engine._sampler
    seconds: dict[str, float] = defaultdict(float)
    decoding = {"on": False, "steps": 0}

    def timed(name: str, fn, step: bool = False):
        def wrapper(*args, **kwargs):
            if step:
                decoding["on"] = all(c.num_tokens == 1 and not c.draft for c in args[0])
                decoding["steps"] += decoding["on"]
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if decoding["on"]:
                    seconds[name] += time.perf_counter() - started
        return wrapper

    patched = [(runner, "execute", True), (runner, "_logits", False), (sampler, "sample_batch", False),
               (runner.batch, "hidden_streams", False)] + (
        [(runner.graphs, "hidden_streams", False)] if runner.graphs is not None else [])
    for owner, name, step in patched:
        setattr(owner, name, timed("hidden_streams" if name == "hidden_streams" else name.strip("_"),
                                   getattr(owner, name), step))
    try:
        asyncio.run(generate(engine, prompt_ids(64, vocab, seed=6), 4, float("inf")))
        seconds.clear()
        decoding["steps"] = 0
        run = asyncio.run(generate(engine, prompt_ids(64, vocab, seed=7), tokens + 1, float("inf")))
    finally:
        for owner, name, _ in patched:
            delattr(owner, name)
    times = run.token_times
    steps = max(decoding["steps"], 1)
    wall = (times[-1] - times[0]) / max(len(times) - 1, 1)
    out = {"decode_steps": decoding["steps"], "wall_ms_per_token": round(wall * 1e3, 3)}
    out.update({f"{k}_ms": round(v / steps * 1e3, 3) for k, v in seconds.items()})
    out["outside_ms"] = round((wall - (seconds["execute"] + seconds["sample_batch"]) / steps) * 1e3, 3)
    return out


def engine_decode_paths(engine, vocab: int, tokens: int, rounds: int = 3) -> dict:
    """`engine_decode` with the decode steps over the paged caches captured whole (graphs.py), whole with each
    step's host part made at its turn instead of while the GPU ran the step before (`forecast_off`), and as segments
    with their cached attention eager, in turns for `rounds` rounds in one engine (the host's bandwidth drifts
    between runs, so the paths are compared round by round): each round's figures and each path's median
    `wall_ms_per_token`. Without captured graphs: the one path the engine runs."""
    graphs = engine._runner.graphs
    if graphs is None or not getattr(graphs, "captured", False) or graphs.whole_off is not None:
        return {"engine": engine_decode(engine, vocab, tokens),
                "whole_off": getattr(graphs, "whole_off", None) if graphs is not None else "no CUDA graphs"}
    runs: dict[str, list[dict]] = {"whole": [], "whole_at_turn": [], "segments": []}
    off = "turned off to compare (bench.v4_trace)"
    for _ in range(rounds):
        used = graphs.forecasts_used
        runs["whole"].append(engine_decode(engine, vocab, tokens))
        runs["whole"][-1]["made_ahead"] = graphs.forecasts_used - used
        if graphs.whole_off is not None:  # a capture failed: the engine serves segments from now on
            return {**runs, "whole_off": graphs.whole_off}
        for path, switch in (("whole_at_turn", "forecast_off"), ("segments", "whole_off")):
            setattr(graphs, switch, off)
            try:
                runs[path].append(engine_decode(engine, vocab, tokens))
            finally:
                setattr(graphs, switch, None)
    median = {path: sorted(r["wall_ms_per_token"] for r in v)[len(v) // 2] for path, v in runs.items()}
    return {**runs, "median_wall_ms_per_token": median,
            "at_turn_over_whole": round(median["whole_at_turn"] / median["whole"], 3),
            "segments_over_whole": round(median["segments"] / median["whole"], 3)}


def _profiled_generate(engine, prompt: list[int], tokens: int, device: torch.device) -> dict:
    """One request of `tokens` tokens under the profiler, started and stopped on the engine's step thread (where
    its steps run): the top kernels by device time and the top host ops by their own time, per generated token."""
    import asyncio

    from torch.profiler import ProfilerActivity, profile

    from bench.lib.engine_runs import generate

    runner = engine._runner
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    state = {"want": True, "prof": None}
    execute = runner.execute

    def profiled(chunks):
        if state["want"] and state["prof"] is None:
            state["prof"] = profile(activities=activities)
            state["prof"].__enter__()
        elif not state["want"] and state["prof"] is not None and not state.get("stopped"):
            _stream_sync(device)()
            state["prof"].__exit__(None, None, None)
            state["stopped"] = True
        return execute(chunks)

    runner.execute = profiled
    try:
        asyncio.run(generate(engine, prompt, tokens, float("inf")))
        state["want"] = False
        asyncio.run(generate(engine, prompt[:8], 1, float("inf")))  # its first step stops the profiler
    finally:
        runner.execute = execute
    events = state["prof"].key_averages()

    def top(key, n: int = 15) -> list[dict]:
        return [{"name": e.key[:80], "count_per_token": round(e.count / tokens, 1),
                 "self_us_per_token": round(key(e) / tokens, 1)}
                for e in sorted(events, key=key, reverse=True)[:n] if key(e) > 0]

    return {"tokens": tokens, "device": top(lambda e: e.self_device_time_total) if device.type == "cuda" else [],
            "host": top(lambda e: e.self_cpu_time_total)}


def main() -> int:
    from bench.lib.report import print_and_write
    from bench.v4_flash import _checkpoint
    from engines.base import EngineConfig
    from engines.kt.engine import KTEngine

    p = argparse.ArgumentParser(prog="python -m bench.v4_trace", description=__doc__.split("\n\n")[0])
    p.add_argument("--v4-layers", type=int, default=2, help="layers of the V4-Flash-shaped checkpoint")
    p.add_argument("--prompt", type=int, default=2048, help="prompt tokens prefilled while traced")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (the engine's chunk_size)")
    p.add_argument("--steps", type=int, default=16, help="decode steps traced (twice: synchronized, profiled)")
    p.add_argument("--threads", type=int, help="kt-kernel threads (cpu_infer); default: the engine's")
    p.add_argument("--model-dir", help="checkpoint folder (default /tmp/ktserve-bench/v4-flash[-quick])")
    p.add_argument("--quick", action="store_true", help="the tiny demo V4's dimensions (a CPU check)")
    p.add_argument("--mtp", action="store_true", help="instead: time a drafted decode's parts (speculative: mtp)")
    p.add_argument("--out", help="also write v4-trace.json into this folder")
    p.add_argument("--profile-prefill", action="store_true",
                   help="also prefill the prompt once more under torch.profiler (its top kernels and host ops)")
    args = p.parse_args()
    root, config, built = _checkpoint(args)
    if args.mtp:
        print_and_write({"shape": "v4-flash-quick" if args.quick else "v4-flash", "layers": config["num_hidden_layers"],
                         "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                         "drafted": drafted(root, config, args.threads, args.steps)}, args.out, "v4-trace-mtp.json")
        return 0
    engine = KTEngine(EngineConfig(model_path=str(root), model_name="bench-v4-trace", max_concurrent=1,
                                   max_model_len=args.prompt + 4 * args.steps + 64, chunk_size=args.chunk,
                                   settings={"cpu_infer": args.threads} if args.threads else {}))
    engine.start()
    try:
        runner = engine._runner
        device = runner.head_device
        result = {"shape": "v4-flash-quick" if args.quick else "v4-flash", "layers": config["num_hidden_layers"],
                  "build_s": round(built, 1), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  "engine_details": dict(engine.info.details),
                  **trace(runner, device, config["vocab_size"], args.prompt, args.chunk, args.steps,
                           args.profile_prefill),
                  "engine_decode": engine_decode_paths(engine, config["vocab_size"], 2 * args.steps)}
    finally:
        engine.stop()
    print_and_write(result, args.out, "v4-trace.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
