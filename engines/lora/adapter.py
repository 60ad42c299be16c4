"""The one in-memory form of a LoRA adapter, whatever file it came from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engines.base import InvalidRequestError

EXPERT_PROJECTIONS = ("gate", "up", "down")


class AdapterFormatError(InvalidRequestError):
    """An adapter that cannot be read or does not fit the base model (HTTP 400 when loaded at run time)."""

    def __init__(self, message: str):
        super().__init__(message, param="lora_path")


def finite(tensor: torch.Tensor, source: str) -> torch.Tensor:
    """`tensor`, refused naming `source` when it holds NaN or an infinity: one would spoil every reply the
    adapter writes."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise AdapterFormatError(f"{source} holds NaN or infinite values")
    return tensor


@dataclass(slots=True)
class LoraWeight:
    """The update `scale * B @ A` of one linear weight `[out, in]`: A `[r, in]`, B `[out, r]`."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    source: str = ""  # the file key, for error messages

    @property
    def shape(self) -> tuple[int, int]:
        return self.b.shape[0], self.a.shape[1]

    def delta(self) -> torch.Tensor:
        return (self.b.float() @ self.a.float()) * self.scale


@dataclass(slots=True)
class ExpertLora:
    """One projection of all routed experts of a layer: A `[E, r, in]`, B `[E, out, r]`."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    source: str = ""

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.a.shape[0], self.b.shape[1], self.a.shape[2]

    @property
    def rank(self) -> int:
        return self.a.shape[1]


@dataclass(slots=True)
class ValueHead:
    """LLaMA-Factory's reward head: score = weight @ hidden + bias on the last token's final hidden state."""

    weight: torch.Tensor  # [1, H]
    bias: torch.Tensor | None  # [1]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        out = hidden.float() @ self.weight.float().T
        return (out + self.bias.float() if self.bias is not None else out).squeeze(-1)


@dataclass
class LoraAdapter:
    """Linear updates by module name; routed-expert updates by MoE layer index and projection."""

    path: str
    format: str
    linears: dict[str, LoraWeight] = field(default_factory=dict)
    experts: dict[int, dict[str, ExpertLora]] = field(default_factory=dict)
    value_head: ValueHead | None = None
    # expert updates that need the model's expert count and sizes to be laid out (engines.lora.bind)
    pending: list = field(default_factory=list)
    # the checkpoint a KT-SFT adapter was trained on (engines/lora/kt_manifest.py), checked against the served one
    binding: Any = None

    @property
    def has_expert_lora(self) -> bool:
        return bool(self.experts)

    def nbytes(self) -> int:
        tensors = [t for w in self.linears.values() for t in (w.a, w.b)]
        tensors += [t for layer in self.experts.values() for e in layer.values() for t in (e.a, e.b)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def max_expert_rank(self) -> int:
        return max((e.rank for layer in self.experts.values() for e in layer.values()), default=0)

    def is_empty(self) -> bool:
        return not (self.linears or self.experts or self.pending) and self.value_head is None
