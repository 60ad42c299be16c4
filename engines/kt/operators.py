"""Operators the placement rules put in place of transformers' DeepSeek modules.

Each operator class has `KWARGS` (what a rule may pass) and `from_module(module, name, config, **kwargs)`,
which builds it from the module it replaces (on the meta device; weights arrive later from the loader).

* `MLAAttention`       multi-head latent attention over the paged latent cache; decode attends in the
                       latent space (the "absorbed" form) so the cache is never expanded to full K/V.
* `MoEWithCPUExperts`  router and shared experts on `device`, routed experts in kt-kernel on the CPU;
                       the CPU work runs while the shared experts run on the GPU.
* `RoutedExpertsCPU`   only the routed experts (the transformers MoE block around it stays).
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engines.kt.attention import DecodeBatch, MLAAttention, Span, StepBatch, layer_index
from engines.kt.experts_cpu import RoutedExpertsCPU as _ExpertKernel
from engines.lora.modules import MIXED

__all__ = ["DecodeBatch", "MLAAttention", "MoEWithCPUExperts", "RoutedExpertsCPU", "Span", "StepBatch",
           "layer_index"]


# --------------------------------------------------------------------------------------------- experts
def _expert_kwargs(name: str, config: Any, device: str, method: str | None, gpu_experts: Any,
                   threads: int | None) -> dict[str, Any]:
    method = (getattr(config, "kt_method_override", None) or method or "AMXINT8").upper()
    num_experts = getattr(config, "n_routed_experts", None) or config.num_experts
    if isinstance(gpu_experts, int):
        gpu_experts = list(range(gpu_experts)) if gpu_experts > 0 else None
    return dict(layer_idx=layer_index(name), num_experts=num_experts, top_k=config.num_experts_per_tok,
                hidden_size=config.hidden_size, intermediate_size=config.moe_intermediate_size, method=method,
                threads=getattr(config, "kt_cpu_threads", None) or threads,
                max_tokens=getattr(config, "kt_max_tokens", 512), gpu_experts=gpu_experts or None,
                gpu_device=device)


class RoutedExpertsCPU(_ExpertKernel):
    """The routed experts alone, in kt-kernel on the CPU, returning their output on `device`."""

    KWARGS = frozenset({"device", "method", "gpu_experts", "threads"})

    def __init__(self, *, out_device: str = "cpu", checkpoint: str | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.out_device = torch.device(out_device)
        self.wait_seconds = 0.0
        self.checkpoint = checkpoint  # where the LoRA kernel re-reads this layer's base experts from
        self._lora: Any = None  # engines.kt.expert_lora.ExpertLoraKernel, while an expert-LoRA adapter is in
        self._lora_context: Any = None
        self._lora_step: Any = None

    @classmethod
    def from_module(cls, module: nn.Module, name: str, config: Any, device: str = "cpu", method: str | None = None,
                    gpu_experts: Any = None, threads: int | None = None, **_: Any) -> "RoutedExpertsCPU":
        return cls(out_device=device, checkpoint=getattr(config, "_name_or_path", None),
                   **_expert_kwargs(name, config, device, method, gpu_experts, threads))

    # ------------------------------------------------------------------ expert LoRA (engines/kt/expert_lora.py)
    def prepare_lora(self, updates: dict) -> dict:
        """Any thread: refuse what the kernels cannot do, and take the update as CPU tensors."""
        from engines.kt.expert_lora import sft_kernel_class
        sft_kernel_class(self.method)
        return {p: (u.a.float().contiguous(), u.b.float().contiguous(), u.scale) for p, u in updates.items()}

    def install_lora(self, name: str, updates: dict, context: Any) -> None:
        """Engine thread: build (or widen) this layer's shared LoRA kernel and add the adapter to it."""
        from engines.kt.expert_lora import ExpertLoraKernel, kernel_rank, pad_updates
        from engines.kt.loader import read_layer_experts

        self._lora_context = context
        rank = kernel_rank(max(a.shape[1] for a, _, _ in updates.values()))
        if self._lora is None or rank > self._lora.rank:
            rank = max(rank, self._lora.rank if self._lora is not None else 0)
            weights = read_layer_experts(self.checkpoint, f"model.layers.{self.layer_idx}.mlp.experts",
                                         self.num_experts)
            kernel = ExpertLoraKernel(layer_idx=self.layer_idx, num_experts=self.num_experts, top_k=self.top_k,
                                      hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                                      method=self.method, rank=rank, chunk_tokens=self.chunk_tokens,
                                      threads=self.threads, weights=weights)
            if self._lora is not None:  # widen the adapters already in: zero columns are exact
                for other, tensors in self._lora.adapters.items():
                    kernel.adapters[other] = _widen(tensors, rank)
            self._lora = kernel
        self._lora.adapters[name] = pad_updates(updates, self.num_experts, self.intermediate_size,
                                                self.hidden_size, self._lora.rank)

    def remove_lora(self, name: str) -> None:
        if self._lora is not None:
            self._lora.adapters.pop(name, None)
            if not self._lora.adapters:
                self._lora = None  # the shared base copy goes with the last adapter

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Rows of adapters with expert LoRA get no expert here (-1: contributes 0); sync() adds them."""
        names = self._lora_context.active(self._lora.adapters) if self._lora is not None else []
        self._lora_step = None
        if names:
            self._lora_step = (hidden, topk_ids, topk_weights, names)
            topk_ids = topk_ids.clone()
            for n in names:
                rows = self._rows_of(n, topk_ids.device)
                topk_ids[slice(None) if rows is None else rows] = -1
        super().submit(hidden, topk_ids, topk_weights)

    def sync(self) -> torch.Tensor:
        out = super().sync()
        step, self._lora_step = self._lora_step, None
        if step is None:
            return out
        hidden, ids, weights, names = step
        for n in names:
            rows = self._rows_of(n, torch.device("cpu"))
            pick = (lambda t: t.cpu()) if rows is None else (lambda t: t.cpu().index_select(0, rows))
            part = self._lora.run(n, pick(hidden), pick(ids), pick(weights)).to(out.device, out.dtype)
            if rows is None:
                out = out + part  # the base kernel returned zeros for every row
            else:
                out.index_copy_(0, rows.to(out.device), part)
        return out

    def _rows_of(self, name: str, device: torch.device) -> torch.Tensor | None:
        rows = self._lora_context.rows
        return None if rows.single is not MIXED else rows.index(name, device)

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        self.submit(hidden, topk_ids, topk_weights)
        return self.wait()

    def wait(self) -> torch.Tensor:
        started = time.perf_counter()
        out = self.sync()
        self.wait_seconds += time.perf_counter() - started
        return out.to(self.out_device)


def _widen(tensors: tuple[torch.Tensor, ...], rank: int) -> tuple[torch.Tensor, ...]:
    """Kernel LoRA tensors (A [E, r, in], B [E, out, r] alternating) zero-padded to `rank`."""
    out = []
    for i, t in enumerate(tensors):
        pad = [0, 0, 0, rank - t.shape[1]] if i % 2 == 0 else [0, rank - t.shape[2]]  # F.pad: last dim first
        out.append(F.pad(t, pad).contiguous())
    return tuple(out)


class MoEWithCPUExperts(nn.Module):
    """Router and shared experts where the rule says, routed experts on the CPU, overlapped."""

    KWARGS = frozenset({"device", "method", "gpu_experts", "threads"})

    def __init__(self, gate: nn.Module, shared_experts: nn.Module | None, experts: RoutedExpertsCPU):
        super().__init__()
        self.gate = gate
        self.shared_experts = shared_experts
        self.experts = experts

    @classmethod
    def from_module(cls, module: nn.Module, name: str, config: Any, device: str = "cpu", method: str | None = None,
                    gpu_experts: Any = None, threads: int | None = None, **_: Any) -> "MoEWithCPUExperts":
        experts = RoutedExpertsCPU.from_module(module.experts, f"{name}.experts", config, device=device,
                                               method=method, gpu_experts=gpu_experts, threads=threads)
        return cls(module.gate, getattr(module, "shared_experts", None), experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, topk_weights, topk_ids = self.gate(x)
        self.experts.submit(x, topk_ids, topk_weights)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        routed = self.experts.wait().to(x.dtype)
        return routed if shared is None else routed + shared
