"""Embeddings, batched across requests: every request that arrives while the engine thread is busy with a
step joins the next batch, and the batch runs between two steps in forwards of up to `token_budget` tokens
(prompts with the same adapter together).

Pooling: the mean of the final (normed) hidden states over all of a prompt's tokens, scaled to unit length
(L2). Mean pooling uses the whole text; a causal model's last token alone mostly describes what comes next."""
from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from engines.runtime.model_runner import ModelRunner


def pool(states: torch.Tensor) -> list[float]:
    """[tokens, hidden] -> the unit-length mean."""
    mean = states.mean(dim=0)
    return torch.nn.functional.normalize(mean, dim=0).tolist()


@dataclass(slots=True)
class _Job:
    prompts: list[list[int]]
    adapter: str | None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class EmbeddingQueue:
    """`schedule(fn)` runs fn on the engine thread between steps (LLMEngine._command)."""

    def __init__(self, runner: ModelRunner, schedule: Callable[[Callable[[], None]], concurrent.futures.Future],
                 token_budget: int):
        self._runner = runner
        self._schedule = schedule
        self.token_budget = token_budget
        self._lock = threading.Lock()
        self._pending: list[_Job] = []

    def submit(self, prompts: list[list[int]], adapter: str | None) -> concurrent.futures.Future:
        """A future of one embedding per prompt."""
        job = _Job(prompts, adapter)
        with self._lock:
            first = not self._pending
            self._pending.append(job)
        if first:  # one command runs everything pending at that time
            command = self._schedule(self._run_pending)
            command.add_done_callback(self._command_done)
        return job.future

    def _command_done(self, command: concurrent.futures.Future) -> None:
        exc = command.exception()
        if exc is not None:  # the engine stopped before it ran the batch
            self.fail_pending(exc)

    def _run_pending(self) -> None:
        with self._lock:
            jobs, self._pending = self._pending, []
        for adapter in dict.fromkeys(job.adapter for job in jobs):
            group = [job for job in jobs if job.adapter == adapter]
            try:
                vectors = self._embed([p for job in group for p in job.prompts], adapter)
            except Exception as exc:  # handed to each waiting request
                for job in group:
                    job.future.set_exception(exc)
                continue
            start = 0
            for job in group:
                job.future.set_result(vectors[start:start + len(job.prompts)])
                start += len(job.prompts)

    def _embed(self, prompts: list[list[int]], adapter: str | None) -> list[list[float]]:
        vectors: list[list[float]] = []
        batch: list[list[int]] = []
        for prompt in prompts + [[]]:  # the empty sentinel flushes the last batch
            if batch and (not prompt or sum(map(len, batch)) + len(prompt) > self.token_budget):
                vectors += [pool(states) for states in self._runner.final_hidden_states(batch, adapter)]
                batch = []
            if prompt:
                batch.append(prompt)
        return vectors

    def fail_pending(self, exc: BaseException) -> None:
        with self._lock:
            jobs, self._pending = self._pending, []
        for job in jobs:
            job.future.set_exception(exc)
