"""The V4 model runner: transformers' `DeepseekV4ForCausalLM` (compressed sparse / heavily compressed attention,
the lightning indexer, hyper-connections, hash and sqrtsoftplus routing) with the routed experts swapped for
kt-kernel by the placement rules, and one V4 cache per sequence.

A step runs every chunk of it (prompt chunks and decode tokens of all its sequences) as one batch of rows
(batch.py): the row-wise parts of the model, the routed experts above all, run once per layer for the whole
step, and only attention runs sequence by sequence over each sequence's own cache. Each sequence keeps its
`DynamicCache` of V4's cache layers (sliding-window keys, compressor buffers and compressed entries) in
`seq.runner_state` (caches.py: `SequenceCache`, which also lets a failed step run again). On one GPU with
kt_use_cuda_graph, a step of few enough rows and no adapter replays its row-wise parts from CUDA graphs and runs
each sequence's cached attention eagerly between them (graphs.py); other steps run eagerly (batch.py).

Caches are not paged but bounded by a budget in bytes (budget.py: a sliding window of `sliding_window` positions
plus one compressed entry per 4 (CSA) or 128 (HCA) positions per layer, the indexer's keys and the draft head's
cache): a sequence is charged what its positions hold when admitted and as it grows,
and room past the budget is refused, so the scheduler keeps requests waiting or preempts the newest (its cache is
dropped and recomputed when readmitted); freed when the request ends.

Prefix caching (prefixes.py): a prompt's cache state is kept at page boundaries (multiples of 128 positions),
between two pieces of its chunk in one step (a batch-invariant prompt's chunks are cut there: `prefill_end`),
keyed by the chain hash of its tokens and adapter; a later prompt that starts with one is admitted with a copy of
that state (`admit` returns the positions it holds) and computes the rest. Off with `prefix_cache: false`, and while the MTP head drafts.

LoRA adapters (PEFT, KT-SFT's fused expert LoRA and manifest) go through the shared `LoraModules`: each row of a
step uses its request's adapter (`AdapterRows` over the step's rows), so requests with different adapters or
none share a step.

With `speculative: mtp` the checkpoint's MTP layer drafts (mtp.py), run by the shared `Drafter`
(engines/kt/drafting.py) over the last layer's hyper-connection streams the step left at each accepted position.
A drafted chunk is one more piece of the batched step: it feeds the sequence's last token and its draft, gets
logits at each, and records what it puts into the cache, so the next step takes the cache back to the accepted
length (caches.py: the same mark a failed step goes back to)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from engines.kt.drafting import Drafter
from engines.kt.experts.protocol import RoutedExperts
from engines.kt.families.deepseek_v4.batch import Piece, V4Batch
from engines.kt.families.deepseek_v4.budget import CacheBudget
from engines.kt.families.deepseek_v4.caches import SequenceCache, snapshot
from engines.kt.families.deepseek_v4.paged import PagedDecode
from engines.kt.families.deepseek_v4.prefixes import PrefixPlan, PrefixStore
from engines.lora.install import LoraModules
from engines.lora.modules import AdapterRows
from engines.runtime.batch_invariance import scores_are_invariant
from engines.runtime.model_runner import ModelRunner, ScheduledChunk
from engines.runtime.sequence import Sequence


class V4ModelRunner(ModelRunner):
    chunked_prefill = True

    def __init__(self, model: nn.Module, max_model_len: int, budget: CacheBudget, checkpoint: Path | None = None,
                 head: Any = None, draft_unavailable: str | None = None, prefix_cache: bool = True,
                 paged_decode: bool = True):
        from transformers.cache_utils import DynamicCache

        self.model = model
        self.budget = budget
        self.config = model.config
        self.max_model_len = max_model_len
        self.head_device = model.lm_head.weight.device
        self._new_cache = lambda: DynamicCache(config=self.config)
        self._live = 0  # sequences holding a cache
        self.lora = LoraModules(model, self.config.hidden_size, checkpoint)
        self.batch = V4Batch(model, self.lora.context)
        self._experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
        # kt_gpu_prefill_tokens: the streamers prompt chunks copy experts to the GPU with (one per GPU)
        self._streamers = list({id(e.streamer): e.streamer for e in self._experts
                                if getattr(e, "streamer", None) is not None}.values())
        self.head = head  # mtp.py: V4DraftHead (it batches its own pieces, one cache per sequence), or None
        self.drafter = Drafter(head, head) if head is not None else None
        self.drafts, self.draft_unavailable = head is not None, draft_unavailable
        self.graphs = None  # graphs.py: V4StepGraphs, the row-wise segments of the steps that fit them
        # the draft head's own caches are not kept with a prefix: no prefix cache while it drafts
        self.prefixes = PrefixStore(budget, enabled=prefix_cache and head is None)
        # decode rows over paged caches, all sequences of a step at once (paged.py); a drafted chunk verifies
        # several rows over transformers' caches, so not while the head drafts
        self.paged = self.batch.paged = (PagedDecode(model, budget.sequences, budget.positions)
                                         if head is None and paged_decode else None)

    def _state(self, seq: Sequence) -> SequenceCache:
        if seq.runner_state is None:
            seq.runner_state = SequenceCache(self._new_cache())
            self._live += 1
        return seq.runner_state  # type: ignore[return-value]

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> list[torch.Tensor | None]:
        states = [self._state(chunk.seq) for chunk in chunks]
        for chunk, state in zip(chunks, states):
            with self.lora.context.step(AdapterRows.uniform(chunk.seq.request.adapter)):
                state.begin(chunk.start, record=bool(chunk.draft))
            # a decode row: one position past the prompt (a prompt's positions may still come many to a step)
            decoding = (chunk.num_tokens == 1 and not chunk.draft
                        and chunk.start >= max(1, getattr(chunk.seq, "num_prompt_tokens", 0)))
            if state.paged is None and decoding and self.paged is not None:
                state.adopt(self.paged)
            elif state.paged is not None and not decoding:
                raise RuntimeError(f"sequence {chunk.seq.id}'s V4 cache is paged: it takes decode rows, not "
                                   f"positions {chunk.start}-{chunk.end + len(chunk.draft)}")
        pieces: list[Piece] = []
        kept: list[tuple[PrefixPlan, int, dict[int, Any]]] = []  # the states kept at cuts inside a chunk
        for c, s in zip(chunks, states):
            tokens = c.seq.token_ids + list(c.draft) if c.draft else c.seq.token_ids
            bounds = [c.start, *self._cuts_inside(c, s), c.end + len(c.draft)]
            for start, end in zip(bounds, bounds[1:]):
                keep = None
                if end < bounds[-1] and self.prefixes.wants(s.prefix, end):
                    keep = {}
                    kept.append((s.prefix, end, keep))
                pieces.append(Piece(tokens, start, end, s.cache, c.seq.request.adapter, s.record, s.paged, keep))
        try:
            fits = self.graphs is not None and self.graphs.fits(pieces)
            streams = (self.graphs if fits else self.batch).hidden_streams(pieces)
        except BaseException:
            for experts in self._experts:  # a call submitted and never waited for: let it finish, drop it
                experts.abandon()
            for state in states:
                state.rollback()
            raise
        for plan, position, layers in kept:
            self.prefixes.keep(plan, position, [layers[i] for i in range(len(layers))])
        row = 0
        for chunk, state in zip(chunks, states):
            end = chunk.end + len(chunk.draft)
            state.commit(end)
            plan = state.prefix
            if (plan is not None and state.paged is None and not chunk.draft and chunk.end in plan.cuts
                    and self.prefixes.wants(plan, chunk.end)):
                self.prefixes.keep(plan, chunk.end, snapshot(state.cache))
            if self.drafter is not None:  # the streams at every fed position, for the draft head after the step
                self.drafter.keep(chunk.seq, chunk.start, streams[row:row + end - chunk.start])
            row += end - chunk.start
        return self._logits(chunks, streams)

    @staticmethod
    def _cuts_inside(chunk: ScheduledChunk, state: SequenceCache) -> list[int]:
        """The positions strictly inside a prompt chunk whose cache state its sequence keeps (`prefill_end` did not
        end the chunk there): the chunk runs as pieces split there, one step, the state taken between them."""
        plan = state.prefix
        if plan is None or state.paged is not None or chunk.draft:
            return []
        return [cut for cut in plan.cuts if chunk.start < cut < chunk.end]

    def _logits(self, chunks: list[ScheduledChunk], streams: torch.Tensor) -> list[torch.Tensor | None]:
        """Each chunk's logits: every row's (all_logits), its last row's and its draft's (samples) or none."""
        wanted: list[tuple[int, int]] = []  # (first row, rows) of each chunk's logits; rows 0: none
        row = 0
        for chunk in chunks:
            fed = chunk.num_tokens + len(chunk.draft)
            n = fed if chunk.all_logits else 1 + len(chunk.draft) if chunk.samples else 0
            wanted.append((row + fed - n, n))
            row += fed
        picked = [torch.arange(first, first + n) for first, n in wanted if n]
        if not picked:
            return [None] * len(chunks)
        rows = torch.cat(picked).to(streams.device, non_blocking=True)  # not waiting for the step's GPU work
        logits = self.model.lm_head(self.batch.final(streams.index_select(0, rows)).to(self.head_device)).float()
        out: list[torch.Tensor | None] = []
        at = 0
        for _, n in wanted:
            out.append(logits[at:at + n] if n else None)
            at += n
        return out

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[list[int]]:
        if self.drafter is None:
            return super().propose(seqs, depths)
        return self.drafter.propose(seqs, depths)

    def _plans(self, seq: Sequence) -> bool:
        """Whether `seq` borrows and keeps prefixes: not with prompt logprobs (computed whole, always the same
        bits: runtime/batch_invariance.py), nor without a prefix cache."""
        return self.prefixes.enabled and getattr(seq, "prompt_logprobs", None) is None

    def admit(self, seq: Sequence) -> int | None:
        if not self._plans(seq):
            return 0 if self.budget.admit(seq.id, len(seq.token_ids)) else None
        plan, state = self.prefixes.plan(seq.token_ids, self.lora.prefix_key(seq.request.adapter))
        self.prefixes.touch(plan)
        if not self.budget.admit(seq.id, len(seq.token_ids)):
            return None
        held = self._state(seq)
        self.prefixes.admitted(plan, state, held.cache)
        held.computed, held.prefix = plan.borrowed, plan
        return plan.borrowed

    def prefill_end(self, seq: Sequence, end: int) -> int:
        """A batch-invariant sequence's prompt chunk ends at each position whose state it keeps, so the same prompt
        again, started from that state, computes its tail alone as this one did: the same bits. Other chunks go on
        past them (`execute` keeps the state between the chunk's pieces in one step): a prompt's tail would cost a
        step of its own, which reads or copies nearly every expert of every layer once more."""
        state = seq.runner_state
        plan = None if state is None else state.prefix  # type: ignore[attr-defined]
        if plan is not None and seq.batch_invariant:
            return next((cut for cut in plan.cuts if seq.num_computed < cut < end), end)
        return end

    def prefix_in_flight(self, seq: Sequence, prefilling: list[Sequence]) -> bool:
        leaders: list[tuple[PrefixPlan, int]] = [(s.runner_state.prefix, s.num_computed) for s in prefilling
                                                 if s.runner_state is not None and s.runner_state.prefix is not None]
        if not leaders or not self._plans(seq):  # no prompt in flight keeps states: nothing to hash the prompt for
            return False
        plan, _ = self.prefixes.plan(seq.token_ids, self.lora.prefix_key(seq.request.adapter))
        return self.prefixes.in_flight(plan, leaders)

    def grow(self, seq: Sequence, num_positions: int) -> bool:
        return self.budget.grow(seq.id, num_positions)

    def release(self, seq: Sequence) -> None:
        if self.drafter is not None:
            self.drafter.forget(seq)
            self.head.forget(seq)
        self.budget.release(seq.id)
        if seq.runner_state is not None:
            if seq.runner_state.paged is not None:
                self.paged.release(seq.runner_state.paged)
            seq.runner_state = None
            self._live -= 1

    def streamed_experts(self) -> tuple[int, int]:
        return sum(s.stats.chunks for s in self._streamers), sum(s.stats.bytes for s in self._streamers)

    def kv_usage(self) -> tuple[int, int]:
        return self.budget.usage()

    @torch.inference_mode()
    def final_hidden_states(self, prompts: list[list[int]], adapter: str | None) -> list[torch.Tensor]:
        """The prompts in steps of up to max_model_len tokens (one prompt at least), each on a fresh cache
        dropped afterwards; one prompt a step where scores are batch-invariant."""
        out: list[torch.Tensor] = []
        # one prompt a step where scores are batch-invariant (runtime/batch_invariance.py)
        tokens = 0 if scores_are_invariant(self.batch_invariance) else self.max_model_len
        for group in _groups(prompts, tokens):
            streams = self.batch.hidden_streams([Piece(p, 0, len(p), self._new_cache(), adapter) for p in group])
            hidden = self.batch.final(streams).float().cpu()
            row = 0
            for p in group:
                out.append(hidden[row:row + len(p)])
                row += len(p)
        return out

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
        self.batch = None  # type: ignore[assignment]


def _groups(prompts: list[list[int]], tokens: int) -> list[list[list[int]]]:
    """`prompts` in order, in groups of at most `tokens` tokens (a longer prompt alone)."""
    groups: list[list[list[int]]] = []
    size = 0
    for prompt in prompts:
        if not groups or size + len(prompt) > tokens:
            groups.append([])
            size = 0
        groups[-1].append(prompt)
        size += len(prompt)
    return groups
