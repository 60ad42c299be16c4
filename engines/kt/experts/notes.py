"""Where a model's routed experts run, for every family of the KT engine (DeepSeek V2/V3/V3.2 and V4), and what the
start-up log and model info say of it: whether prompt chunks stream the experts to the GPU (`streamed_prefill`:
kt_gpu_prefill_tokens, by default wherever the host holds the copies, and how many of each layer's experts
kt_gpu_prefill_memory holds), the experts the GPU reads in decode steps (kt_gpu_read_experts,
kt_gpu_resident_experts)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from engines.base import DEFAULT_CHUNK_SIZE
from engines.kt.experts.cpu import RoutedExpertsCPU
from engines.kt.experts.mapped import MAX_TOKENS as MAPPED_MAX_TOKENS
from engines.kt.experts.mapped import copies_as_precise, triton_available
from engines.kt.experts.methods import METHODS, memory_available
from engines.kt.experts.host_copies import copy_bits, expert_copy_bytes, experts_within
from engines.kt.experts.streaming import ExpertStreamer
from engines.kt.options import KTOptions
from engines.kt.placement.operators import OperatorOptions

log = logging.getLogger("ktserve.engine.kt")

# The prefill chunk where prompt chunks stream the routed experts to the GPU (elsewhere DEFAULT_CHUNK_SIZE): a chunk
# copies every streamed expert once, whatever its length,
# so longer chunks amortize the copy (V2-Lite on an H100 machine, 2026-11-25: an 8,192-token prompt took 0.46 s in
# one chunk, 1.33 s in chunks of 2,048; docs/performance.md, "Streamed experts")
STREAMED_CHUNK_SIZE = 8192
# kt_gpu_prefill_tokens by default, where the copies fit: prompt chunks (and decode steps) of this many tokens or more
# stream; smaller calls keep the decode path (the GPU's mapped reads cover calls of up to MAPPED_MAX_TOKENS)
AUTO_PREFILL_TOKENS = MAPPED_MAX_TOKENS
# By default prompts stream only where kt-kernel's form of every routed expert and the GPU's copy of each together
# take at most this share of the host memory available when the model loads: the copies are pinned (never swapped),
# and the rest is left for the load's own peaks, the page cache and the server.
AUTO_HOST_SHARE = 0.6


@dataclass(frozen=True, slots=True)
class StreamedPrefill:
    """Whether prompt chunks stream the routed experts to the GPU, as the family loads its layers with it."""

    tokens: int  # calls of at least this many tokens stream (kt_gpu_prefill_tokens); 0: none
    experts: int | None  # how many of each layer's experts (the first ones) keep copies; None: all
    chunk_size: int  # the prefill chunk the engine runs with (chunk_size, or its default for this choice)
    why: str = ""  # where the default left it off, why (the start-up log and the engine details say it)

    def off_detail(self) -> str:
        """The engine detail gpu_prefill_tokens where no prompt chunk streams, with the reason."""
        why = self.why or ("no CPU-expert layer sends its output to a GPU" if self.tokens
                           else "kt_gpu_prefill_tokens=0")
        return f"0: every routed expert of a prompt on the CPU ({why})"


def streamed_prefill(kt: KTOptions, model: Any, config: Any, methods: set[str | None], gpu: bool,
                     chunk_size: int | None) -> StreamedPrefill:
    """Resolve kt_gpu_prefill_tokens (None: on where the host holds the copies, `auto_prefill_tokens`), how many
    experts keep copies (kt_gpu_prefill_memory) and chunk_size (None: STREAMED_CHUNK_SIZE where prompts stream, else
    DEFAULT_CHUNK_SIZE) for a model whose expert layers run `methods` (None: torch) and whose output lies on a GPU
    where `gpu`."""
    methods = {m for m in methods if m}
    mxfp4 = bool(methods) and all(METHODS[m].weights == "mxfp4" for m in methods)
    bits = max((copy_bits(METHODS[m].bits) for m in methods), default=8)
    tokens, why = kt.kt_gpu_prefill_tokens, ""
    if tokens is None:
        tokens, why = auto_prefill_tokens(kt, model, config, methods, gpu, bits, mxfp4)
    experts = streamed_expert_count(kt, model, config, bits, mxfp4, tokens)
    if tokens and experts == 0:
        why = "kt_gpu_prefill_memory holds no expert's copy"
    streams = bool(tokens) and experts != 0
    if chunk_size is None:
        chunk_size = STREAMED_CHUNK_SIZE if streams and gpu else DEFAULT_CHUNK_SIZE
    return StreamedPrefill(tokens if streams else 0, experts, chunk_size, why)


def auto_prefill_tokens(kt: KTOptions, model: Any, config: Any, methods: set[str], gpu: bool, bits: int,
                        mxfp4: bool) -> tuple[int, str]:
    """kt_gpu_prefill_tokens' default: AUTO_PREFILL_TOKENS where the expert layers' output lies on a GPU, the GPU's
    copies are as precise as kt-kernel's form (not for 16-bit methods, RAWINT4 or LLAMAFILE), the settings hand no
    experts to the GPU to own (kt_gpu_read_experts=N, kt_gpu_resident_experts=N: one copy of each expert, which
    streaming's duplicates would replace), and kt-kernel's experts with a copy of each fit in AUTO_HOST_SHARE of the
    host's available memory (a kt_gpu_prefill_memory budget counts instead of every copy); else 0 and why."""
    if not gpu or not torch.cuda.is_available():
        return 0, "no GPU in the placement"
    if not methods:
        return 0, "no routed experts on the CPU"
    coarser = sorted(m for m in methods if not copies_as_precise(m))
    if coarser:
        return 0, (f"the GPU's copies of {'/'.join(coarser)} experts would not be as precise as kt-kernel's form "
                   "(kt_gpu_prefill_tokens=N streams anyway)")
    if kt.kt_gpu_resident_experts or kt.kt_gpu_read_experts:
        asked = "kt_gpu_resident_experts" if kt.kt_gpu_resident_experts else "kt_gpu_read_experts"
        return 0, (f"{asked} hands the GPU experts of its own, kept once (kt_gpu_prefill_tokens=N streams duplicate "
                   "copies instead)")
    layers = _expert_layers(model)
    num_experts = getattr(config, "n_routed_experts", None) or config.num_experts
    H, I = config.hidden_size, config.moe_intermediate_size
    kernel = layers * num_experts * 3 * H * I * max(METHODS[m].bits for m in methods) // 8
    copies = layers * num_experts * expert_copy_bytes(H, I, bits, mxfp4)
    if kt.kt_gpu_prefill_memory is not None:
        copies = min(copies, int(kt.kt_gpu_prefill_memory * 1e9))
    available = memory_available()
    if available is None or kernel + copies > AUTO_HOST_SHARE * available:
        have = "unknown" if available is None else f"{available / 1e9:.1f} GB"
        return 0, (f"the experts ({kernel / 1e9:.1f} GB) and their copies ({copies / 1e9:.1f} GB) would take more "
                   f"than {AUTO_HOST_SHARE:.0%} of the host memory available ({have}); kt_gpu_prefill_tokens=N "
                   "streams anyway, kt_gpu_prefill_memory=GB a share of them")
    return AUTO_PREFILL_TOKENS, ""


def _expert_layers(model: Any) -> int:
    return sum(1 for name, _ in model.named_modules() if name.endswith(".mlp.experts"))


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
        why = ("by default the GPU takes experts of int8, int4 and MXFP4 methods only (kt_gpu_read_experts=N asks "
               "anyway)")
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


def log_streamed_experts(options: OperatorOptions, prefill: StreamedPrefill) -> None:
    """Say whether prompt chunks stream the routed experts to the GPU on this placement, and from what (they need
    expert layers whose output is on a GPU), or why the default left them on the CPU."""
    tokens, chunk_size = prefill.tokens, prefill.chunk_size
    if not tokens:
        if prefill.why:
            log.info("prompt chunks compute their routed experts on the CPU (kt_gpu_prefill_tokens=0): %s", prefill.why)
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


def streaming_details(options: OperatorOptions, prefill: StreamedPrefill) -> dict[str, str]:
    """Say in the start-up log (`log_streamed_experts`) and return for the engine details whether prompt chunks
    stream the routed experts to the GPU: `gpu_prefill_tokens` (the threshold, or "0: ..." with why not), and
    where they stream `gpu_prefill_experts` (each layer's experts with copies, the fewest of any layer),
    `gpu_prefill_copies` (what the copies are and how much is pinned) and `gpu_prefill_copy_gbps` (the measured
    copy rate) — the same keys for every family."""
    log_streamed_experts(options, prefill)
    streaming = options.streamers.active()
    if not prefill.tokens or not streaming:
        return {"gpu_prefill_tokens": prefill.off_detail()}
    pinned = sum(h.nbytes for s in streaming for h in s.layers.values())
    return {"gpu_prefill_tokens": str(prefill.tokens),
            "gpu_prefill_experts": str(min(h.held for s in streaming for h in s.layers.values())),
            "gpu_prefill_copies": (f"{' and '.join(sorted({streamed_from(s) for s in streaming}))}, "
                                   f"{pinned / 1e9:.2f} GB pinned"),
            "gpu_prefill_copy_gbps": f"{min(s.pcie_bytes_per_s for s in streaming) / 1e9:.1f}"}


def streamed_expert_count(kt: KTOptions, model: Any, config: Any, bits: int = 8, mxfp4: bool = False,
                          tokens: int = 0) -> int | None:
    """How many of each layer's experts keep streamed copies (`bits`-bit ones, or MXFP4 as released with `mxfp4`)
    where calls of `tokens` stream: as many as kt_gpu_prefill_memory holds over the model's expert layers (0: none,
    streaming off, said why), None: every expert (no budget)."""
    if kt.kt_gpu_prefill_memory is None:
        return None
    if not tokens:
        log.warning("kt_gpu_prefill_memory=%g GB does nothing while prompt chunks do not stream "
                    "(kt_gpu_prefill_tokens)", kt.kt_gpu_prefill_memory)
        return None
    layers = _expert_layers(model)
    num_experts = getattr(config, "n_routed_experts", None) or config.num_experts
    count = experts_within(kt.kt_gpu_prefill_memory * 1e9, layers, num_experts, config.hidden_size,
                           config.moe_intermediate_size, bits, mxfp4)
    if count == 0:
        log.warning("kt_gpu_prefill_memory=%g GB holds no expert's copy for each of %d layers (one takes %.1f MB a "
                    "layer): every expert stays on the CPU", kt.kt_gpu_prefill_memory, layers,
                    expert_copy_bytes(config.hidden_size, config.moe_intermediate_size, bits, mxfp4) / 1e6)
    return count
