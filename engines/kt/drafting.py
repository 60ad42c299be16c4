"""The KT runner's half of speculative decoding: a model family's draft head run over the positions each step
computed, and the tokens it proposes (engines/runtime/speculative.py has the family-agnostic half).

A family provides the head (`DraftHead`; DeepSeek-V3's MTP layer: engines/kt/families/deepseek_mla/mtp.py). The head computes, at
position i, from the main model's final hidden state h_i and the token t_{i+1} that follows it, its own state
there — writing its KV cache at i — and from that the logits of t_{i+2}. So it can only run at a position once
t_{i+1} is known: the `Drafter` keeps the final hidden states a step computed for each sequence until the
runtime has picked that step's tokens, then runs the head over the positions that turned out accepted (all of
a prompt chunk's; a decode step's last token and the draft tokens kept), and proposes greedily from the last:
the head's argmax at depth 1, and further down the chain the head again at the next position, its own state
standing in for the main model's. Its cache at positions past the accepted ones is written again, from the
main model's states, once those positions are verified."""
from __future__ import annotations

from typing import Any, Protocol

import torch

from engines.runtime.sequence import Sequence


class DraftHead(Protocol):
    layer: int  # its layer of the latent KV cache

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, batch: Any) -> torch.Tensor:
        """The head's states at the batch's positions [T, H] from the main model's final hidden states there (or
        the head's own from the position before) [T, H] and the token after each position [T]."""

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] of the token two positions on, from the head's states."""


class Drafter:
    def __init__(self, head: DraftHead, runner: Any):
        self.head = head
        self.runner = runner  # engines.kt.families.deepseek_mla.runner.KTModelRunner: draft_batch()
        self._hidden: dict[str, tuple[int, torch.Tensor]] = {}  # seq id -> (first position, final hidden states)

    def keep(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """The main model's final hidden states at positions start, start + 1, ... that a step fed for `seq`."""
        self._hidden[seq.id] = (start, hidden)

    def forget(self, seq: Sequence) -> None:
        self._hidden.pop(seq.id, None)

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        pieces, hidden, next_ids, chained = [], [], [], []
        for i, seq in enumerate(seqs):
            start, states = self._hidden.pop(seq.id, (0, None))
            n = 0 if states is None else min(states.shape[0], seq.num_computed - start)  # accepted positions
            if n <= 0:
                continue
            pieces.append((seq, start, start + n))
            hidden.append(states[:n])
            next_ids += seq.token_ids[start + 1:start + n + 1]
            if depths[i] > 0 and start + n == seq.num_computed:
                chained.append((i, len(next_ids) - 1))
        if not pieces:
            return drafts
        states = self.head.forward(torch.cat([h.to(self.head.device) for h in hidden]),
                                   torch.tensor(next_ids), self.runner.draft_batch(pieces))
        if not chained:
            return drafts
        last = states[torch.tensor([row for _, row in chained], device=states.device)]
        for step in range(max(depths[i] for i, _ in chained)):
            tokens = self.head.logits(last).argmax(dim=-1).tolist()
            for (i, _), token in zip(chained, tokens):
                drafts[i].append(token)
            going = [k for k, (i, _) in enumerate(chained) if depths[i] > step + 1]
            if not going:
                break
            # the next position of each chain: its last draft token follows it, the head's state stands in for h
            chained = [chained[k] for k in going]
            batch = self.runner.draft_batch([(seqs[i], seqs[i].num_computed + step, seqs[i].num_computed + step + 1)
                                             for i, _ in chained])
            last = self.head.forward(last[torch.tensor(going, device=last.device)],
                                     torch.tensor([drafts[i][-1] for i, _ in chained]), batch)
        return drafts
