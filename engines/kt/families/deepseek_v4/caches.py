"""One sequence's DeepSeek-V4 cache (transformers' `DynamicCache` of V4 cache layers: sliding-window keys,
compressor buffers, overlap slices and compressed entries), made safe to run a step twice.

The shared runtime may run a step's chunks again after it raised, whole or in parts, and the second run must
give what a first would (engines/runtime/model_runner.py: ModelRunner.execute). V4's cache layers only append:
a step that failed after some layers had run, or a step whose chunks all ran before the failure struck elsewhere,
would have a rerun append the same positions a second time. So each step starts from a mark: the cache's state
where the step's chunk starts, taken before it runs. A failed step goes back to it; a rerun of the same chunk
(its start is the mark's position, not the cache's end) goes back to it before running again.

A mark is cheap: the cache layers replace their tensors rather than write into them, so it keeps references to
the small ones (the sliding window, the compressor buffers and overlap slices) and only the lengths of the
compressed entries, which grow by concatenation and are cut back to those lengths."""
from __future__ import annotations

from typing import Any

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


class SequenceCache:
    """A sequence's V4 cache and how far it holds: positions [0, computed)."""

    def __init__(self, cache: Any):
        self.cache = cache
        self.computed = 0
        self._mark: tuple[int, list[dict[str, Any]]] | None = None  # (position, each layer's state there)

    def begin(self, start: int) -> None:
        """Before a step feeds positions from `start`: back to the mark if this is a rerun, then mark `start`."""
        if start != self.computed:
            if self._mark is None or self._mark[0] != start:
                held = "nothing" if self._mark is None else f"a mark at {self._mark[0]}"
                raise RuntimeError(f"V4 cache holds positions [0, {self.computed}) ({held}); a step cannot start "
                                   f"at {start}")
            self.rollback()
        self._mark = (start, [_mark_layer(layer) for layer in self.cache.layers])

    def commit(self, end: int) -> None:
        """The step ran: the cache holds [0, end). The mark stays, for a rerun of this step."""
        self.computed = end

    def rollback(self) -> None:
        """Back to the mark: the cache as it was before the step that set it."""
        if self._mark is None:
            return
        position, layers = self._mark
        for layer, state in zip(self.cache.layers, layers):
            _restore_layer(layer, state)
        self.computed = position
