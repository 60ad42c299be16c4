"""Speculative decoding in the V4 runner: what a step does around its forward for a drafting model.

Before a sequence's forward (`feed`): its cache is taken back past the draft tokens its previous step rejected
(rewind.py), and a drafted chunk feeds the draft after its last token. After it (`fed`): the main model's residual
streams at the fed positions (the input of its final hyper-connection head, caught by a hook) are kept for the
draft head (mtp.py), which the shared `Drafter` (engines/kt/drafting.py) runs over the accepted positions after
the step and asks for the next draft."""
from __future__ import annotations

from typing import Any, Callable, ContextManager

import torch
from torch import nn

from engines.kt.drafting import Drafter
from engines.kt.families.deepseek_v4.mtp import V4DraftHead
from engines.kt.families.deepseek_v4.rewind import Rewinder
from engines.runtime.model_runner import ScheduledChunk
from engines.runtime.sequence import Sequence


class V4Drafting:
    def __init__(self, model: nn.Module, head: V4DraftHead):
        self.head = head
        self.drafter = Drafter(head, head)  # the head batches its own pieces (one cache per sequence)
        self.rewinder = Rewinder(model)
        self._streams: torch.Tensor | None = None
        model.model.hc_head.register_forward_pre_hook(self._catch)
        self._scope: Callable[[str | None], ContextManager] | None = None

    def _catch(self, module: nn.Module, args: tuple) -> None:
        self._streams = args[0]

    def bind(self, scope: Callable[[str | None], ContextManager]) -> None:
        """`scope(adapter)`: the context the runner's forwards for a request with `adapter` run in."""
        self._scope = scope

    def feed(self, chunk: ScheduledChunk, cache: Any) -> list[int]:
        """Before the chunk's forward: its sequence's cache holding positions [0, chunk.start) only; the token ids to
        feed (with the draft after the sequence's tokens when the chunk verifies one)."""
        seq = chunk.seq
        self.rewinder.rewind(seq, cache, chunk.start, lambda: self._scope(seq.request.adapter))
        if not chunk.draft:
            return seq.token_ids
        self.rewinder.begin(seq, cache, chunk.start, 1 + len(chunk.draft))
        return seq.token_ids + list(chunk.draft)

    def fed(self, chunk: ScheduledChunk, cache: Any) -> None:
        if chunk.draft:
            self.rewinder.end(chunk.seq, cache)
        self.drafter.keep(chunk.seq, chunk.start, self._streams[0])
        self._streams = None

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[list[int]]:
        return self.drafter.propose(seqs, depths)

    def forget(self, seq: Sequence) -> None:
        self.drafter.forget(seq)
        self.head.forget(seq)
        self.rewinder.forget(seq)
