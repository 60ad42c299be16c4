"""Taking a V4 sequence's cache back past rejected draft tokens.

A verification step feeds a sequence's last token and its draft in one forward, and V4's cache layers (transformers'
sliding-window layers; on compressed layers also the compressor's buffered tokens, the overlap of the last window
and the compressed entries, for the indexer too) take in every fed position. A paged cache would let the next step
write over the rejected positions; these layers only append. So before a drafted forward the `Rewinder` keeps a
snapshot of the cache — references: the layers build new tensors on each update and never write into old ones —
and records what the forward adds: each layer's new sliding-window keys and each compressor's inputs. When the next
step shows how many of the fed positions were accepted, it restores the snapshot and replays the accepted part:
the keys through the layer's own `update`, the compressors' inputs through the compressors (their projections
only, a small part of a layer's work). A fully accepted draft leaves the cache as it is."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from engines.runtime.sequence import Sequence


def snapshot(cache: Any) -> list[dict]:
    """Each layer's state as it is now (tensors by reference; the dicts compressed layers keep, copied)."""
    return [{k: dict(v) if isinstance(v, dict) else v for k, v in vars(layer).items()} for layer in cache.layers]


def restore(cache: Any, saved: list[dict]) -> None:
    """Put a `snapshot` back (it stays usable for another restore)."""
    for layer, state in zip(cache.layers, saved):
        vars(layer).update({k: dict(v) if isinstance(v, dict) else v for k, v in state.items()})


@dataclass(slots=True)
class _Drafted:
    start: int  # the first position the drafted step fed
    fed: int  # how many it fed: the last token and the draft
    saved: list[dict]  # the cache before it
    compressors: dict[int, tuple] = field(default_factory=dict)  # layer -> (module, its inputs)
    keys: list[torch.Tensor] | None = None  # per layer, the keys the step added (None: the step did not finish)


class Rewinder:
    def __init__(self, model: nn.Module):
        self._recording: dict[int, tuple] | None = None
        self._pending: dict[str, _Drafted] = {}
        for layer in model.model.layers:
            compressor = getattr(layer.self_attn, "compressor", None)
            if compressor is not None:
                compressor.register_forward_pre_hook(self._record)

    def _record(self, module: nn.Module, args: tuple) -> None:
        if self._recording is not None:
            hidden, q_residual, position_ids, _cache, layer = args
            self._recording[layer] = (module, hidden, q_residual, position_ids)

    def begin(self, seq: Sequence, cache: Any, start: int, fed: int) -> None:
        """A drafted forward of `fed` positions from `start` is about to extend `cache`."""
        drafted = self._pending[seq.id] = _Drafted(start, fed, snapshot(cache))
        self._recording = drafted.compressors

    def end(self, seq: Sequence, cache: Any) -> None:
        drafted = self._pending[seq.id]
        drafted.keys = [layer.keys[:, :, -drafted.fed:] for layer in cache.layers]
        self._recording = None

    def rewind(self, seq: Sequence, cache: Any, start: int, scope: Callable[[], ContextManager]) -> None:
        """Before a step feeds `seq` from `start`: keep the positions of its last drafted step below `start` (the
        accepted ones) and drop the rest. `scope()`: the context the sequence's forwards run in (its adapter)."""
        self._recording = None
        drafted = self._pending.pop(seq.id, None)
        if drafted is None:
            return
        kept = start - drafted.start
        if kept >= drafted.fed:
            return  # all accepted
        restore(cache, drafted.saved)
        if kept <= 0 or drafted.keys is None:
            return  # the drafted step itself runs again (it failed part way)
        with scope():
            for layer, keys in zip(cache.layers, drafted.keys):
                layer.update(keys[:, :, :kept], keys[:, :, :kept])
            for layer, (module, hidden, q_residual, positions) in drafted.compressors.items():
                module(hidden[:, :kept], q_residual[:, :kept], positions[:, :kept], cache, layer)

    def forget(self, seq: Sequence) -> None:
        self._pending.pop(seq.id, None)
