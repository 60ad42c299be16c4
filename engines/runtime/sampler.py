"""Next-token choice for one sequence: penalties, bias, constraints, then greedy or sampled.

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


class Sampler:
    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...]):
        self.token_text = TokenText(tokenizer)
        self._eos = eos_token_ids

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
                token = int(torch.multinomial(probs, 1, generator=seq.generator))
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
