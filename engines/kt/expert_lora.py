"""Expert LoRA on the CPU experts, through kt-kernel's SFT MoE kernels.

The expert MLP is nonlinear (`down(silu(gate x) * up x)`), so a LoRA on gate/up cannot be added to the
output afterwards; it has to act inside the kernel. kt-kernel's SFT classes (`AMXBF16_SFT_MOE`,
`AMXInt8_SFT_MOE`, `AMXInt4_SFT_MOE`) compute exactly that, and `update_lora_weights` switches their six
LoRA pointers between calls while the base weights stay one copy. So each MoE layer gets ONE such kernel,
built the first time an adapter with expert LoRA on it is installed and shared by all of them; an adapter
costs only its own LoRA tensors. Rows of the step that use such an adapter run through it, one adapter at a
time with its pointers switched in; every other row stays on the layer's ordinary kernel. Costs measured
with `python -m bench.expert_lora` (see its docstring).

The kernel has one rank: adapters are zero-padded to the largest rank loaded (exact), and the scale is
folded into B (kernel alpha = rank, i.e. scaling 1). A larger rank than the kernel's rebuilds it.
"""
from __future__ import annotations

import logging

import torch

from engines.base import UnsupportedError
from engines.kt.cpuinfer import load_ext, shared_cpu_infer

log = logging.getLogger("ktserve.engine.kt")

SFT_KERNELS = {"BF16": "AMXBF16_SFT_MOE", "AMXINT8": "AMXInt8_SFT_MOE", "AMXINT4": "AMXInt4_SFT_MOE"}
POINTERS = ("gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b")
_RANK_STEP = 8  # kernel ranks are rounded up to this, so a slightly larger adapter rarely forces a rebuild


def kernel_rank(rank: int) -> int:
    return -(-rank // _RANK_STEP) * _RANK_STEP


def sft_kernel_class(method: str):
    name = SFT_KERNELS.get(method)
    cls = getattr(load_ext().moe, name, None) if name else None
    if cls is None:
        raise UnsupportedError(f"expert LoRA needs kt-kernel's SFT MoE kernels for the experts' method {method}; "
                               f"this build has them for: "
                               f"{', '.join(m for m, n in SFT_KERNELS.items() if hasattr(load_ext().moe, n)) or 'none'}"
                               f" (serve with kt_method BF16 or AMXINT8, or merge the adapter)")
    return cls


def pad_updates(updates: dict, num_experts: int, inter: int, hidden: int, rank: int) -> tuple[torch.Tensor, ...]:
    """The six kernel tensors (bf16, [E, R, in] / [E, out, R]) for {projection: ExpertLora-like a, b, scale}."""
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    out = []
    for proj in ("gate", "up", "down"):
        rows, cols = shapes[proj]
        a = torch.zeros(num_experts, rank, cols, dtype=torch.bfloat16)
        b = torch.zeros(num_experts, rows, rank, dtype=torch.bfloat16)
        if proj in updates:
            ua, ub, scale = updates[proj]
            r = ua.shape[1]
            a[:, :r] = ua
            b[:, :, :r] = ub.float() * scale
        out += [a, b]
    return tuple(out)


class ExpertLoraKernel:
    """One layer's SFT kernel and the LoRA tensors of every adapter installed on it."""

    def __init__(self, *, layer_idx: int, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 method: str, rank: int, chunk_tokens: int, threads: int | None,
                 weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        ext = load_ext()
        self.num_experts, self.top_k, self.rank = num_experts, top_k, rank
        self.hidden_size, self.intermediate_size, self.chunk_tokens = hidden_size, intermediate_size, chunk_tokens
        self.pool = shared_cpu_infer(threads)
        gate, up, down = (w.to("cpu", torch.bfloat16).contiguous() for w in weights)
        self._identity = torch.arange(num_experts, dtype=torch.int64)
        self._zeros = pad_updates({}, num_experts, intermediate_size, hidden_size, rank)
        config = ext.moe.MOESFTConfig()
        config.expert_num, config.num_experts_per_tok = num_experts, top_k
        config.hidden_size, config.intermediate_size = hidden_size, intermediate_size
        config.lora_rank, config.lora_alpha, config.lora_dropout = rank, float(rank), 0.0
        config.max_cache_depth, config.max_len, config.layer_idx = 1, chunk_tokens, layer_idx
        config.physical_to_logical_map = self._identity.data_ptr()
        config.gate_proj, config.up_proj, config.down_proj = gate.data_ptr(), up.data_ptr(), down.data_ptr()
        for name, tensor in zip(POINTERS, self._zeros):
            setattr(config, name, tensor.data_ptr())
        config.pool = self.pool.backend_
        self.kernel = sft_kernel_class(method)(config)
        self.pool.submit(self.kernel.load_weights_task())
        self.pool.sync()
        self.adapters: dict[str, tuple[torch.Tensor, ...]] = {}
        self._buffers = (torch.zeros(chunk_tokens, hidden_size, dtype=torch.bfloat16),
                         torch.zeros(chunk_tokens, top_k, dtype=torch.int64),
                         torch.zeros(chunk_tokens, top_k, dtype=torch.float32),
                         torch.zeros(chunk_tokens, hidden_size, dtype=torch.bfloat16),
                         torch.zeros(1, dtype=torch.int32))

    def nbytes(self, name: str) -> int:
        return sum(t.numel() * t.element_size() for t in self.adapters[name])

    @torch.no_grad()
    def run(self, name: str, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts of `name`'s rows, [n, H] float32. Waits for every task in the shared pool."""
        self.kernel.update_lora_weights(*(t.data_ptr() for t in self.adapters[name]))
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
