"""The operators placement rules can name (`replace.class: engines.kt.placement.operators.<Name>`), and the options
every operator is built with.

Each operator class has `KWARGS` (what a rule may pass) and `from_module(module, name, config, options,
**kwargs)`, which builds it from the module it replaces (on the meta device; weights arrive later from the
loader). Engine-wide settings reach operators only through `OperatorOptions`, passed explicitly at injection.

* `MLAAttention`       multi-head latent attention over the paged latent cache: V2 / V3's own
                       (engines/kt/families/deepseek_mla/attention.py), which rules name here and the alias table
                       (aliases.py: OPERATOR_CLASSES) finds there.
* `IndexedMLAAttention` MLA with DeepSeek-V3.2's lightning indexer choosing the positions each query attends
                       to: V3.2's own (engines/kt/families/deepseek_v32/attention.py), named and found the same way.
* `MoEWithCPUExperts`  router and shared experts on `device`, routed experts in kt-kernel on the CPU;
                       the CPU work runs while the shared experts run on the GPU.
* `RoutedExpertsCPU`   only the routed experts (the transformers MoE block around it stays);
                       engines/kt/experts/cpu.py.

`fuse_rms_norms` is not a rule's operator: the engine applies it to every RMSNorm that lands on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from engines.kt.experts.deferral import ExpertDeferral
from engines.kt.experts.decode_calls import DecodeKernelPolicy
from engines.kt.experts.methods import DEFAULT_METHOD, normalize_method
from engines.kt.experts.streaming import ExpertStreamers
from engines.kt.experts.protocol import RoutedExperts
from engines.kt.experts.cpu import RoutedExpertsCPU, SharedStaging

__all__ = ["FusedRMSNorm", "MoEWithCPUExperts", "OperatorOptions", "RoutedExpertsCPU", "fuse_rms_norms",
           "uses_cpu_experts"]


@dataclass(frozen=True, slots=True)
class OperatorOptions:
    """Engine-wide settings the operators are built with."""

    max_tokens: int = 512  # most tokens one expert call sees: chunk_size + max_concurrent
    cpu_threads: int | None = None  # kt-kernel worker threads (cpu_infer); None = the default
    # the method a rule asks for -> the method that serves (engines/kt/experts/methods.py: choose_method)
    methods: Mapping[str, str] = field(default_factory=dict)
    checkpoint: str | None = None  # the model directory (expert LoRA re-reads base experts from it)
    # the host buffers the model's CPU-expert layers take turns with (one model: one instance)
    staging: SharedStaging = field(default_factory=SharedStaging, compare=False, repr=False)
    # the state decode steps pass deferred experts between layers in (engines/kt/experts/deferral.py)
    deferral: ExpertDeferral = field(default_factory=ExpertDeferral, compare=False, repr=False)
    # expert calls of at least this many tokens on a GPU compute part of the experts there, their weights
    # streamed by the model's streamers (engines/kt/experts/streaming.py); 0: off
    gpu_prefill_tokens: int = 0
    # how many of each layer's experts (the first ones) keep those copies (kt_gpu_prefill_memory); None: all
    gpu_prefill_experts: int | None = None
    # expert calls of at least this many tokens are padded up to kt-kernel's matrix path (experts/cpu.py:
    # matrix_tokens); None: the method's measured default, 0: never
    expert_pad_from: int | None = None
    streamers: ExpertStreamers = field(default_factory=ExpertStreamers, compare=False, repr=False)
    # how many of each layer's experts the GPU reads from host memory (kt_gpu_read_experts, experts/mapped.py);
    # None: the balance of the two readers; 0: none (operators built outside the engine, unless they ask)
    gpu_read_experts: int | None = 0
    # how many of each layer's experts (the first ones) the GPU keeps in its own memory (kt_gpu_resident_experts)
    gpu_resident_experts: int = 0
    # which CPU-expert layers' decode calls our own kernel computes (kt_decode_kernel; experts/decode_calls.py), shared
    # by the model's layers; None: kt-kernel computes every call (operators built outside the engine)
    decode_kernel: DecodeKernelPolicy | None = field(default=None, compare=False, repr=False)

    # what a rule naming no method asks for (expert_methods.default_method: FP8 for FP8 checkpoints)
    default_method: str = DEFAULT_METHOD

    def method_for(self, requested: str | None) -> str:
        wanted = normalize_method(requested or self.default_method, "method")
        return self.methods.get(wanted, wanted)


class MoEWithCPUExperts(nn.Module):
    """Router and shared experts where the rule says, routed experts on the CPU, overlapped."""

    KWARGS = RoutedExpertsCPU.KWARGS

    def __init__(self, gate: nn.Module, shared_experts: nn.Module | None, experts: RoutedExperts):
        super().__init__()
        self.gate = gate
        self.shared_experts = shared_experts
        self.experts = experts

    @classmethod
    def from_module(cls, module: nn.Module, name: str, config: Any, options: OperatorOptions, device: str = "cpu",
                    method: str | None = None, gpu_experts: Any = None, threads: int | None = None,
                    n_deferred_experts: Any = 0, **_: Any) -> "MoEWithCPUExperts":
        experts = RoutedExpertsCPU.from_module(module.experts, f"{name}.experts", config, options, device=device,
                                               method=method, gpu_experts=gpu_experts, threads=threads,
                                               n_deferred_experts=n_deferred_experts)
        return cls(module.gate, getattr(module, "shared_experts", None), experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, topk_weights, topk_ids = self.gate(x)
        self.experts.submit(x, topk_ids, topk_weights)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        routed = self.experts.wait().to(x.dtype)
        return routed if shared is None else routed + shared


class FusedRMSNorm(nn.Module):
    """RMSNorm as one fused kernel (torch's `rms_norm`) where transformers' version launches eight element-wise
    ones. A decode step runs three norms per layer, and at small batch their launches, not their arithmetic,
    are the cost: on the GPU machine they were 24 of the ~72 kernels of a V2-Lite layer. The sum of squares
    accumulates in float32 as in transformers; the result is rounded to the input's dtype once, after the
    scale, where transformers rounds before it as well (a difference within one unit of the last place).
    `upcast`: the norm scales in float32 by its float32 weight and rounds once at the end, as DeepSeek-V4's norms
    do (`DeepseekV4RMSNorm`): the input goes to float32 first and the result back (three kernels in all, against
    transformers' eight, with the same arithmetic)."""

    def __init__(self, weight: nn.Parameter, eps: float, upcast: bool = False):
        super().__init__()
        self.weight = weight
        self.eps = eps
        self.upcast = upcast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.upcast:
            return torch.nn.functional.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)
        return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight.to(x.dtype), self.eps)


def fuse_rms_norms(model: nn.Module, upcast: bool = False) -> int:
    """Swap every transformers RMSNorm whose weight is on a GPU for `FusedRMSNorm` (with `upcast`: for models whose
    norms scale in float32, as DeepSeek-V4's); how many were swapped. Norms on the CPU keep transformers' code
    (there a fused kernel saves nothing worth a rounding change)."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if (type(module).__name__.endswith("RMSNorm") and not isinstance(module, FusedRMSNorm)
                and getattr(module, "weight", None) is not None and module.weight.is_cuda):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
            setattr(parent, child, FusedRMSNorm(module.weight, eps, upcast=upcast))
            swapped += 1
    return swapped


def uses_cpu_experts(model: nn.Module) -> bool:
    """Whether any of the model's routed experts run on the CPU (our operators)."""
    return any(isinstance(m, (RoutedExperts, MoEWithCPUExperts)) for m in model.modules())
