"""Speculative decoding: a draft head proposes the next tokens of a decoding sequence, the model checks them
all in one step, and every proposal it would have produced itself is kept.

The logic here knows no model family. A runner that can draft (`ModelRunner.drafts`) proposes tokens with
`propose()` after each step, from what the step computed (DeepSeek's multi-token-prediction layer in the KT
engine: engines/kt/drafting.py and engines/kt/families/deepseek_mla/mtp.py). The next step feeds a drafted sequence's last token and
its draft (`ScheduledChunk.draft`) and gets logits at each of those positions; `Speculator.pick` then keeps the
longest run of the draft that verification accepts plus one token of the model's own, so a step yields 1 to
depth + 1 tokens. Positions of rejected draft tokens hold KV that no sequence counts as computed: the next step
writes over them, and the prefix cache only ever indexes pages of accepted tokens (it offers positions below
`seq.num_computed`).

Verification is exact. Greedy rows accept a draft token when it is the row's argmax, so the output is the
tokens decoding without drafts gives (up to the rounding of computing two positions in one step). Sampled rows
use the rejection sampling of speculative decoding (Leviathan et al. 2023, Chen et al. 2023): draft token d,
drawn from q, is kept with probability min(1, p(d) / q(d)) under the model's distribution p; on rejection the
token is drawn from norm(max(0, p - q)), and after a fully accepted draft one more from p — every emitted token
is distributed as sampling from p would give. A draft head that picks its token deterministically (argmax) has
q one-hot on d: d is kept with probability p(d), and a rejection draws from p with d removed.

Only sequences whose next distributions do not depend on the tokens just before them are drafted (no
penalties, logit bias, pending min_tokens or grammar), and only while at most `speculative_max_batch`
sequences decode: larger steps are compute-bound and verification would cost more than it saves. A seeded
request still samples from the right distribution, but draws a different stream of uniforms than it would
without drafting, so its tokens differ from a run without it.

With `speculative_adaptive` (the default) a `DraftGate` times decode steps with drafts and without, and pauses
drafting while drafted steps give fewer tokens a second than plain ones, trying again every so often
(engines/runtime/draft_gate.py says how); it changes how many steps a reply takes, never the reply."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from engines.runtime.draft_gate import DraftGate
from engines.runtime.model_runner import ModelRunner, ScheduledChunk
from engines.runtime.sampler import MIN_TEMPERATURE, Sampler, changes_logits, sample_from, uniform
from engines.runtime.sequence import Sequence

log = logging.getLogger("ktserve.engine")

METHODS = ("mtp",)


@dataclass(frozen=True, slots=True)
class SpeculativeOptions:
    """The settings of speculative decoding (server/settings.py), read by the shared runtime."""

    speculative: str | None = None  # "mtp": the checkpoint's multi-token-prediction layer drafts; None: off
    num_speculative_tokens: int = 1  # draft tokens per step (the chain's depth)
    speculative_max_batch: int = 4  # drafting runs while at most this many sequences decode
    speculative_adaptive: bool = True  # pause drafting while it costs more time than it saves (draft_gate.py)


def verify_chain(target: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                 draw: Callable[[], torch.Tensor], sample: Callable[[torch.Tensor], int]) -> list[int]:
    """Rejection sampling of one sequence's draft. `target` [k + 1, V]: the model's probabilities (non-negative,
    each row with a positive sum) at the last token and at each of the k draft tokens; `draft_probs` [k, V] the
    distributions the draft tokens were drawn from, None when each was picked deterministically (q one-hot).
    `draw()` gives a uniform in [0, 1), `sample(probs)` a token drawn from a [V] row. Returns the tokens to emit:
    the accepted prefix of `draft` and one token more."""
    k = len(draft)
    target = target / target.sum(dim=-1, keepdim=True)
    ids = torch.tensor(draft, device=target.device)
    rows = torch.arange(k, device=target.device)
    p_draft = target[rows, ids].tolist()
    q_draft = [1.0] * k
    if draft_probs is not None:
        draft_probs = draft_probs / draft_probs.sum(dim=-1, keepdim=True)
        q_draft = draft_probs[rows, ids].tolist()
    for j, token in enumerate(draft):
        if float(draw()) * q_draft[j] < p_draft[j]:  # u < p / q, without dividing by a q of 0
            continue
        if draft_probs is None:
            residual = target[j].clone()
            residual[token] = 0.0
        else:
            residual = (target[j] - draft_probs[j]).clamp_(min=0.0)
        if not float(residual.sum()) > 0.0:  # p == q up to rounding: nothing left to correct towards
            residual = target[j]
        return draft[:j] + [sample(residual)]
    return list(draft) + [sample(target[k])]


def accepted_prefix(draft: list[int], tokens: list[int]) -> int:
    """How many leading draft tokens equal the model's own choices `tokens` at the same positions."""
    n = 0
    while n < len(draft) and draft[n] == tokens[n]:
        n += 1
    return n


class Speculator:
    """Drafting for the engine thread: which sequences draft, the drafts' verification, and their counts."""

    def __init__(self, runner: ModelRunner, options: SpeculativeOptions):
        self.runner = runner
        self.depth = options.num_speculative_tokens
        self.max_batch = options.speculative_max_batch
        self.drafted = 0  # draft tokens verified
        self.accepted = 0  # of those, kept
        # whether drafting pays, from the steps' times (engines/runtime/draft_gate.py); None: always draft
        self.gate = DraftGate() if options.speculative_adaptive else None
        self._step = [0, 0, 0]  # this step: decoding sequences (0: not a decode step that may draft), drafts, kept

    @classmethod
    def create(cls, runner: ModelRunner, options: SpeculativeOptions, engine: str) -> "Speculator | None":
        """The speculator the options ask for, or None (logged) when they ask for none or the runner cannot draft."""
        if options.speculative is None:
            return None
        if options.speculative not in METHODS:
            raise ValueError(f"speculative: {options.speculative!r} is not a known method ({', '.join(METHODS)})")
        if not runner.drafts:
            log.warning("speculative=%s: %s; serving without drafting", options.speculative,
                        runner.draft_unavailable or f"the {engine} engine does not draft")
            return None
        log.info("speculative=%s: drafting %d token(s) a step for decode steps of up to %d sequences",
                 options.speculative, options.num_speculative_tokens, options.speculative_max_batch)
        return cls(runner, options)

    @property
    def batch_limit(self) -> int:
        """The most decoding sequences a step drafts for: the options', within what the runner allows."""
        return min(self.max_batch, self.runner.draft_max_batch or self.max_batch)

    # ------------------------------------------------------------------------------ before the step
    def attach(self, chunks: list[ScheduledChunk]) -> None:
        """Give each decoding chunk its sequence's draft, or none when the step decodes too many sequences or the
        gate has paused drafting."""
        decode = all(c.samples and c.num_tokens == 1 and not c.all_logits for c in chunks)
        self._step = [len(chunks) if decode and len(chunks) <= self.batch_limit else 0, 0, 0]
        decoding = [c for c in chunks if c.seq.draft]
        if len(decoding) > self.batch_limit or not self.gate_open:
            for chunk in decoding:
                chunk.seq.draft = ()
            return
        for chunk in decoding:
            # the draft's positions need KV room too; where the cache has none now, the step decodes without it
            if chunk.samples and chunk.num_tokens == 1 and not chunk.all_logits and \
                    self.runner.grow(chunk.seq, len(chunk.seq) + len(chunk.seq.draft)):
                chunk.draft = chunk.seq.draft
            chunk.seq.draft = ()

    @property
    def gate_open(self) -> bool:
        return self.gate is None or self.gate.drafting

    # ------------------------------------------------------------------------------ after the forward
    def pick(self, sampler: Sampler, sampling: list[tuple[ScheduledChunk, torch.Tensor]]
             ) -> list[tuple[Sequence, list[tuple[int, object]]]]:
        """The tokens each sampled sequence takes this step, with their logprob entries: one for plain chunks, the
        accepted draft tokens and one more for drafted ones (whose `num_computed` then counts the accepted ones)."""
        plain = [(c, rows) for c, rows in sampling if not c.draft]
        tokens = sampler.sample_batch([rows[-1] for _, rows in plain], [c.seq for c, _ in plain])
        out: list[tuple[Sequence, list[tuple[int, object]]]] = [(c.seq, [t]) for (c, _), t in zip(plain, tokens)]
        for chunk, rows in sampling:
            if chunk.draft:
                out.append((chunk.seq, self._verify(sampler, chunk, rows)))
        return out

    def _verify(self, sampler: Sampler, chunk: ScheduledChunk, rows: torch.Tensor) -> list[tuple[int, object]]:
        seq, draft = chunk.seq, list(chunk.draft)
        if is_greedy(seq):
            picks = sampler.sample_batch(list(rows), [seq] * len(rows))
            kept = accepted_prefix(draft, [t for t, _ in picks])
            emitted = picks[:kept + 1]
        else:
            target = sampler.distributions(rows, seq.sampling)
            tokens = verify_chain(target, draft, None, lambda: uniform(seq.generator),
                                  lambda probs: sample_from(probs, seq.generator))
            kept = len(tokens) - 1
            emitted = list(zip(tokens, sampler.logprob_entries(rows[:len(tokens)], tokens, seq.sampling.logprobs)))
        self.drafted += len(draft)
        self.accepted += kept
        self._step[1] += len(draft)
        self._step[2] += kept
        seq.num_computed += kept  # the accepted draft tokens' positions were computed in this step
        return emitted

    # ------------------------------------------------------------------------------ after the step
    def propose(self, seqs: list[Sequence]) -> None:
        """Let the runner's draft head take in what the step computed for `seqs` (those still running) and draft
        for the ones that decode next. A failure here costs only the drafts (logged): outputs never depend on them."""
        decoding = [s for s in seqs if not s.in_prefill]
        drafting = len(decoding) <= self.batch_limit and self.gate_open
        if not self.gate_open or not drafting and self.runner.draft_max_batch is not None:
            # the head sits such steps out (paused: it would cost a paused step its block; ModelRunner.draft_max_batch:
            # the runner's limit); drafts stay empty, and a head that missed positions starts its cache afresh
            return
        depths = [self._depth(s) if drafting and not s.in_prefill else 0 for s in seqs]
        try:
            with torch.inference_mode():
                drafts = self.runner.propose(seqs, depths)
        except Exception:
            log.exception("drafting failed; these sequences decode without drafts this step")
            return
        for seq, draft in zip(seqs, drafts):
            seq.draft = tuple(draft)

    def timed(self, seconds: float) -> None:
        """The wall time of the step (its draft head's run included): the gate's evidence when it decoded."""
        sequences, drafted, kept = self._step
        if self.gate is not None and sequences:
            self.gate.record(seconds, sequences, drafted, kept)

    def _depth(self, seq: Sequence) -> int:
        """How many tokens to draft: the depth, within what the request may still produce and the context holds."""
        if changes_logits(seq) or seq.logits_processor is not None:
            return 0
        left = seq.sampling.max_tokens - seq.num_output_tokens - 1  # the step adds one token beyond the draft
        room = self.runner.max_model_len - len(seq)
        return max(0, min(self.depth, left, room))


def is_greedy(seq: Sequence) -> bool:
    p = seq.sampling
    return p.greedy or p.temperature < MIN_TEMPERATURE
