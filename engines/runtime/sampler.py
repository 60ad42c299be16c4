"""Next-token choice: penalties, bias, constraints, then greedy or sampled.

`sample_batch` picks the tokens of a whole step with one tensor op per rule over the step's rows, where the
model computed them (on a GPU that spares copying 100k-wide rows to the host and scanning them there): each
rule (logit_bias, min_tokens, the penalties, grammars, temperature, top_k, min_p, top_p) touches only the rows
that ask for it, with index lists built once per step; each grammar's bitmask is made on the host, where its
matcher writes it, and a step's are applied together. Each sampled row's uniform draw comes from its request's
seeded generator (unseeded ones from torch's global generator, in row order), so on the CPU a row's token is
exactly what it would be sampled alone; on a GPU the reductions may round differently, which moves a token
only when a draw falls within that rounding of a boundary.

Reported logprobs are those of the model's own distribution (before penalties and temperature), which is
what OpenAI-style clients and evaluation harnesses compare against."""
from __future__ import annotations

from collections import Counter
from functools import lru_cache
from typing import Any

import numpy as np
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


def _host(values: list, dtype: type) -> torch.Tensor:
    """A CPU tensor of `values` as numpy `dtype` (numpy converts a long list ~3x faster than torch.tensor)."""
    return torch.from_numpy(np.array(values, dtype=dtype))


def _pairs(rows: list[int], cols: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) index tensors on `device` for advanced indexing of a [B, V] tensor."""
    return _host(rows, np.int64).to(device, non_blocking=True), _host(cols, np.int64).to(device, non_blocking=True)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """Per-row (or per-pair) float32 values on `device`."""
    return _host(values, np.float32).to(device, non_blocking=True)


def changes_logits(seq: Sequence) -> bool:
    """Whether a rule of `_adjust` applies to the row this step."""
    p = seq.sampling
    return bool(p.logit_bias or seq.num_output_tokens < p.min_tokens or p.repetition_penalty != 1.0
                or ((p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens)
                or seq.logits_processor is not None)


def _adjust(logits: torch.Tensor, seqs: list[Sequence], eos: tuple[int, ...]) -> None:
    """Apply each row's logit_bias, the end-of-sequence ban of min_tokens, its repetition, presence and
    frequency penalties and its grammar, in that order, to `logits` [B, V] in place: one indexed op per rule
    for the whole batch (the index lists, and the grammars' bitmasks, are built on the host and sent over
    once)."""
    vocab = logits.shape[-1]
    bias: tuple[list[int], list[int], list[float]] = ([], [], [])
    banned: tuple[list[int], list[int]] = ([], [])
    seen: tuple[list[int], list[int], list[float]] = ([], [], [])
    counted: tuple[list[int], list[int], list[int], list[float], list[float]] = ([], [], [], [], [])
    for r, seq in enumerate(seqs):
        p = seq.sampling
        if p.logit_bias:
            for token, value in p.logit_bias.items():
                if token < vocab:
                    bias[0].append(r), bias[1].append(token), bias[2].append(value)
        if seq.num_output_tokens < p.min_tokens:
            ids = sorted({t for t in (*eos, *p.stop_token_ids) if t < vocab})
            banned[0].extend([r] * len(ids)), banned[1].extend(ids)
        if p.repetition_penalty != 1.0:
            ids = [t for t in set(seq.token_ids) if t < vocab]
            seen[0].extend([r] * len(ids)), seen[1].extend(ids), seen[2].extend([p.repetition_penalty] * len(ids))
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
            times = {t: n for t, n in Counter(seq.output_ids).items() if t < vocab}
            n = len(times)
            counted[0].extend([r] * n), counted[1].extend(times), counted[2].extend(times.values())
            counted[3].extend([p.frequency_penalty] * n), counted[4].extend([p.presence_penalty] * n)
    device = logits.device
    if bias[0]:
        logits[_pairs(bias[0], bias[1], device)] += _column(bias[2], device)
    if banned[0]:
        logits[_pairs(*banned, device)] = float("-inf")
    if seen[0]:
        at = _pairs(seen[0], seen[1], device)
        values, penalty = logits[at], _column(seen[2], device)
        logits[at] = torch.where(values > 0, values / penalty, values * penalty)
    if counted[0]:  # frequency x times generated + presence
        times, frequency, presence = (_column(values, device) for values in counted[2:])
        logits[_pairs(counted[0], counted[1], device)] -= frequency * times + presence
    masked: list[tuple[int, torch.Tensor]] = []
    forced: list[tuple[int, int]] = []
    for r, seq in enumerate(seqs):
        allowed = seq.logits_processor.allowed() if seq.logits_processor is not None else None
        if isinstance(allowed, int):
            forced.append((r, allowed))
        elif allowed is not None:
            masked.append((r, allowed))
    if masked:  # every grammar row's bitmask sent over at once, unpacked there
        out = _forbidden(torch.stack([words for _, words in masked]).to(device, non_blocking=True), vocab)
        _on_rows(logits, [r for r, _ in masked], lambda sub: sub.masked_fill_(out, float("-inf")))
    if forced:  # the one token left, whatever the rules above did to it
        rows = [r for r, _ in forced]
        logits[rows] = float("-inf")
        logits[_pairs(rows, [token for _, token in forced], device)] = 0.0


def _forbidden(words: torch.Tensor, width: int) -> torch.Tensor:
    """Packed bitmasks of allowed tokens [G, W] int32 (bit i of word w: token 32w + i) as [G, width] bool of the
    forbidden ones (all past 32 W)."""
    if words.device.type == "cpu":  # numpy's unpacking: 11 us a row of 129,280 tokens, the shifts below 46
        out = torch.from_numpy(np.unpackbits(words.numpy().view(np.uint8), axis=-1, bitorder="little") == 0)
    else:
        bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=words.device)) & 1
        out = (bits == 0).view(words.shape[0], -1)
    if out.shape[1] < width:
        out = torch.nn.functional.pad(out, (0, width - out.shape[1]), value=True)
    return out[:, :width]


def _on_rows(t: torch.Tensor, rows: list[int], fn) -> torch.Tensor:
    """`t` with `fn` applied to the given rows: to `t` as a whole when they are all of its rows, without
    gathering them."""
    if len(rows) == t.shape[0]:
        return fn(t)
    t[rows] = fn(t[rows])
    return t


def _distributions(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The probabilities each row samples from: its logits [B, V] over its temperature, then top_k, min_p and
    top_p, each applied only to the rows that ask for it."""
    device, vocab = logits.device, logits.shape[-1]

    def values(rows: list[int], value) -> torch.Tensor:  # a column of per-row settings
        return _column([value(params[r]) for r in rows], device).unsqueeze(1)

    logits = logits / values(list(range(len(params))), lambda p: p.temperature)
    cut = [r for r, p in enumerate(params) if 0 < p.top_k < vocab]
    if cut:  # below the row's k-th largest logit: out
        ks = [params[r].top_k for r in cut]
        at = torch.tensor(ks, dtype=torch.long).sub_(1).to(device).unsqueeze(1)
        logits = _on_rows(logits, cut, lambda sub: sub.masked_fill_(
            sub < torch.topk(sub, max(ks), dim=-1).values.gather(1, at), float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    floor = [r for r, p in enumerate(params) if p.min_p > 0.0]
    if floor:  # below min_p times the row's most likely token: out
        scale = values(floor, lambda p: p.min_p)
        probs = _on_rows(probs, floor, lambda sub: sub.masked_fill_(sub < scale * sub.amax(dim=-1, keepdim=True), 0.0))
    nucleus = [r for r, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:  # below the least likely token of the row's nucleus: out
        limit = values(nucleus, lambda p: p.top_p)
        probs = _on_rows(probs, nucleus, lambda sub: sub.masked_fill_(sub < _nucleus_floor(sub, limit), 0.0))
    return probs


# On the CPU a nucleus is looked for among this many of a row's most likely tokens first: on the 2-core box a top-k
# of them took 0.56 ms of a 102,400-token row, a sort of the whole row 7.5 ms, and a top_p 0.9 row of bench.sampling
# (`--kinds top_p`) 1.6 ms instead of 10.4.
NUCLEUS_CANDIDATES = 1024


def _nucleus_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The least probability kept by each row's nucleus, [n, 1]: the shortest run of the row's most likely tokens
    whose mass reaches its `top_p` ([n, 1]) ends at that probability, and every token at least that likely stays
    (tokens tied with it too, so what stays does not depend on how a sort orders equal values, on any device).
    On the CPU the run is looked for among the `NUCLEUS_CANDIDATES` most likely tokens of each row first, and the
    whole rows are sorted only when their mass falls short; both give the same prefix sums there."""
    if probs.device.type == "cpu" and NUCLEUS_CANDIDATES < probs.shape[-1]:
        floor = _run_end(torch.topk(probs, NUCLEUS_CANDIDATES, dim=-1).values, top_p)
        if floor is not None:
            return floor
    return _run_end(torch.sort(probs, dim=-1, descending=True).values, top_p, whole=True)


def _run_end(ordered: torch.Tensor, top_p: torch.Tensor, whole: bool = False) -> torch.Tensor | None:
    """The last value of each row's shortest leading run of `ordered` (the row's largest probabilities, in
    descending order; all of them when `whole`) whose sum reaches `top_p`; None when a row's run is longer."""
    past = torch.cumsum(ordered, dim=-1) - ordered > top_p  # the mass before the value already reaches top_p
    reached = past.any(dim=-1)
    if not whole and not bool(reached.all()):
        return None
    first_past = torch.where(reached, past.int().argmax(dim=-1), ordered.shape[-1])
    return ordered.gather(1, (first_past - 1).unsqueeze(1))


def uniform(generator: torch.Generator | None) -> torch.Tensor:
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


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn from `probs` [V] (non-negative, positive sum; any device) with `generator`'s next uniform."""
    return _pick(probs.unsqueeze(0), uniform(generator).unsqueeze(0))[0]


class Sampler:
    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...]):
        self.token_text = TokenText(tokenizer)
        self._eos = eos_token_ids

    def sample_batch(self, rows: list[torch.Tensor], seqs: list[Sequence]) -> list[tuple[int, TokenLogprob | None]]:
        """The next token of each sequence from its float32 logits row, on any device (rows are not modified)."""
        if not rows:  # a step of prompt chunks that end mid-prompt
            return []
        device = next((row.device for row in rows if row.device.type != "cpu"), rows[0].device)
        if any(row.device != device for row in rows):  # runners may hand over rows from the host and a device
            rows = [row.to(device) for row in rows]
        if len(rows) > 1 and rows[0].device.type == "cpu":
            # a row at a time: one 100k-wide row stays in the cache through every pass, where passes over the
            # whole batch read it from memory once per op (2x slower for 32 sampled rows on the 2-core box)
            return [out for row, seq in zip(rows, seqs) for out in self._sample([row], [seq])]
        return self._sample(rows, seqs)

    def _sample(self, rows: list[torch.Tensor], seqs: list[Sequence]) -> list[tuple[int, TokenLogprob | None]]:
        logits = torch.stack(rows) if len(rows) > 1 else rows[0].unsqueeze(0)  # a lone row: a view of it
        params = [seq.sampling for seq in seqs]
        asked = [r for r, p in enumerate(params) if p.logprobs is not None]
        logprobs = torch.log_softmax(logits if len(asked) == len(rows) else logits[asked], dim=-1) if asked else None
        if any(changes_logits(seq) for seq in seqs):
            logits = logits if len(rows) > 1 else logits.clone()  # changed in place: never the caller's row
            _adjust(logits, seqs, self._eos)
        tokens = logits.argmax(dim=-1).tolist()  # greedy rows' tokens; what sampled rows fall back to
        drawn = [r for r, p in enumerate(params) if not (p.greedy or p.temperature < MIN_TEMPERATURE)]
        if drawn:
            probs = _distributions(logits[drawn] if len(drawn) < len(rows) else logits, [params[r] for r in drawn])
            # a distribution that underflowed or overflowed (extreme bias, penalties or temperature) cannot be
            # sampled; its most likely token is the one sampling would almost surely pick
            usable = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()
            kept = [n for n, ok in enumerate(usable) if ok]
            if kept:  # drawn in row order: unseeded rows share torch's global generator
                uniforms = torch.stack([uniform(seqs[drawn[n]].generator) for n in kept])
                for n, token in zip(kept, _pick(probs[kept] if len(kept) < len(drawn) else probs, uniforms)):
                    tokens[drawn[n]] = token
        for seq, token in zip(seqs, tokens):
            if seq.logits_processor is not None:
                seq.logits_processor.accept(token)
        entries: list[TokenLogprob | None] = [None] * len(rows)
        if logprobs is not None:
            for r, entry in zip(asked, self._entries(logprobs, [tokens[r] for r in asked],
                                                     [params[r].logprobs or 0 for r in asked])):
                entries[r] = entry
        return list(zip(tokens, entries))

    def distributions(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The probabilities rows of `logits` [n, V] (one request's, needing no adjustment) are sampled from."""
        return _distributions(logits, [params] * logits.shape[0])

    def logprob_entries(self, logits: torch.Tensor, tokens: list[int], top: int | None) -> list[TokenLogprob | None]:
        """The logprob entry of `tokens[i]` in row i of `logits`, with the row's `top` best; None each when the
        request asks for no logprobs (`top` None)."""
        if top is None:
            return [None] * len(tokens)
        return self._entries(torch.log_softmax(logits, dim=-1), tokens, [top] * len(tokens))

    def sample(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, TokenLogprob | None]:
        """The next token from one float32 logits row (not modified)."""
        return self.sample_batch([logits], [seq])[0]

    def _entries(self, logprobs: torch.Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprob]:
        """The logprob entries of rows of `logprobs` [B, V]: each chosen token's, and its row's `top` best; one
        top-k per distinct `top` and one copy to the host each."""
        chosen = logprobs.gather(1, _host(tokens, np.int64).to(logprobs.device).unsqueeze(1)).squeeze(1).tolist()
        best: dict[int, tuple[list[float], list[int]]] = {}
        for k in sorted({k for k in tops if k}):
            rows = [r for r, top in enumerate(tops) if top == k]
            values, ids = torch.topk(logprobs[rows], k, dim=-1)
            best.update(zip(rows, zip(values.tolist(), ids.tolist())))
        return [self._entry(token, value, *best.get(r, ([], [])))
                for r, (token, value) in enumerate(zip(tokens, chosen))]

    def prompt_entries(self, logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
        """The entries of `tokens[i]` in row i of `logits` [n, V] (float32, any device; a prompt's logprobs), with
        each row's `top` best. Blocks of rows: a long chunk's log-probabilities never exist whole, and on the CPU
        a block of 4 rows stays in the cache (39 ms for 512 rows of 102,400 on the 2-core box, 83 in blocks of
        64); on a GPU one op over 512 rows costs about what one over a row does."""
        block = 4 if logits.device.type == "cpu" else 512
        out: list[TokenLogprob] = []
        for start in range(0, len(tokens), block):
            logprobs = torch.log_softmax(logits[start:start + block], dim=-1)
            out += self._entries(logprobs, tokens[start:start + block], [top] * logprobs.shape[0])
        return out

    def _entry(self, token: int, logprob: float, top_values: list[float], top_ids: list[int]) -> TokenLogprob:
        text, raw = self.token_text.lookup(token)
        entry = TokenLogprob(token_id=token, token=text, logprob=logprob, bytes=raw)
        for value, tid in zip(top_values, top_ids):
            t_text, t_raw = self.token_text.lookup(tid)
            entry.top.append(TopLogprob(token_id=tid, token=t_text, logprob=value, bytes=t_raw))
        return entry
