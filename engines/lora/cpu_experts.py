"""How a LoRA reaches the routed experts that kt-kernel runs on the CPU.

The expert MLP is nonlinear (`down(silu(gate x) * up x)`), so a LoRA on gate/up cannot be added to the
experts' output afterwards; it has to act inside the MLP. Each CPU-experts layer with at least one expert
LoRA gets one `CPUExpertsLora`, shared by every adapter on that layer, with one of two backends:

* `SFTKernelBackend` — kt-kernel's SFT MoE kernels (`AMXBF16_SFT_MOE`, `AMXInt8_SFT_MOE`, `AMXInt4_SFT_MOE`,
  in the amx and avx512 builds; `MXFP4_SFT_MOE` on every build, for DeepSeek-V4's experts as released, with
  V4's SwiGLU clamp) compute the MLP with the LoRA inside and switch LoRA pointers between calls,
  so one copy of the base experts serves every adapter. The kernel has one rank: adapters are zero-padded
  to the largest rank loaded (exact), with the scale folded into B. Used when this build has the SFT kernel
  of the layer's method (engines/kt/experts/methods.py) and the layer has the base in that kernel's form
  (`sft_base_weights`: bf16, or for MXFP4 the released E2M1 bytes, which experts converted to MXFP4 lack).
* `TorchBackend` — everywhere else (the avx2 build has no bf16 / int SFT kernels; FP8 / RAWINT4 / LLAMAFILE have
  none): the layer's experts in bf16 plus each adapter's factors, computed in float32 with torch, V4's clamp
  applied. Exact up to bf16 weights, slower than the kernel.

A step's rows that use such an adapter get no expert in the base kernel (id -1, which contributes 0) and are
computed here instead; every other row stays on the base kernel. Reading the base experts from the
checkpoint and building a kernel happen in `prepare` (any thread, off the generation thread); `install` and
`remove` only swap references, so a loading adapter never pauses the streams.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from engines.lora.modules import MIXED, LoraContext, experts_in_torch

POINTERS = ("gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b")
_RANK_STEP = 8  # kernel ranks are rounded up to this, so a slightly larger adapter rarely forces a rebuild


@runtime_checkable
class CPUExperts(Protocol):
    """What expert LoRA needs of a CPU-experts layer (engines/kt/experts/cpu.py: RoutedExpertsCPU). The
    kt-kernel specifics come through it, so LoRA code never imports an engine."""

    layer_idx: int
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    chunk_tokens: int
    swiglu_limit: float  # DeepSeek-V4's clamp of the SwiGLU inputs; 0 for none
    lora: "CPUExpertsLora | None"

    def sft_kernel(self) -> tuple[type, Any] | None:
        """(kt-kernel's SFT kernel class for this layer's method, a fresh MOESFTConfig), or None."""

    def sft_base_weights(self, config: Any) -> tuple[tuple[torch.Tensor, ...], bool]:
        """Point an SFT config at the layer's base experts in the kernel's form: the tensors, and whether the kernel
        reads them after loading."""

    def worker_pool(self) -> Any:
        """The shared kt-kernel worker pool."""

    def read_base_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's base experts as the checkpoint has them: gate, up [E, I, H], down [E, H, I]."""


def kernel_rank(rank: int) -> int:
    return -(-rank // _RANK_STEP) * _RANK_STEP


# ------------------------------------------------------------------------------------------ backends
class SFTKernelBackend:
    """One kt-kernel SFT kernel holding the layer's base experts; adapters switch its LoRA pointers."""

    def __init__(self, experts: CPUExperts, kernel_cls: type, config: Any, rank: int):
        self.rank, self.top_k, self.hidden_size = rank, experts.top_k, experts.hidden_size
        self.shape = (experts.num_experts, experts.intermediate_size, experts.hidden_size)
        self.chunk_tokens = experts.chunk_tokens
        self.pool = experts.worker_pool()
        self._map = torch.arange(experts.num_experts, dtype=torch.int64)
        self._zeros = self.pad({})
        config.expert_num, config.num_experts_per_tok = experts.num_experts, experts.top_k
        config.hidden_size, config.intermediate_size = experts.hidden_size, experts.intermediate_size
        config.lora_rank, config.lora_alpha, config.lora_dropout = rank, float(rank), 0.0
        config.max_cache_depth, config.max_len, config.layer_idx = 1, experts.chunk_tokens, experts.layer_idx
        config.physical_to_logical_map = self._map.data_ptr()
        base, read_later = experts.sft_base_weights(config)
        for name, tensor in zip(POINTERS, self._zeros):
            setattr(config, name, tensor.data_ptr())
        config.pool = self.pool.backend_
        self.kernel = kernel_cls(config)
        self.pool.submit(self.kernel.load_weights_task())
        self.pool.sync()
        self._keep = base if read_later else ()  # kernels that copy the base in at load free it here
        n, h = experts.chunk_tokens, experts.hidden_size
        self._buffers = (torch.zeros(n, h, dtype=torch.bfloat16), torch.zeros(n, self.top_k, dtype=torch.int64),
                         torch.zeros(n, self.top_k, dtype=torch.float32), torch.zeros(n, h, dtype=torch.bfloat16),
                         torch.zeros(1, dtype=torch.int32))

    def pad(self, updates: dict) -> tuple[torch.Tensor, ...]:
        """The six kernel tensors (bf16, A [E, R, in] / B [E, out, R]) for {projection: (A, B, scale)}."""
        experts, inter, hidden = self.shape
        out = []
        for proj, (rows, cols) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            a = torch.zeros(experts, self.rank, cols, dtype=torch.bfloat16)
            b = torch.zeros(experts, rows, self.rank, dtype=torch.bfloat16)
            if proj in updates:
                ua, ub, scale = updates[proj]
                a[:, :ua.shape[1]] = ua
                b[:, :, :ua.shape[1]] = ub.float() * scale
            out += [a, b]
        return tuple(out)

    def adopt(self, updates: dict) -> tuple[torch.Tensor, ...]:
        return self.pad(updates)

    @torch.no_grad()
    def run(self, tensors: tuple[torch.Tensor, ...], hidden: torch.Tensor, ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """The routed experts of these rows with this adapter, [n, H] float32. Waits for the shared pool."""
        self.kernel.update_lora_weights(*(t.data_ptr() for t in tensors))
        x, k_ids, k_weights, out, size = self._buffers
        result = torch.empty(hidden.shape[0], self.hidden_size, dtype=torch.float32)
        for start in range(0, hidden.shape[0], self.chunk_tokens):
            n = min(self.chunk_tokens, hidden.shape[0] - start)
            x[:n].copy_(hidden[start:start + n])
            k_ids[:n].copy_(ids[start:start + n])
            k_weights[:n].copy_(weights[start:start + n])
            size[0] = n
            self.pool.submit(self.kernel.forward_sft_task(size.data_ptr(), self.top_k, k_ids.data_ptr(),
                                                          k_weights.data_ptr(), x.data_ptr(), out.data_ptr(), False))
            self.pool.sync()
            result[start:start + n] = out[:n].float()
        return result


class TorchBackend:
    """The layer's base experts in bf16, computed with each adapter's LoRA in float32 by torch."""

    rank = 0  # any rank fits

    def __init__(self, experts: CPUExperts):
        gate, up, down = experts.read_base_weights()
        self.gate_up = torch.cat([gate, up], dim=1).to("cpu", torch.bfloat16).contiguous()
        self.down = down.to("cpu", torch.bfloat16).contiguous()
        self.limit = float(getattr(experts, "swiglu_limit", 0.0) or 0.0)

    @staticmethod
    def adopt(updates: dict) -> dict:
        return {p: (a.float().contiguous(), b.float().contiguous(), s) for p, (a, b, s) in updates.items()}

    @torch.no_grad()
    def run(self, updates: dict, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return experts_in_torch(hidden.float(), ids, weights.float(), self.gate_up, self.down, updates,
                                limit=self.limit)


# ------------------------------------------------------------------------------------------ one layer
@dataclass
class PreparedExpertLora:
    """An adapter's share of one layer, ready to swap in: its tensors and, when the layer needed one, a
    new backend (first adapter, or a rank the current kernel cannot hold)."""

    updates: dict  # projection -> (A [E, r, in], B [E, out, r], scale), float32 on the CPU
    backend: Any | None
    tensors: Any


class CPUExpertsLora:
    """The expert-LoRA adapters of one CPU-experts layer and the backend that runs their rows."""

    def __init__(self, experts: CPUExperts, context: LoraContext):
        self.experts = experts
        self.context = context
        self.backend: SFTKernelBackend | TorchBackend | None = None
        self.adapters: dict[str, Any] = {}  # name -> backend tensors
        self._updates: dict[str, dict] = {}  # name -> float updates, to re-lay them out for a new backend

    # --------------------------------------------------------------------------- any thread
    @staticmethod
    def prepare(experts: CPUExperts, updates: dict) -> PreparedExpertLora:
        """Everything slow: read the base experts, build a kernel, lay the update out for it."""
        updates = {p: (u.a.float().contiguous(), u.b.float().contiguous(), u.scale) for p, u in updates.items()}
        current = experts.lora.backend if experts.lora is not None else None
        sft = experts.sft_kernel()
        if sft is None:
            backend = current if isinstance(current, TorchBackend) else TorchBackend(experts)
        else:
            rank = kernel_rank(max(a.shape[1] for a, _, _ in updates.values()))
            backend = current if current is not None and current.rank >= rank else \
                SFTKernelBackend(experts, *sft, max(rank, current.rank if current is not None else 0))
        return PreparedExpertLora(updates, None if backend is current else backend, backend.adopt(updates))

    # --------------------------------------------------------------------------- engine thread
    def install(self, name: str, prepared: PreparedExpertLora) -> None:
        new = prepared.backend
        if new is not None and (self.backend is None or new.rank >= self.backend.rank):
            self.adapters = {n: new.adopt(u) for n, u in self._updates.items()}
            self.backend = new
            tensors = prepared.tensors
        else:  # another load swapped in a backend since this one was prepared: lay it out for that one
            tensors = self.backend.adopt(prepared.updates)
        self._updates[name] = prepared.updates
        self.adapters[name] = tensors

    def remove(self, name: str) -> bool:
        """Drop the adapter; True when none is left (the layer then drops this object and its base copy)."""
        self.adapters.pop(name, None)
        self._updates.pop(name, None)
        return not self.adapters

    # --------------------------------------------------------------------------- each step
    def begin(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """ids for the base kernel (rows of this layer's adapters get -1) and what `finish` needs."""
        names = self.context.active(self.adapters)
        if not names:
            return ids, None
        base_ids = ids.clone()
        for name in names:
            rows = self._rows_of(name, base_ids.device)
            base_ids[slice(None) if rows is None else rows] = -1
        return base_ids, (hidden, ids, weights, names)

    def finish(self, out: torch.Tensor, state: Any) -> torch.Tensor:
        """The base kernel's output with the rows of this layer's adapters filled in."""
        if state is None:
            return out
        hidden, ids, weights, names = state
        for name in names:
            rows = self._rows_of(name, torch.device("cpu"))
            pick = (lambda t: t.cpu()) if rows is None else (lambda t: t.cpu().index_select(0, rows))
            part = self.backend.run(self.adapters[name], pick(hidden), pick(ids), pick(weights))
            part = part.to(out.device, out.dtype)
            if rows is None:
                out = out + part  # the base kernel returned zeros for every row
            else:
                out.index_copy_(0, rows.to(out.device), part)
        return out

    def _rows_of(self, name: str, device: torch.device) -> torch.Tensor | None:
        rows = self.context.rows
        return None if rows.single is not MIXED else rows.index(name, device)

    def nbytes(self, name: str) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b, _ in
                   self._updates[name].values())
