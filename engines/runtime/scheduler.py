"""Continuous batching: which sequences run this step, and how many tokens of each.

Every step carries one decode token for each running sequence that has finished its prompt, then spends a
token budget (`chunk_size`) on prompts: continuing chunked prefills first, then admitting waiting requests
(by priority, then arrival: `GenerationRequest.priority`) while fewer than `max_running` generate and the
runner has KV room for them. A waiting request whose prompt starts with pages a running one is still
computing waits for them, keeping its place and its slot, and is admitted once they are cached (the other
choices of an n > 1 request, a batch sharing a preamble). A runner may end a prompt chunk early, where it keeps
the cache's state for its prefix cache (`ModelRunner.prefill_end`: DeepSeek-V4's page boundaries, for
batch-invariant requests). The scheduler
never touches a tensor; the runner decides whether a sequence fits.

KV room goes by use, not by reservation: a request is admitted with room for the tokens it holds (the runner
keeps a small margin free), and each step first makes room for every running sequence's next positions,
oldest first. When the cache is full, the newest running sequence is preempted (vLLM's recompute
preemption): its KV is freed and it goes back to the front of the queue with every token it generated, its
sampler state and its detokenizer untouched. Readmitted, it recomputes its tokens (its prefix-cache pages
may still hold most of them) and samples the next one, so its output and its stream are those of a run
without the preemption. No request is admitted in a step that had to preempt."""
from __future__ import annotations

import logging
import threading
from collections import deque

from engines.base import QueueFullError
from engines.runtime.model_runner import ModelRunner, ScheduledChunk
from engines.runtime.sequence import Sequence, Status

log = logging.getLogger("ktserve.engine")


class Scheduler:
    def __init__(self, runner: ModelRunner, *, max_running: int, max_queue: int, chunk_size: int):
        self._runner = runner
        self.max_running = max_running
        self.max_queue = max_queue
        self.chunk_size = chunk_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # prompt tokens of admitted sequences, and how many of them were found in the prefix cache
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.preemptions = 0
        self._lock = threading.Lock()  # add() runs on the event loop's thread, the rest on the engine's

    def add(self, seq: Sequence) -> None:
        with self._lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests); retry later")
            self.waiting.append(seq)
            self._before_lower_priorities(seq)

    def _before_lower_priorities(self, seq: Sequence) -> None:
        """Move the just-queued `seq` ahead of the waiting sequences of a lower priority (a higher number), so
        an interactive request never waits behind background work; sequences of equal priority keep arrival
        order."""
        waiting, priority = self.waiting, seq.request.priority
        at = len(waiting) - 1
        while at > 0 and waiting[at - 1].request.priority > priority:
            at -= 1
        if at < len(waiting) - 1:
            waiting.pop()
            waiting.insert(at, seq)

    def remove(self, seq: Sequence) -> None:
        with self._lock:
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    def schedule(self) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        budget = self.chunk_size
        with self._lock:
            preempted = self._make_room()
            for seq in self.running:
                if seq.num_computed == len(seq) - 1:  # decoding: feed the token sampled last step
                    chunks.append(self._chunk(seq, len(seq)))
            for seq in self.running:
                if seq.num_computed < len(seq) - 1 and budget > 0:
                    budget -= self._prefill(seq, budget, chunks)
            held = 0  # waiting sequences passed over for a prefix in flight; they keep their place and slot
            while (not preempted and held < len(self.waiting) and len(self.running) + held < self.max_running
                   and budget > 0):
                seq = self.waiting[held]
                prefilling = [s for s in self.running if s.num_computed < s.num_prompt_tokens]
                if prefilling and self._runner.prefix_in_flight(seq, prefilling):
                    held += 1
                    continue
                cached = self._runner.admit(seq)
                if cached is None:
                    break  # no KV room now; it stays in line
                seq.num_computed = seq.prefill_origin = cached
                if not seq.preemptions:  # a readmitted sequence's prompt was counted when it first started
                    seq.num_cached_tokens = cached
                    self.prompt_tokens += seq.num_prompt_tokens
                    self.cached_prompt_tokens += cached
                del self.waiting[held]
                seq.status = Status.RUNNING
                self.running.append(seq)
                budget -= self._prefill(seq, budget, chunks)
        return chunks

    def _make_room(self) -> bool:
        """KV room for every running sequence's positions up to its length (a decode's next token; a prompt's
        pages came with its admission), oldest first, preempting the newest while the cache is full. Whether
        any sequence was preempted."""
        preempted = False
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            while not self._runner.grow(seq, len(seq)):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                i += 1
        return preempted

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._runner.release(seq)
        seq.num_computed = 0
        seq.preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1
        log.debug("KV cache full: request %s preempted with %d tokens (it recomputes them when readmitted)",
                  seq.id, len(seq))

    def _prefill(self, seq: Sequence, budget: int, chunks: list[ScheduledChunk]) -> int:
        remaining = len(seq) - seq.num_computed
        if not self._runner.chunked_prefill:
            n = remaining
        elif seq.batch_invariant:
            # cut every chunk size from its origin only, so the chunks are the sequence's own whatever its
            # neighbours take of the budget: a chunk that does not fit waits a step (the first prefill of a
            # step always finds the whole budget, so one always moves)
            n = min(remaining, self.chunk_size - (seq.num_computed - seq.prefill_origin) % self.chunk_size)
            if n > budget:
                return 0
        else:
            n = min(remaining, budget)
        end = self._runner.prefill_end(seq, seq.num_computed + n)  # a position whose cache state the runner keeps
        chunks.append(self._chunk(seq, end))
        return end - seq.num_computed

    @staticmethod
    def _chunk(seq: Sequence, end: int) -> ScheduledChunk:
        # a recomputed prompt (after a preemption) computes again the logprobs it already has: they are not kept
        wants_prompt_logprobs = (seq.prompt_logprobs is not None and seq.num_computed < seq.num_prompt_tokens
                                 and len(seq.prompt_logprobs) < seq.num_prompt_tokens)
        return ScheduledChunk(seq=seq, start=seq.num_computed, end=end, all_logits=wants_prompt_logprobs)
