"""LoRA-aware wrappers around a model's modules, applying each adapter to its own rows only.

A step's rows may belong to different adapters (the KT engine runs every sequence of a step in one
forward). The runner describes that with `AdapterRows` and hands it to its model's `LoraContext` for the
duration of the forward; every wrapper of that model reads it from there. The context belongs to one
model, not to the process, and is empty outside a forward. Wrappers keep the base module untouched, so
the base model's output is exactly what it was without adapters."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

MIXED = object()  # AdapterRows.single when the step mixes adapters
_STEP = object()  # LoraLinear.forward: take the adapter from the step's rows


class AdapterRows:
    """Which adapter each row of a step's flat batch uses. `spans`: (adapter or None, first row, rows)."""

    def __init__(self, spans: list[tuple[str | None, int, int]]):
        self._rows: dict[str | None, list[int]] = {}
        for adapter, row, n in spans:
            self._rows.setdefault(adapter, []).extend(range(row, row + n))
        self.single = next(iter(self._rows)) if len(self._rows) == 1 else MIXED
        self._index: dict[tuple[str | None, str], torch.Tensor] = {}

    @classmethod
    def uniform(cls, adapter: str | None) -> "AdapterRows":
        rows = cls([])
        rows.single = adapter
        return rows

    @property
    def names(self) -> list[str | None]:
        return list(self._rows) if self.single is MIXED else [self.single]

    def index(self, adapter: str | None, device: torch.device) -> torch.Tensor:
        """The rows of `adapter`, as a long tensor on `device` (made once per step and device)."""
        key = (adapter, str(device))
        if key not in self._index:
            self._index[key] = torch.tensor(self._rows[adapter], dtype=torch.long, device=device)
        return self._index[key]


class LoraContext:
    """The step's `AdapterRows`, set by the runner around one forward of its model. Steps nest: a runner that
    runs part of its model on one sequence's rows at a time (DeepSeek-V4's attention) sets that sequence's
    rows inside the step's, and the step's come back after it."""

    def __init__(self) -> None:
        self.rows: AdapterRows | None = None

    @contextmanager
    def step(self, rows: AdapterRows) -> Iterator[None]:
        outer, self.rows = self.rows, rows
        try:
            yield
        finally:
            self.rows = outer

    def active(self, updates: dict) -> list[str]:
        """The adapters of this step that have an update in `updates`."""
        if self.rows is None or not updates:
            return []
        return [n for n in self.rows.names if n in updates]


def low_rank(x: torch.Tensor, update: tuple[torch.Tensor, torch.Tensor, float]) -> torch.Tensor:
    a, b, scale = update
    return (x @ a.T) @ b.T * scale


class _WithUpdates(nn.Module):
    """A base module plus per-adapter low-rank updates (A, B, scale), keyed by adapter name."""

    def __init__(self, base: nn.Module, context: LoraContext):
        super().__init__()
        self.lora_base = base
        self.context = context
        self.updates: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}

    @property
    def weight(self) -> torch.Tensor:
        return self.lora_base.weight


class LoraLinear(_WithUpdates):
    """A linear layer plus per-adapter updates `scale * B @ A`, applied to the rows of each adapter."""

    def forward(self, x: torch.Tensor, adapter=_STEP) -> torch.Tensor:
        y = self.lora_base(x)
        if adapter is not _STEP:  # the caller says whose rows these are (e.g. cached latents of one sequence)
            update = self.updates.get(adapter)
            return y if update is None else y + low_rank(x, update)
        names = self.context.active(self.updates)
        if not names:
            return y
        if self.context.rows.single is not MIXED:
            return y + low_rank(x, self.updates[names[0]])
        for name in names:
            rows = self.context.rows.index(name, x.device)
            y.index_add_(0, rows, low_rank(x.index_select(0, rows), self.updates[name]))
        return y


class RouterLora(_WithUpdates):
    """A MoE router with per-adapter LoRA on its weight. The router works row by row, so each adapter's
    rows run through it with that adapter's merged weight (a small [experts, hidden] matrix)."""

    def _with(self, name: str, hidden: torch.Tensor):
        a, b, scale = self.updates[name]
        weight = self.lora_base.weight
        merged = weight + (b @ a * scale).to(weight.dtype)
        return torch.func.functional_call(self.lora_base, {"weight": merged}, (hidden,))

    def forward(self, hidden: torch.Tensor):
        names = self.context.active(self.updates)
        if not names:
            return self.lora_base(hidden)
        if self.context.rows.single is not MIXED:
            return self._with(names[0], hidden)
        flat = hidden.reshape(-1, hidden.shape[-1])
        outputs = self.lora_base(flat)
        for name in names:
            rows = self.context.rows.index(name, flat.device)
            for out, part in zip(outputs, self._with(name, flat.index_select(0, rows))):
                out.index_copy_(0, rows, part.to(out.dtype))
        return outputs


ExpertUpdates = dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # projection -> (A [E,r,in], B [E,out,r], s)


def experts_in_torch(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor, updates: ExpertUpdates, act=F.silu, limit: float = 0.0) -> torch.Tensor:
    """sum_k w_k * down_e(act(gate_e x) * up_e x) with LoRA updates, for fused transformers weights
    gate_up [E, 2I, H] and down [E, H, I], computed in hidden's dtype (weights are cast one expert at a time).
    With `limit` (DeepSeek-V4's swiglu_limit), gate is clamped from above and up to [-limit, limit] before the
    product, LoRA included, as V4's experts do."""
    inter = gate_up.shape[1] // 2
    out = torch.zeros_like(hidden)
    for expert in torch.unique(ids[ids >= 0]).tolist():
        token, slot = (ids == expert).nonzero(as_tuple=True)
        x = hidden.index_select(0, token)
        gate, up = F.linear(x, gate_up[expert].to(x.dtype)).split(inter, dim=-1)
        if "gate" in updates:
            gate = gate + _expert_low_rank(x, updates["gate"], expert)
        if "up" in updates:
            up = up + _expert_low_rank(x, updates["up"], expert)
        if limit:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        h = act(gate) * up
        y = F.linear(h, down[expert].to(h.dtype))
        if "down" in updates:
            y = y + _expert_low_rank(h, updates["down"], expert)
        out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
    return out


def _expert_low_rank(x: torch.Tensor, update, expert: int) -> torch.Tensor:
    a, b, scale = update
    return (x @ a[expert].T) @ b[expert].T * scale


class TorchExpertsLora(nn.Module):
    """transformers' fused routed experts (kept in torch) with per-adapter expert LoRA."""

    def __init__(self, base: nn.Module, context: LoraContext):
        super().__init__()
        self.lora_base = base
        self.context = context
        self.updates: dict[str, ExpertUpdates] = {}

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        names = self.context.active(self.updates)
        base = self.lora_base
        act, limit = getattr(base, "act_fn", F.silu), float(getattr(base, "limit", 0.0) or 0.0)
        if names and self.context.rows.single is not MIXED:
            return experts_in_torch(hidden, ids, weights, base.gate_up_proj, base.down_proj, self.updates[names[0]],
                                    act, limit)
        out = base(hidden, ids, weights)
        for name in names:
            rows = self.context.rows.index(name, hidden.device)
            part = experts_in_torch(hidden.index_select(0, rows), ids.index_select(0, rows),
                                    weights.index_select(0, rows), base.gate_up_proj, base.down_proj,
                                    self.updates[name], act, limit)
            out.index_copy_(0, rows, part.to(out.dtype))
        return out
