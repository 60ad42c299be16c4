"""Expert deferral (KTransformers' `n_deferred_experts` rule kwarg): in a decode step, each token's d
lowest-weighted routed experts of layer i are computed on the CPU while the GPU already runs layer i+1's
attention, and their output joins layer i+1's MoE output instead of layer i's.

Without it, the GPU idles while a layer's CPU experts run and the CPU idles while the GPU runs the next
layer's attention. With it, the deferred experts fill that gap. The price is a small change to the model's
function: a deferred expert's contribution enters the residual stream one layer late. So it is off unless a
rule asks for it. Only small decode steps defer (`max_batch`): the more tokens a step has, the more experts its
immediate and its deferred halves both touch, and those are read twice; prompt chunks would read nearly every
expert of the layer twice. The last layer with CPU experts (or one whose successor runs elsewhere) does not
defer; it adds its predecessor's deferred output and waits for everything, so nothing is pending between steps.

Every CPU-experts layer of a model shares one `ExpertDeferral` (OperatorOptions). The runner links each layer
to the next (`link`) and opens `decoding()` around decode steps. kt-kernel runs its tasks in the order they
were submitted, so a layer that submits its immediate and then its deferred experts and waits with one task
allowed pending has the immediate result and its predecessor's deferred one, while its own deferred experts
keep running."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch


@dataclass(slots=True)
class Deferred:
    """A layer's deferred experts, submitted: `out` [tokens, H] holds their output once the next layer's wait
    returns."""

    into: int  # the layer whose MoE output takes it
    tokens: int
    out: torch.Tensor
    keep: tuple[torch.Tensor, ...] = ()  # what else the task reads (kt-kernel holds raw pointers)


# how many more expert weights a deferring step may read than the same step undeferred (an expert both halves
# of the step use is read twice). At batch 1 the halves share no expert, and deferral saved 19% of an INT8 step
# on the GPU machine; larger batches were not measured, so the bound keeps the extra reads well below that saving.
MAX_EXTRA_READS = 0.10


def max_batch(num_experts: int, top_k: int, deferred: int, extra: float = MAX_EXTRA_READS) -> int:
    """The most tokens a decode step may have and still defer: with experts picked uniformly at random, the
    expected distinct experts of its immediate and deferred halves together exceed those of the whole step by at
    most `extra` (DeepSeek-V2-Lite, 2 of 6 of 64 deferred: 5 tokens; V3, 3 of 8 of 256: 14)."""
    def distinct(k: int, tokens: int) -> float:
        return num_experts * (1 - (1 - k / num_experts) ** tokens)

    tokens = 1
    while tokens < 1024 and (distinct(top_k - deferred, tokens + 1) + distinct(deferred, tokens + 1)
                             <= (1 + extra) * distinct(top_k, tokens + 1)):
        tokens += 1
    return tokens


class ExpertDeferral:
    def __init__(self) -> None:
        self.active = False  # inside a decode step that defers
        self.pending: Deferred | None = None
        # the latest deferred task stays referenced until the next one replaces it (by then it has finished:
        # the layer that submits the next one waited for it), also when a failed step never took it
        self._latest: Deferred | None = None

    def defer(self, deferred: Deferred) -> None:
        self.pending = self._latest = deferred

    @contextlib.contextmanager
    def decoding(self, defer: bool = True) -> Iterator[None]:
        """A decode step; `defer` False: one too large to defer (max_batch)."""
        self.active, self.pending = defer, None
        try:
            yield
        finally:
            self.active, self.pending = False, None

    def take(self, layer: int) -> Deferred | None:
        """The deferred output `layer` adds to its own, if its predecessor left one."""
        pending, self.pending = self.pending, None
        return pending if pending is not None and pending.into == layer else None


def check_deferred(n: Any, top_k: int) -> int:
    """The number of deferred experts a rule gives: an integer, or KTransformers' one-element list."""
    if isinstance(n, (list, tuple)) and len(n) == 1:
        n = n[0]
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n_deferred_experts must be a whole number of experts (or a list of one), got {n!r}")
    if n >= top_k:
        raise ValueError(f"n_deferred_experts={n} must be below the model's experts per token ({top_k}): each "
                         f"token keeps at least one expert in its own layer")
    return n


def split_deferred(topk_ids: torch.Tensor, topk_weights: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(immediate ids, deferred ids): each row's `n` lowest-weighted experts go to the deferred ids, the rest to
    the immediate ones; the other side gets -1 (no expert) in their place, so both keep the [T, top_k] shape."""
    k = topk_ids.shape[1]
    order = topk_weights.argsort(dim=1, descending=True, stable=True)
    deferred = torch.zeros(topk_ids.shape, dtype=torch.bool, device=topk_ids.device)
    deferred.scatter_(1, order[:, k - n:], True)
    return topk_ids.masked_fill(deferred, -1), topk_ids.masked_fill(~deferred, -1)


def link(layers: list[Any]) -> list[Any]:
    """Point each CPU-experts layer that asks for deferral at its successor (`defer_into`), when the successor is
    the very next decoder layer and takes its output on the same device; the layers that will defer."""
    deferring = []
    for layer, successor in zip(layers, layers[1:] + [None]):
        layer.defer_into = None
        if layer.deferred and successor is not None and successor.layer_idx == layer.layer_idx + 1 \
                and successor.out_device == layer.out_device:
            layer.defer_into = successor.layer_idx
            deferring.append(layer)
    return deferring
