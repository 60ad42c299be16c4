"""Engine-level measurements through the Engine API: load an engine, decode with one request, time the first
token at several prompt lengths. Requests are greedy with `ignore_eos`, so every run produces exactly the
tokens asked for; token times are taken where the caller receives them (the handle's queue)."""
from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.lib.report import fig, median, percentile
from bench.lib.shapes import prompt_ids
from bench.lib.sysinfo import memory_snapshot, reset_peaks, stdout_to
from engines.base import Engine, EngineConfig, EngineStats, GenerationRequest, SamplingParams


SLOW_FACTOR = 1.3  # a token gap above this times the median is a stall (the speed issue's TPOT p99 target)


@dataclass
class Generation:
    prompt_tokens: int
    submitted: float
    token_times: list[float] = field(default_factory=list)
    stopped_early: bool = False
    cached_tokens: int = 0  # prompt tokens the engine says its prefix cache served (GenerationOutput.cached_tokens)
    stats: list[EngineStats] = field(default_factory=list)  # engine counters as each token arrived
    gc_pauses: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, generation)

    @property
    def stats_at_first_token(self) -> EngineStats | None:
        """The engine counters when the first token arrived (the prompt's steps end there)."""
        return self.stats[0] if self.stats else None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.submitted if self.token_times else None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def figures(self, ceiling: float | None = None) -> dict:
        """Decode speed counts from the first token to the last: prefill stays out of it."""
        n, gaps = len(self.token_times), self.gaps
        rate = (n - 1) / (self.token_times[-1] - self.token_times[0]) if n > 1 else None
        out = {"prompt_tokens": self.prompt_tokens, "output_tokens": n, "ttft": fig(self.ttft, "s"),
               "decode_throughput": fig(rate, "tok/s", note="(tokens - 1) / (last token time - first token time)"),
               "tpot_median": fig(_ms(median(gaps)), "ms"), "tpot_p99": fig(_ms(percentile(gaps, 99)), "ms")}
        if ceiling and rate:
            out["fraction_of_ceiling"] = fig(rate / ceiling, "fraction", ceiling_tok_s=ceiling)
        if self.stopped_early:
            out["stopped_early"] = "phase deadline reached"
        slow = self.slow_steps()
        if slow:
            out["slow_steps"] = slow
        return out

    def slow_steps(self, factor: float = SLOW_FACTOR) -> dict:
        """The token gaps longer than `factor` x the median (what makes TPOT p99 exceed it), and what the engine
        counted during them: the GPU / expert-wait time the runner added between the two tokens' arrivals (it
        adds a step's before delivering its token), the rest of the gap as other; and the Python garbage
        collections that ran while decoding, since a collection holds the GIL the step needs."""
        gaps = self.gaps
        if len(gaps) < 2 or len(self.stats) != len(self.token_times):
            return {}
        threshold = factor * median(gaps)
        slow = [i for i, g in enumerate(gaps) if g > threshold]
        parts = {"gpu": [], "expert_wait": [], "other": []}
        for i in slow:
            a, b = self.stats[i], self.stats[i + 1]
            gpu, wait = b.times.gpu - a.times.gpu, b.times.expert_wait - a.times.expert_wait
            for name, value in (("gpu", gpu), ("expert_wait", wait), ("other", gaps[i] - gpu - wait)):
                parts[name].append(value)
        start, end = self.token_times[0], self.token_times[-1]
        pauses = [(s, e, g) for s, e, g in self.gc_pauses if e > start and s < end]
        overlapping = sum(1 for i in slow if any(s < self.token_times[i + 1] and e > self.token_times[i]
                                                 for s, e, _ in pauses))
        out = {"threshold": fig(_ms(threshold), "ms", note=f"{factor} x the median token gap"),
               "count": len(slow), "of": len(gaps),
               "gap_mean": fig(_ms(sum(gaps[i] for i in slow) / len(slow)) if slow else None, "ms"),
               "with_gc": overlapping,
               "gc_while_decoding": {"collections": len(pauses),
                                     "by_generation": [sum(1 for p in pauses if p[2] == g) for g in range(3)],
                                     "max": fig(_ms(max((e - s for s, e, _ in pauses), default=0.0)), "ms")}}
        for name, values in parts.items():
            if values:
                out[f"{name}_mean"] = fig(_ms(sum(values) / len(values)), "ms")
        return out


class GCPauses:
    """Records each Python garbage collection (start, end, generation) into `into` while the block runs."""

    def __init__(self, into: list[tuple[float, float, int]]):
        self.into, self._started = into, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.into.append((self._started, time.perf_counter(), info["generation"]))

    def __enter__(self) -> GCPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


async def generate(engine: Engine, prompt: list[int], max_tokens: int, deadline: float) -> Generation:
    """One greedy request with ignore_eos; cancelled once `deadline` (perf_counter) passes."""
    run = Generation(len(prompt), time.perf_counter())
    handle = engine.submit(GenerationRequest(
        prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    with GCPauses(run.gc_pauses):
        async for out in handle:
            now = time.perf_counter()
            run.cached_tokens = max(run.cached_tokens, out.cached_tokens)
            if out.token_ids:
                run.token_times.extend([now] * len(out.token_ids))
                run.stats.extend([engine.stats()] * len(out.token_ids))
            if out.finish_reason == "error":
                raise RuntimeError(f"engine error: {out.error}")
            if now > deadline and not out.finished:
                handle.cancel()
                run.stopped_early = True
                break
    return run


class EngineRun:
    """One started engine with its own event loop; `close()` stops it and gives its memory back."""

    def __init__(self, engine_name: str, config: EngineConfig, log_path: Path, label: str | None = None):
        from engines.registry import create_engine

        self.label = label or engine_name
        self.loop = asyncio.new_event_loop()
        self.rss_reset = reset_peaks()
        started = time.perf_counter()
        self.engine = create_engine(engine_name, config)
        with stdout_to(log_path):
            self.engine.start()
        self.load_time = time.perf_counter() - started
        self.memory_after_load = memory_snapshot(self.rss_reset)

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def warm_up(self, vocab: int) -> None:
        self.run(generate(self.engine, prompt_ids(16, vocab, seed=99), 4, float("inf")))

    def decode(self, prompt_len: int, tokens: int, vocab: int, deadline: float, ceiling: float | None) -> dict:
        gen = self.run(generate(self.engine, prompt_ids(prompt_len, vocab, seed=1), tokens, deadline))
        out = gen.figures(ceiling)
        if gen.stats_at_first_token is not None:
            out.update(step_breakdown(gen.stats_at_first_token, self.engine.stats()))
        return out

    def close(self) -> dict:
        """Stop the engine; the host memory still held afterwards shows whether it was given back."""
        self.engine.stop()
        self.engine = None
        self.loop.close()
        release_memory()
        return memory_snapshot()["host_rss"]


def step_breakdown(before: EngineStats, after: EngineStats) -> dict:
    """Where the decode steps' time went, per step (engines/kt/step_timing.py says how each is measured).
    `before` is read when the first token arrived, so the prompt's steps stay out of it."""
    steps = after.steps - before.steps
    step = after.times.step - before.times.step
    if steps <= 0 or step <= 0:
        return {}
    wait = after.times.expert_wait - before.times.expert_wait
    gpu = after.times.gpu - before.times.gpu
    expert = after.times.expert - before.times.expert
    forward = after.times.forward - before.times.forward

    def per_step(seconds: float, note: str) -> dict:
        return fig(seconds / steps * 1e3, "ms", note=note)
    return {
        "expert_wait_share": fig(wait / step, "fraction", note="share of step time stalled on the CPU experts: "
                                 "on a GPU the stream's wait inside kt-kernel (CUDA events), else Python's sync()"),
        "step_breakdown": {
            "steps": steps,
            "step": per_step(step, "wall time of a generation-thread step: input, forward, sampling, detokenizing, "
                                "outputs queued (handed to the server just after it is counted)"),
            "gpu": per_step(gpu, "GPU stream span of the step less the expert stalls (0 without a GPU)"),
            "expert_wait": per_step(wait, "stalled on CPU experts, summed over layers"),
            "expert": per_step(expert, "CPU experts submitted -> results ready, summed over layers; overlaps the "
                               "GPU work"),
            "other": per_step(max(0.0, step - gpu - wait), "step - gpu - expert_wait: Python (inputs, graph "
                              "launch, sampling, detokenizing, delivery); without a GPU also the non-expert compute"),
            "after_forward": per_step(max(0.0, step - forward), "the part of `other` after the model's forward: "
                                      "sampling, detokenizing, delivery"),
        }}


def release_memory() -> None:
    """Collect what a stopped (or half-built) engine left, and hand cached GPU blocks back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ttft_points(run: EngineRun, lengths: tuple[int, ...], tokens: int, vocab: int, deadline: float) -> list[dict]:
    """Time to first token per prompt length, and the time per output token right after it.

    Each length runs twice, with different prompts (no shared prefix): the first prompt of a length pays for
    what a server does once per shape (GPU kernels chosen and compiled for new sizes: 0.2-0.3 s of a 2,048-token
    prompt on the GPU machine), which a server that has been running a while no longer does; `ttft` is the
    second, `ttft_first` the first."""
    points = []
    for length in lengths:
        if time.perf_counter() > deadline:
            break
        first = run.run(generate(run.engine, prompt_ids(length, vocab, seed=length), tokens, deadline))
        if time.perf_counter() > deadline:
            break
        gen = run.run(generate(run.engine, prompt_ids(length, vocab, seed=length + 1), tokens, deadline))
        f = gen.figures()
        points.append({"prompt_tokens": length, "ttft": f["ttft"], "ttft_first": first.figures()["ttft"],
                       "tpot_median": f["tpot_median"], "tpot_p99": f["tpot_p99"], "output_tokens": f["output_tokens"],
                       "prefill_throughput": fig(length / gen.ttft if gen.ttft else None, "tok/s")})
    return points
