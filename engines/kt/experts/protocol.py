"""What the KT engine asks of one MoE layer's routed experts, wherever they run.

`RoutedExpertsCPU` (experts/cpu.py: kt-kernel on the CPU, hot experts in torch on the GPU) implements it;
which kt-kernel class serves a method is decided in one place, experts/methods.py. The loader fills a layer
through `load_stored` / `load_quantized` / `load_converted`; `MoEWithCPUExperts` (placement/operators.py) drives it with
`submit` and then `wait`, so the shared experts run on the GPU in between; the runner's step timer reads
`host_times` and `events` (step_timing.py), and expert deferral links the layers through `deferred` / `defer_into`
(experts/deferral.py). Expert LoRA reaches a layer through the narrower `engines.lora.cpu_experts.CPUExperts`,
so LoRA code never imports this engine."""
from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

import torch

from engines.kt.experts.deferral import ExpertDeferral


@runtime_checkable
class RoutedExperts(Protocol):
    layer_idx: int
    num_experts: int
    top_k: int
    method: str  # the experts method that serves (engines/kt/experts/methods.py)
    gpu_experts: list[int]  # experts computed on the GPU (hot experts); the rest on the CPU
    out_device: torch.device | None  # where results go (None: the input's device)
    deferred: int  # experts per token a decode step leaves running into the next layer (n_deferred_experts)
    defer_into: int | None  # the layer that takes them, set by expert_deferral.link; None: this layer does not defer
    deferral: ExpertDeferral  # the decode-step state a model's layers share (OperatorOptions.deferral)
    streamer: Any  # expert_streaming.ExpertStreamer its calls of stream_tokens or more stream through, or None
    stream_tokens: int  # the fewest tokens of a call that streams (kt_gpu_prefill_tokens); with no streamer unused
    host_times: Any  # step_timing.HostTimes: blocking waits, timed on the host
    events: Any  # step_timing.ExpertEvents once the runner times stream-ordered calls, else None

    def load_weights(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                     cache_dir: str | os.PathLike | None = None) -> None:
        """The layer's experts as the checkpoint has them: gate/up [E, I, H], down [E, H, I]. With `cache_dir`,
        whatever the layer converted them to is saved there for `load_quantized`."""

    def load_quantized(self, cache_dir: str | os.PathLike) -> bool:
        """Load what `load_weights(..., cache_dir=...)` saved; False when there is nothing usable."""

    def load_stored(self, experts: Any, *, cache_dir: str | os.PathLike | None = None) -> str:
        """The layer's experts in the checkpoint's stored form (engines/checkpoints/source.py: StoredExperts, or a
        GGUF's ggml blocks), taken as they are where the kernel reads that form, else converted; returns how they
        are held."""

    def load_converted(self, converted: Any) -> bool:
        """Read the layer from kt-kernel's pre-converted experts (expert_cache.ConvertedExperts, kt_weight_path);
        False when they lack this layer."""

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Start sum_k topk_weights[:, k] * expert_{topk_ids[:, k]}(hidden) and return (-1 ids contribute 0)."""

    def wait(self) -> torch.Tensor:
        """The result `submit` started, [T, H] on the layer's output device."""

    def abandon(self) -> None:
        """After a failed step: wait for a call `submit` started and `wait` never took, and drop its result, so
        the next step starts clean. Nothing to do when none is pending."""
