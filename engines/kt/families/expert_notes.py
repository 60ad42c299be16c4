"""What the KT engine's start-up log and model info say about where a model's routed experts run, for every family
(DeepSeek V2/V3/V3.2 and V4): the GPU's streamed copies (kt_gpu_prefill_tokens, and how many of each layer's
experts kt_gpu_prefill_memory holds), the experts it reads (kt_gpu_read_experts, kt_gpu_resident_experts)."""
from __future__ import annotations

import logging
from typing import Any

import torch

from engines.kt.experts.cpu import RoutedExpertsCPU
from engines.kt.experts.mapped import MAX_TOKENS as MAPPED_MAX_TOKENS
from engines.kt.experts.mapped import triton_available
from engines.kt.experts.methods import METHODS
from engines.kt.experts.streaming import ExpertStreamer, expert_copy_bytes, experts_within
from engines.kt.options import KTOptions
from engines.kt.placement.operators import OperatorOptions

log = logging.getLogger("ktserve.engine.kt")


def log_read_experts(model: torch.nn.Module, setting: int | None, resident_setting: int = 0) -> tuple[int, int]:
    """Say how many of each expert layer's experts the GPU computes in decode steps, where they lie, and why none
    where it computes none (kt_gpu_read_experts, kt_gpu_resident_experts); the fewest of any layer, and of those
    the fewest in GPU memory."""
    layers = [m for m in model.modules() if isinstance(m, RoutedExpertsCPU)]
    on_gpu = [m for m in layers if m.gpu_device.type == "cuda"]
    shares = [m.mapped_experts(1) for m in on_gpu if m.streamer is not None]
    if not on_gpu:
        if resident_setting:
            log.warning("kt_gpu_resident_experts=%d: no CPU-expert layer sends its output to a GPU here, so every "
                        "expert stays with kt-kernel", resident_setting)
        return 0, 0
    resident = min(m.resident for m in on_gpu)
    if shares and max(shares) > 0:
        owned = sorted({m.owned for m in on_gpu})
        forms = "/".join(sorted({m.streamer.layers[m.layer_idx].form for m in on_gpu
                                 if m.streamer is not None and m.layer_idx in m.streamer.layers}))
        how = (f"they live only as {forms} copies, kt-kernel holds the others" if owned != [0]
               else f"from the streamed {forms} copies (kt_gpu_prefill_tokens)")
        where = "them straight from host memory"
        if resident:
            size = _resident_bytes(on_gpu)
            size_text = f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.0f} MB"
            where = f"experts [0, {resident}) from GPU memory ({size_text}, kt_gpu_resident_experts)"
            if min(shares) > resident:
                where += ", the others straight from host memory"
        log.info("decode steps of up to %d sequences: the GPU computes experts [0, %s) of each MoE layer reading %s "
                 "while kt-kernel computes the rest; %s (kt_gpu_read_experts)",
                 MAPPED_MAX_TOKENS, "/".join(map(str, sorted(set(shares)))), where, how)
        if resident_setting and not resident:
            log.warning("kt_gpu_resident_experts=%d: none kept in GPU memory beside duplicate copies "
                        "(kt_gpu_prefill_tokens)", resident_setting)
        coarser = sorted({m.method for m in on_gpu if m.owned and METHODS[m.method].bits > 8})
        if coarser:
            log.info("the experts the GPU owns are int8 copies, coarser than the %s weights kt-kernel computes the "
                     "others from", "/".join(coarser))
        return min(shares), resident
    if setting == 0 and not resident_setting:
        why = "kt_gpu_read_experts=0"
    elif not triton_available():
        why = "Triton is not installed"
    elif setting is None and not resident_setting:
        why = "by default the GPU takes experts of int8 and int4 methods only (kt_gpu_read_experts=N asks anyway)"
    else:
        why = "the layers keep hot experts, defer experts, or run RAWINT4 or LLAMAFILE"
    (log.warning if resident_setting else log.info)("decode steps compute every routed expert with kt-kernel: %s", why)
    return 0, 0


def decode_reads(model: torch.nn.Module, kt: KTOptions, options: OperatorOptions) -> dict[str, str]:
    """Compile the kernels that read the GPU side's copies in decode steps (engines/kt/experts/mapped.py) before a
    request or a CUDA graph capture waits for them, say how many of each layer's experts the GPU computes and where
    they lie, and return that for the engine details (kt_gpu_read_experts, kt_gpu_resident_experts)."""
    options.streamers.warm_up_reads()
    read, resident = log_read_experts(model, kt.kt_gpu_read_experts, kt.kt_gpu_resident_experts)
    return {"gpu_read_experts": str(read), "gpu_resident_experts": str(resident)}


def _resident_bytes(layers: list[RoutedExpertsCPU]) -> int:
    """GPU memory the layers' resident experts take (kt_gpu_resident_experts)."""
    return sum(m.streamer.resident[m.layer_idx].nbytes for m in layers
               if m.streamer is not None and m.layer_idx in m.streamer.resident)


def streamed_from(streamer: ExpertStreamer) -> str:
    """What a streamer's layers stream from: "int8 copies", "int4 copies", "mxfp4 copies" (V4's released bytes)."""
    return "/".join(sorted({h.form for h in streamer.layers.values()})) + " copies"


def log_streamed_experts(options: OperatorOptions, tokens: int, chunk_size: int) -> None:
    """Say what kt_gpu_prefill_tokens does on this placement (it needs expert layers whose output is on a GPU)."""
    if not tokens:
        return
    streamers = options.streamers.active()
    if not streamers:
        log.warning("kt_gpu_prefill_tokens=%d: no CPU-expert layer sends its output to a GPU here, so every "
                    "prompt chunk and decode step computes its experts on the CPU", tokens)
        return
    for s in streamers:
        pinned = sum(h.nbytes for h in s.layers.values())
        held = sorted({h.held for h in s.layers.values()})
        what = streamed_from(s)
        log.info("prompt chunks of >= %d tokens and decode steps of >= %d sequences compute part of the routed "
                 "experts of %d layers on %s (at most the first %s of each layer's, whose copies are kept), streamed "
                 "at %.1f GB/s from %.1f GB of pinned %s; a long chunk copies them all, %.2f s, once per "
                 "chunk of up to chunk_size=%d tokens (larger chunks amortize it: docs/performance.md)", tokens,
                 tokens, len(s.layers), s.device, "/".join(map(str, held)), s.pcie_bytes_per_s / 1e9, pinned / 1e9,
                 what, pinned / s.pcie_bytes_per_s, chunk_size)


def streamed_expert_count(kt: KTOptions, model: Any, config: Any, bits: int = 8, mxfp4: bool = False) -> int | None:
    """How many of each layer's experts keep streamed copies (`bits`-bit ones, or MXFP4 as released with `mxfp4`):
    as many as kt_gpu_prefill_memory holds over the model's expert layers (0: none, streaming off, said why), None:
    every expert (no budget)."""
    if kt.kt_gpu_prefill_memory is None:
        return None
    if not kt.kt_gpu_prefill_tokens:
        log.warning("kt_gpu_prefill_memory=%g GB does nothing without kt_gpu_prefill_tokens", kt.kt_gpu_prefill_memory)
        return None
    layers = sum(1 for name, _ in model.named_modules() if name.endswith(".mlp.experts"))
    num_experts = getattr(config, "n_routed_experts", None) or config.num_experts
    count = experts_within(kt.kt_gpu_prefill_memory * 1e9, layers, num_experts, config.hidden_size,
                           config.moe_intermediate_size, bits, mxfp4)
    if count == 0:
        log.warning("kt_gpu_prefill_memory=%g GB holds no expert's copy for each of %d layers (one takes %.1f MB a "
                    "layer): every expert stays on the CPU", kt.kt_gpu_prefill_memory, layers,
                    expert_copy_bytes(config.hidden_size, config.moe_intermediate_size, bits, mxfp4) / 1e6)
    return count
