"""The memory budget of V4's caches: how many bytes a sequence's caches hold at a number of positions, and the
admission / growth / release accounting that keeps all sequences' caches within a capacity.

V4's caches are not paged: each sequence holds transformers' V4 cache layers (caches.py), whose size follows
from its positions p alone (transformers 5.24, `DeepseekV4HCACache` / `DeepseekV4CSACache` /
`DynamicSlidingWindowLayer`), with e the model's element size and W the sliding window:

- every layer keeps the last W - 1 keys, [1, 1, min(p, W - 1), head_dim]; V4's compressed layers share them
  as values, a plain sliding-window layer (and the MTP head's) keeps the values apart: twice that;
- a compressor (HCA: one per 128 positions, CSA: one per 4; CSA's indexer at index_head_dim beside it) keeps
  the entries it emitted, [1, p // r, dim], and the positions since its last window in two buffers (its key
  and gate projections), [1, p % r, width] each, width = dim for HCA and 2 * dim for CSA's overlapping
  windows, which also carry the last window's first half, [1, r, dim], once a window closed: its keys in e,
  its gate in float32 (the gate has the float32 position bias added);
- with MTP drafting, the draft head's own cache of one sliding-window layer per sequence;
- and each layer's window size as an int64 scalar tensor.

The runner charges a sequence what its positions cost (`CacheBytes.at`) when it is admitted and as it grows,
and refuses room past the capacity: the scheduler then keeps a request waiting or preempts the newest. The
memory behind the tensors is what their sizes say (caches.py copies out the views a prompt chunk leaves).

The prefix cache's stored states (prefixes.py) are held in the same bytes, each charged the bytes of its own
tensors; they are reclaimable: before a sequence is refused room (admitted or growing), the least recently used
stored prefixes are dropped until it fits. `usage` counts the sequences' bytes alone, as the paged pool of V2/V3
counts cached pages nobody holds as free.

Not charged, as they come and go within a step or are a fixed fraction of what is: a draft's few positions past
the accepted ones (taken back by the next step), the mark each step keeps (caches.py: the window and buffers as
they were before the step, not the compressed entries), and the throwaway caches of embeddings and reward scores
(`final_hidden_states`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

_FLOAT32 = 4
_INT64 = 8


@dataclass(frozen=True, slots=True)
class _Compressor:
    rate: int
    dim: int  # the emitted entries' width
    overlap: bool  # CSA's overlapping windows: buffers twice as wide, and the last window's first half kept


@dataclass(frozen=True, slots=True)
class CacheBytes:
    """Bytes one sequence's V4 caches hold at p positions."""

    window: int  # sliding_window - 1: the keys a layer keeps
    head_dim: int
    element: int  # bytes of the model's dtype
    window_tensors: int  # sliding-window key (and value) tensors of all layers and the draft head
    layers: int  # cache layers (the draft head's included)
    compressors: tuple[_Compressor, ...]

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype, draft_head: bool = False) -> "CacheBytes":
        rates = config.compress_rates
        window_tensors, compressors = 2 if draft_head else 0, []
        for kind in config.layer_types:
            window_tensors += 2 if kind == "sliding_attention" else 1
            if kind == "heavily_compressed_attention":
                compressors.append(_Compressor(rates[kind], config.head_dim, overlap=False))
            elif kind == "compressed_sparse_attention":
                compressors.append(_Compressor(rates[kind], config.head_dim, overlap=True))
                compressors.append(_Compressor(rates[kind], config.index_head_dim, overlap=True))  # the indexer
        return cls(config.sliding_window - 1, config.head_dim, torch.empty((), dtype=dtype).element_size(),
                   window_tensors, len(config.layer_types) + int(draft_head), tuple(compressors))

    def at(self, positions: int) -> int:
        """What the caches hold after positions [0, positions) went in."""
        return self._bytes(positions, full_buffers=False)

    def bound(self, positions: int) -> int:
        """The most the caches hold on the way to `positions` (at any p <= positions): every buffer full. `at`
        steps back when a window closes (its buffers become one entry); this does not, so it can be inverted."""
        return self._bytes(positions, full_buffers=True)

    def positions_within(self, capacity: int, most: int) -> int:
        """The most positions one sequence reaches within `capacity` bytes, up to `most` (a model of sliding-window
        layers only holds the same bytes at any length past the window)."""
        if self.bound(most) <= capacity:
            return most
        low, high = 0, 1
        while self.bound(high) <= capacity:
            low, high = high, high * 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.bound(mid) <= capacity else (low, mid)
        return low

    def _bytes(self, positions: int, full_buffers: bool) -> int:
        e = self.element
        total = self.window_tensors * min(positions, self.window) * self.head_dim * e + self.layers * _INT64
        for c in self.compressors:
            width = 2 * c.dim if c.overlap else c.dim
            buffered = min(positions, c.rate - 1) if full_buffers else positions % c.rate
            total += (positions // c.rate) * c.dim * e + 2 * buffered * width * e
            if c.overlap and (positions >= c.rate or full_buffers and positions):
                total += c.rate * c.dim * (e + _FLOAT32)
        return total


class CacheBudget:
    """The bytes all sequences' caches may hold, and what each holds now (by sequence id)."""

    def __init__(self, sizes: CacheBytes, capacity: int, positions: int, sequences: int | None = None):
        self.sizes = sizes
        self.capacity = capacity  # bytes
        self.positions = positions  # what the capacity was sized for (kv_cache_tokens): kv_usage's unit
        self.sequences = sequences  # among how many sequences at most (max_concurrent), where `sized` says
        self.margin = capacity // 100  # left free at admission for running sequences to grow (vLLM's watermark)
        self.used = 0  # bytes the sequences hold
        self._held: dict[str, int] = {}
        self.cached = 0  # bytes of the stored prefixes (prefixes.py), reclaimable
        # drops stored prefixes, least recently used first, until at least the bytes asked for are freed or none
        # is left (prefixes.py: PrefixStore.reclaim); None: nothing to reclaim
        self.reclaim: Callable[[int], None] | None = None

    @classmethod
    def sized(cls, sizes: CacheBytes, positions: int, max_len: int, sequences: int) -> "CacheBudget":
        """Room for `positions` positions however they are spread over up to `sequences` sequences of up to
        `max_len`, as a paged pool of that many positions holds them. Spread evenly costs the most (each sequence
        pays its window and buffers whatever its length), so that is what it is sized for."""
        share = min(-(-positions // sequences), max_len)
        return cls(sizes, sequences * sizes.bound(share), positions, sequences)

    def admit(self, seq_id: str, positions: int) -> bool:
        """Charge a new sequence for `positions`, leaving the margin free when others run; False: no room."""
        need = self.sizes.at(positions)
        margin = self.margin if self._held else 0
        if not self._room(need + margin):
            return False
        self._held[seq_id] = need
        self.used += need
        return True

    def grow(self, seq_id: str, positions: int) -> bool:
        """Charge an admitted sequence for `positions`; False, nothing charged, past the capacity."""
        held = self._held[seq_id]
        need = max(held, self.sizes.at(positions))
        if not self._room(need - held):
            return False
        self._held[seq_id] = need
        self.used += need - held
        return True

    def release(self, seq_id: str) -> None:
        self.used -= self._held.pop(seq_id, 0)

    def hold_prefix(self, nbytes: int) -> bool:
        """Charge a stored prefix of `nbytes`, reclaiming older ones for it; False, nothing charged, where it does
        not fit beside what the sequences hold."""
        if not self._room(nbytes):
            return False
        self.cached += nbytes
        return True

    def drop_prefix(self, nbytes: int) -> None:
        self.cached -= nbytes

    def _room(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit, once stored prefixes are reclaimed as far as it takes (none is, where they
        would not fit with every one of them dropped)."""
        if self.used + nbytes > self.capacity:
            return False
        over = self.used + self.cached + nbytes - self.capacity
        if over > 0 and self.cached and self.reclaim is not None:
            self.reclaim(over)
        return self.used + self.cached + nbytes <= self.capacity

    def usage(self) -> tuple[int, int]:
        """(used, total) in positions: the bytes held as a share of the `positions` the capacity holds."""
        return self.used * self.positions // self.capacity, self.positions
