"""One sequence's DeepSeek-V4 cache (transformers' `DynamicCache` of V4 cache layers: sliding-window keys,
compressor buffers, overlap slices and compressed entries) and the one way it goes back to an earlier position.

V4's cache layers only append, and three things need a cache taken back:
- a failed step: the shared runtime may run a step's chunks again after it raised, whole or in parts, and the
  second run must give what a first would (engines/runtime/model_runner.py: ModelRunner.execute);
- a rerun of a step that did finish (its chunks ran before the failure struck elsewhere);
- a verified draft (speculative decoding): the step fed the last token and the draft, the next step starts at
  the accepted length, anywhere between the step's start and what it fed.

So each step starts from a mark: the cache's state where the step starts, taken before it runs. A failed step or
a rerun goes back to the mark. A step that feeds a draft also records, per layer, what it put into the cache (the
new sliding-window keys and the compressor's inputs); going back to an accepted length between the mark and the
end restores the mark and replays the accepted rows of that record (the keys through the layer's `update`, the
compressor's inputs through the compressor: its projections only, a small part of a layer's work). All rows
accepted: nothing to do.

A mark is cheap: the cache layers replace their tensors rather than write into them, so it keeps references to
the small ones (the sliding window, the compressor buffers and overlap slices) and only the lengths of the
compressed entries, which grow by concatenation and are cut back to those lengths. The draft head keeps its own
cache the same way (mtp.py).

The prefix cache (prefixes.py) keeps a whole cache's state the same way, by reference: `snapshot` copies each
layer's attributes and dicts (the layers assign into their dicts: `buffer_kv`, `entry_count`, ...) and refers to
their tensors, which no later step writes into. Checked against transformers 5.24: `DynamicSlidingWindowLayer.update`
and `DeepseekV4HCACache.update` replace the window with a slice of a concatenation, `store_compression_weights`
the buffers with slices of one, `update_compressor_states` the entries with a concatenation,
`update_overlap_state` the overlap slices with clones; the compressors and the indexer write only into tensors of
their own (`new_kv`, `new_gate`), batch.py's `csa_row` into a new bias. So a copy made from a snapshot
(`restore`) shares its tensors until its own steps replace them: copy-on-write without copying."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

# the cache layers' per-entry dicts of tensors that only grow along dim 1 (DeepseekV4HCACache.compressed_kv)
_GROWING = ("compressed_kv",)


def _mark_layer(layer: Any) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for key, value in vars(layer).items():
        if key in _GROWING:
            state[key] = {name: None if t is None else t.shape[1] for name, t in value.items()}
        elif isinstance(value, dict):
            state[key] = dict(value)
        else:
            state[key] = value
    return state


def _restore_layer(layer: Any, state: dict[str, Any]) -> None:
    current = vars(layer)
    for key in set(current) - set(state):  # set since the mark (a layer's first update initializes it)
        del current[key]
    for key, value in state.items():
        if key in _GROWING:
            grown = current[key]
            current[key] = {name: None if n is None else grown[name][:, :n] for name, n in value.items()}
        elif isinstance(value, dict):
            current[key] = dict(value)
        else:
            current[key] = value


def _compact_layer(layer: Any) -> None:
    """Copy out the tensors that are small views of a step's larger ones (the last `sliding_window` keys of the
    keys a prompt chunk fed, a compressor's buffered rows of the chunk's projections), so the chunk's tensors are
    freed now rather than when the sequence's next step replaces the views: what the cache holds in memory is
    then what its tensors' sizes say (budget.py charges those)."""
    copies: dict[int, torch.Tensor] = {}

    def compact(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() <= 2 * t.nbytes:
            return t
        if id(t) not in copies:  # V4's layers keep one tensor as keys and values: it stays one
            copies[id(t)] = t.clone()
        return copies[id(t)]

    state = vars(layer)
    for key, value in state.items():
        if key in _GROWING:
            continue
        if isinstance(value, dict):
            state[key] = {name: compact(t) for name, t in value.items()}
        else:
            state[key] = compact(value)


def snapshot_layer(layer: Any, copies: dict[int, torch.Tensor] | None = None) -> tuple[type, dict[str, Any]]:
    """One cache layer's state now, which later steps cannot change: its class and attributes (dicts copied,
    tensors referred to; a tensor that is a view of a larger storage copied out, so the state holds only its own
    bytes). `copies`: the tensors copied so far, shared by the layers of one snapshot."""
    copies = {} if copies is None else copies

    def own(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() <= t.nbytes:
            return t
        if id(t) not in copies:  # keys and values are one tensor: they stay one
            copies[id(t)] = t.clone()
        return copies[id(t)]

    return type(layer), {key: {name: own(t) for name, t in value.items()} if isinstance(value, dict) else own(value)
                         for key, value in vars(layer).items()}


def snapshot(cache: Any) -> list[tuple[type, dict[str, Any]]]:
    """The cache's state now, layer by layer (`snapshot_layer`)."""
    copies: dict[int, torch.Tensor] = {}
    return [snapshot_layer(layer, copies) for layer in cache.layers]


def restore(cache: Any, layers: list[tuple[type, dict[str, Any]]]) -> None:
    """Put a `snapshot`'s state into `cache` (a fresh cache of the same model): its layers then refer to the
    snapshot's tensors, and their steps replace them rather than write into them."""
    if len(cache.layers) != len(layers):
        raise ValueError(f"a snapshot of {len(layers)} cache layers cannot go into a cache of {len(cache.layers)}")
    for layer, (kind, state) in zip(cache.layers, layers):
        if type(layer) is not kind:
            raise ValueError(f"a snapshot of a {kind.__name__} cannot go into a {type(layer).__name__}")
        current = vars(layer)
        current.clear()
        current.update({key: dict(value) if isinstance(value, dict) else value for key, value in state.items()})


def snapshot_bytes(layers: list[tuple[type, dict[str, Any]]]) -> int:
    """The memory behind a snapshot's tensors: each storage once."""
    storages: dict[int, int] = {}
    for _, state in layers:
        for value in state.values():
            for t in value.values() if isinstance(value, dict) else [value]:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class StepRecord:
    """What one step put into a cache, per layer, to replay a prefix of it: the keys [1, heads, rows, dim] it
    appended and the compressor (with its inputs) it ran."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.compressors: dict[int, tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def replay(self, cache: Any, rows: int) -> None:
        for layer, keys in self.keys.items():
            cache.update(keys[:, :, :rows], keys[:, :, :rows], layer)
        for layer, (module, x, q_residual, positions) in self.compressors.items():
            module(x[:, :rows], q_residual[:, :rows], positions[:, :rows], cache, layer)


class SequenceCache:
    """A sequence's V4 cache and how far it holds: positions [0, computed).

    Until its first decode step the cache is transformers' (`cache`); then it may move into the paged caches
    (`adopt`: paged.py), which its decode rows write and read from then on (`paged`; `cache` None). A paged
    decode step run again writes the same places (paged.py), so its mark is only a position."""

    def __init__(self, cache: Any):
        self.cache = cache
        self.computed = 0
        self._mark: tuple[int, list[dict[str, Any]] | None] | None = None  # (position, each layer's state there)
        self.record: StepRecord | None = None  # what the step since the mark put in, while it records
        self._done: StepRecord | None = None  # the record of the finished step since the mark
        self.prefix: Any = None  # prefixes.py: the sequence's PrefixPlan where the prefix cache serves it
        self.paged: Any = None  # paged.py: the sequence's PagedSequence once its cache moved there

    def adopt(self, pools: Any) -> None:
        """Move the cache into `pools` (paged.py: PagedDecode), marked where it is."""
        from engines.kt.families.deepseek_v4.paged import keep_until_collected

        self.paged = pools.adopt(self.cache, self.computed)
        keep_until_collected(self, pools, self.paged)
        self.cache = None
        self._mark, self._done, self.record = (self.computed, None), None, None

    @property
    def marked(self) -> int | None:
        return None if self._mark is None else self._mark[0]

    def begin(self, start: int, record: bool = False) -> None:
        """Before a step feeds positions from `start`: the cache taken back to `start` if it holds more (a rerun,
        or the accepted length of a verified draft), then marked there. `record`: the step feeds a draft, keep
        what it puts in. Call it in the sequence's LoRA scope (a replay runs the compressors)."""
        if self.paged is not None and record:
            raise RuntimeError("a V4 cache in the paged caches takes decode rows only, not a draft to verify")
        if start != self.computed:
            self.to(start)
        self.mark()
        self.record = StepRecord() if record else None

    def to(self, position: int) -> None:
        """Back to `position`: the mark's, or between it and `computed` after a recorded step."""
        at = self.marked
        done = self._done
        if at is None or not (at == position or (done is not None and at < position < self.computed)):
            held = "nothing" if at is None else f"a mark at {at}"
            raise RuntimeError(f"V4 cache holds positions [0, {self.computed}) ({held}); it cannot go back to "
                               f"{position}")
        self.rollback()
        if position > at:
            done.replay(self.cache, position - at)
            self.computed = position

    def mark(self) -> None:
        """Mark where the cache is now (`computed`): what `rollback` goes back to."""
        layers = None if self.paged is not None else [_mark_layer(layer) for layer in self.cache.layers]
        self._mark = (self.computed, layers)
        self._done = None

    def commit(self, end: int) -> None:
        """The step ran: the cache holds [0, end). The mark stays, for a rerun of this step or a shorter one."""
        if self.paged is None:
            for layer in self.cache.layers:
                _compact_layer(layer)
        self.computed = end
        self._done, self.record = self.record, None

    def rollback(self) -> None:
        """Back to the mark: the cache as it was before the step that set it."""
        self.record = self._done = None
        if self._mark is None:
            return
        position, layers = self._mark
        if layers is not None:
            for layer, state in zip(self.cache.layers, layers):
                _restore_layer(layer, state)
        self.computed = position
