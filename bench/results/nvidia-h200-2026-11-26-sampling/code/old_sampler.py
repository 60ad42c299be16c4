"""Next-token choice: penalties, bias, constraints, then greedy or sampled.

`sample_batch` picks the tokens of a whole step: rows that are plain greedy or plain temperature sampling
(nothing else that changes logits or asks for logprobs) share one tensor op (argmax, or softmax of the
scaled logits); the others go through `sample` one at a time. Rows may stay where the model computed them:
the shared ops run there (on a GPU that spares copying 100k-wide rows to the host and scanning them there), and
the rows `sample` takes come to the CPU in one copy. Each sampled row's uniform draw comes from its request's
seeded generator (unseeded ones from torch's global generator, in row order), so on the CPU the tokens are
exactly those of sampling the rows one by one; on a GPU the softmax may round differently, which moves a token
only when a draw falls within that rounding of a boundary.

Reported logprobs are those of the model's own distribution (before penalties and temperature), which is
what OpenAI-style clients and evaluation harnesses compare against."""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from engines.base import SamplingParams, TokenLogprob, TopLogprob
from engines.runtime.sequence import Sequence


def _bytes_to_unicode() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: which byte each printable stand-in character encodes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


# Below this, dividing logits by the temperature overflows; such a temperature means greedy anyway.
MIN_TEMPERATURE = 1e-5


class TokenText:
    """Token id -> (display string, raw bytes), cached; byte-level tokens that are part of a UTF-8
    character still report their exact bytes."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._byte_of = _bytes_to_unicode()
        self.lookup = lru_cache(maxsize=65536)(self._lookup)

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return "", []
        if all(ch in self._byte_of for ch in piece):
            raw = bytes(self._byte_of[ch] for ch in piece)
        else:  # an added/special token: its text is literal
            raw = piece.encode("utf-8")
        return raw.decode("utf-8", errors="replace"), list(raw)


def _apply_penalties(logits: torch.Tensor, seq: Sequence, p: SamplingParams) -> None:
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
        ids, counts = torch.tensor(seq.output_ids, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def _plain(seq: Sequence) -> str | None:
    """"greedy" or "temperature" when the row needs nothing but that (see the module docstring), else None."""
    p = seq.sampling
    if (p.logprobs is not None or p.logit_bias or seq.num_output_tokens < p.min_tokens
            or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
            or seq.logits_processor is not None):
        return None
    if p.greedy or p.temperature < MIN_TEMPERATURE:
        return "greedy"
    if p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0:
        return "temperature"
    return None


def _uniform(generator: torch.Generator | None) -> torch.Tensor:
    """One draw in [0, 1) from `generator` (None: torch's global one), float64, on the CPU."""
    return torch.rand((), dtype=torch.float64, generator=generator)


def _pick(probs: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """For each row of `probs` [k, V] (finite, non-negative, positive sum; any device), the first index whose
    cumulative mass passes that row's uniform draw scaled to the row's total: a draw from the row's distribution,
    as `torch.multinomial(row, 1)` makes, which took 82 ms for 32 rows of 102,400 on one thread of the H200 host
    (`python -m bench.sampling`), where a whole step of 32 temperature rows now takes 1.1 ms on its GPU."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    targets = uniforms.to(cdf.device).unsqueeze(1) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(1).tolist()
    for row, index in enumerate(picked):
        if index >= probs.shape[-1]:  # the draw rounded up to the total: the last index with any mass
            picked[row] = int(probs[row].nonzero()[-1])
    return picked


def _on_cpu(rows: list[torch.Tensor], wanted: list[int]) -> list[torch.Tensor]:
    """`rows` with those at the `wanted` indices on the CPU, brought over in one copy: the one-at-a-time rules
    (penalties, bias, grammars, top-k/p) index with CPU tensors, so those rows compute there."""
    away = [i for i in wanted if rows[i].device.type != "cpu"]
    if not away:
        return rows
    moved = torch.stack([rows[i] for i in away]).cpu()
    rows = list(rows)
    for i, row in zip(away, moved):
        rows[i] = row
    return rows


class Sampler:
    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...]):
        self.token_text = TokenText(tokenizer)
        self._eos = eos_token_ids

    def sample_batch(self, rows: list[torch.Tensor], seqs: list[Sequence]) -> list[tuple[int, TokenLogprob | None]]:
        """The next token of each sequence from its float32 logits row, on any device (rows are not
        modified)."""
        kinds = [_plain(seq) for seq in seqs]
        greedy = [i for i, k in enumerate(kinds) if k == "greedy"]
        scaled = [i for i, k in enumerate(kinds) if k == "temperature"]
        picked: dict[int, int] = {}
        if greedy:  # reduced where the rows are (on a GPU: no copy of whole rows to the host)
            best = rows[greedy[0]].argmax().view(1) if len(greedy) == 1 else \
                torch.stack([rows[i] for i in greedy]).argmax(dim=-1)
            picked = dict(zip(greedy, best.tolist()))
        drawn: dict[int, int] = {}  # scaled row -> its row in `probs`
        if len(scaled) > 1:  # computed where the rows are, like the greedy ones
            temps = torch.tensor([seqs[i].sampling.temperature for i in scaled], dtype=torch.float32)
            stacked = torch.stack([rows[i] for i in scaled])
            fallback = stacked.argmax(dim=-1).tolist()
            probs = torch.softmax(stacked / temps.to(stacked.device).unsqueeze(1), dim=-1)
            # as in `sample`: a distribution that under- or overflowed keeps the most likely token
            usable = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()
            for n, (i, top, ok) in enumerate(zip(scaled, fallback, usable)):
                picked[i] = top
                if ok:
                    drawn[i] = n
        rows = _on_cpu(rows, [i for i in range(len(rows)) if i not in picked])  # those `sample` takes
        out: list = []
        uniforms: dict[int, torch.Tensor] = {}
        for i, (row, seq) in enumerate(zip(rows, seqs)):
            if i in drawn:  # the draw is taken here, in row order: unseeded rows share torch's global generator
                uniforms[i] = _uniform(seq.generator)
                out.append(None)
            elif i in picked:
                out.append((picked[i], None))
            else:
                out.append(self.sample(row.clone(), seq))
        if uniforms:
            order = list(uniforms)
            tokens = _pick(probs[[drawn[i] for i in order]], torch.stack([uniforms[i] for i in order]))
            for i, token in zip(order, tokens):
                out[i] = (token, None)
        return out

    def sample(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, TokenLogprob | None]:
        """Pick the next token from a float32 logits row (modified in place)."""
        p = seq.sampling
        logprobs = torch.log_softmax(logits, dim=-1) if p.logprobs is not None else None
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            logits[ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
        if seq.num_output_tokens < p.min_tokens:
            banned = [t for t in (*self._eos, *p.stop_token_ids) if t < logits.numel()]
            logits[banned] = float("-inf")
        _apply_penalties(logits, seq, p)
        if seq.logits_processor is not None:
            seq.logits_processor(seq.output_ids, logits)
        token = int(torch.argmax(logits))
        if not p.greedy and p.temperature >= MIN_TEMPERATURE:
            probs = _filter(logits / p.temperature, p)
            # a distribution that underflowed or overflowed (extreme bias, penalties or temperature) cannot be
            # sampled; its most likely token is the one sampling would almost surely pick
            if bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0:
                token = _pick(probs.unsqueeze(0), _uniform(seq.generator).view(1))[0]
        if seq.logits_processor is not None:
            seq.logits_processor.accept(token)
        entry = self.logprob_entry(logprobs, token, p.logprobs) if logprobs is not None else None
        return token, entry

    def logprob_entry(self, logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
        text, raw = self.token_text.lookup(token)
        entry = TokenLogprob(token_id=token, token=text, logprob=float(logprobs[token]), bytes=raw)
        if top:
            values, ids = torch.topk(logprobs, top)
            for value, tid in zip(values.tolist(), ids.tolist()):
                t_text, t_raw = self.token_text.lookup(tid)
                entry.top.append(TopLogprob(token_id=tid, token=t_text, logprob=value, bytes=t_raw))
        return entry
