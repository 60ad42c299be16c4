"""Routed experts of one DeepSeek MoE layer, computed on the CPU by kt-kernel: the `RoutedExpertsCPU` operator.

`RoutedExpertsCPU` holds all routed experts of a layer as one kt-kernel MoE object, in one of the methods
of engines/kt/experts/methods.py (which also says which of them this CPU's kt-kernel build runs), and
computes `sum_k w_k * down(silu(gate(x)) * up(x))` for the experts the router picked. Experts named in
`gpu_experts` ("hot experts") are kept as torch tensors on `gpu_device` and computed there with torch;
kt-kernel skips them. Work is submitted to the process-wide worker pool (engines/kt/experts/cpuinfer.py) so that
`submit()` returns at once and the caller can run GPU work before `sync()`. Rows of adapters with expert
LoRA are handed to `lora` (engines/lora/cpu_experts.py) and computed there. With `n_deferred_experts`, decode
steps leave each token's lowest-weighted experts running into the next layer (engines/kt/experts/deferral.py).
Decode-sized calls of a layer whose output stays on the CPU go to our own kernel instead where `decode_kernel`
(kt_decode_kernel) chose it at load (`decode_calls`; engines/kt/experts/decode_calls.py says when).

As an operator of the placement rules it takes `device` (where its output goes), `method`, `gpu_experts`,
`threads` and `n_deferred_experts`; engine-wide settings arrive explicitly in `OperatorOptions`
(engines/kt/placement/operators.py).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from engines.checkpoints import mxfp4
from engines.kt.experts.cpuinfer import check_thread_count, load_ext, shared_cpu_infer
from engines.kt.experts.cache import LayerCache
from engines.kt.layers import layer_index
from engines.kt.experts.decode_calls import FORMATS as DECODE_FORMATS, DecodeCalls, DecodeKernelPolicy
from engines.kt.experts.deferral import Deferred, ExpertDeferral, check_deferred, split_deferred
from engines.kt.experts.host_copies import HostExperts, copy_bits
from engines.kt.experts.streaming import ExpertStreamer
from engines.kt.experts.mapped import OWNABLE_METHODS, default_read_share, owned_experts, resident_experts
from engines.kt.experts.mapped import MAX_TOKENS as MAPPED_MAX_TOKENS
from engines.kt.experts.methods import (CLAMPING_METHODS, METHODS, ExpertsUnsupportedError, check_llamafile_type,
                                       default_pad_from, kernel_class, llamafile_computes, matrix_tokens,
                                       pads_to_matrix, quantize_fp8_blocks, quantize_int4_groups, reads_in_place,
                                       sft_kernel_class, unavailable_reason)
from engines.kt.step_timing import ExpertEvents, HostTimes

if TYPE_CHECKING:
    from engines.checkpoints.source import ExpertsLayer
    from engines.kt.experts.cache import ConvertedExperts
    from engines.kt.placement.operators import OperatorOptions
    from engines.lora.cpu_experts import CPUExpertsLora

__all__ = ["ExpertsUnsupportedError", "RoutedExpertsCPU"]

log = logging.getLogger(__name__)

# kt-kernel sizes its token buffers in blocks of 32 (M_STEP); INT8/INT4 refuse other sizes and BF16
# segfaults with buffers of 1-2 tokens, so the buffer is always a whole number of blocks.
_TOKEN_BLOCK = 32


def _to_ggml_blocks(weights: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """[E, rows, cols] weights in the ggml layout llamafile reads: BF16, or Q8_0 (per 32 values of a row:
    an fp16 scale then 32 int8, as gguf's own quantizer writes them). Converted one expert at a time to
    bound the float32 temporaries."""
    if ggml_type == "BF16":
        return weights.to(torch.bfloat16).contiguous()
    experts, rows, cols = weights.shape
    out = torch.empty(experts, rows, cols // 32 * 34, dtype=torch.uint8, device="cpu")
    for e in range(experts):
        blocks = weights[e].float().reshape(-1, 32)
        scale = blocks.abs().amax(1, keepdim=True) / 127
        scaled = blocks * torch.where(scale == 0, 0.0, 1 / scale)
        quants = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # half away from zero, as gguf rounds
        packed = torch.cat([scale.half().view(torch.uint8), quants.to(torch.int8).view(torch.uint8)], dim=1)
        out[e] = packed.reshape(rows, -1)
    return out


def _fill_empty_slots(ids: torch.Tensor, weights: torch.Tensor, gpu_mask: torch.Tensor) -> None:
    """Give every -1 slot (in place) a zero weight and an expert its token does not use yet.

    The llamafile kernel does not skip -1 (it gave inf/NaN here) and mixes up a token that names one
    expert twice, so each empty slot gets a distinct absent expert, hot ones first (kt-kernel skips those).
    """
    empty = ids < 0
    if not empty.any():
        return
    tokens, experts = ids.shape[0], gpu_mask.shape[0]
    rows, slots = (~empty).nonzero(as_tuple=True)
    present = torch.zeros(tokens, experts, dtype=torch.bool, device="cpu")
    present[rows, ids[rows, slots]] = True
    preference = (~present).to(torch.int8) * (1 + gpu_mask.to(torch.int8))  # absent hot > absent > present
    candidates = preference.argsort(dim=1, descending=True, stable=True)
    rank = empty.to(torch.int64).cumsum(dim=1) - 1  # the n-th empty slot of a token takes candidate n
    ids[empty] = candidates.gather(1, rank.clamp_min(0))[empty]
    weights[empty] = 0.0


@dataclass(slots=True)
class _Pending:
    """One submitted call: everything kt-kernel reads or writes must stay alive until sync()."""

    tokens: int
    device: torch.device
    dtype: torch.dtype
    staged: tuple[torch.Tensor, ...]  # input, ids, weights, output, chunk sizes
    gpu_part: torch.Tensor | None
    deferred: Deferred | None = None  # this call's deferred experts, still running after sync()


@dataclass(slots=True)
class _DecodePending:
    """A call our decode kernel runs (`decode_calls`): what its workers read and write, the output last."""

    tokens: int
    device: torch.device
    dtype: torch.dtype
    kept: tuple[torch.Tensor, ...]
    deferred: None = None


@dataclass(slots=True)
class _StreamBuffers:
    """Pinned host buffers kt-kernel reads and writes on the stream path, and one pinned token-count cell per
    count (captured CUDA graphs replay these pointers, so a cell never changes)."""

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor
    sizes: dict[int, torch.Tensor]


class SharedStaging:
    """The host buffers every CPU-expert layer of one model stages its tokens in, one set per kind and device.

    A forward runs a model's layers one after another, and a layer's output leaves the buffers (copied out
    in sync(), or by a copy queued on the stream before the next layer's copy in) before the next layer
    writes them, so the layers can share one set instead of holding one each. Per layer they were 0.8 GB of
    pinned memory for V2-Lite's 26 MoE layers at chunk 2048 (torch's pinned allocator rounds each buffer up
    to a power of two). One instance per model (OperatorOptions.staging); two models never share one, since
    their forwards may run at the same time.
    """

    def __init__(self) -> None:
        self._sets: dict[tuple, Any] = {}

    def get(self, key: tuple, fits: Any, build: Any) -> Any:
        """The set stored under `key` if `fits(set)`, else a new one from `build()` (which replaces it)."""
        found = self._sets.get(key)
        if found is None or not fits(found):
            found = self._sets[key] = build()
        return found


@dataclass(slots=True)
class _StreamPending:
    tokens: int
    buffers: _StreamBuffers
    dtype: torch.dtype
    stream: "torch.cuda.Stream"
    gpu_part: torch.Tensor | None
    deferred: Deferred | None = None
    ours: Any = None  # the decode kernel's StreamTask where it computes the call, else kt-kernel's task


@dataclass(slots=True)
class _GPUPending:
    """A call the GPU computed whole from streamed experts: kt-kernel had nothing to do."""

    tokens: int
    out: torch.Tensor
    dtype: torch.dtype
    deferred: None = None


def _copy_as_packed(host: HostExperts, intermediate: int) -> dict[str, torch.Tensor]:
    """A layer's MXFP4 copies (gate and up side by side, HostExperts.mxfp4_of) as the released tensors' names:
    views, one contiguous block per expert."""
    I = intermediate
    return {"gate": host.gate_up[:, :I], "up": host.gate_up[:, I:], "down": host.down,
            "gate_scale": host.gate_up_scale[:, :I], "up_scale": host.gate_up_scale[:, I:],
            "down_scale": host.down_scale}


def _quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    packed, exponents = mxfp4.quantize(weight)
    return packed, mxfp4.scales_as_bf16(exponents)


def _check_config(method: str, *, threads: int | None, activation: str, llamafile_type: str,
                  **sizes: int) -> None:
    """ValueError (ExpertsUnsupportedError for the method) naming whatever the arguments get wrong."""
    for name, value in sizes.items():
        least = 0 if name in ("layer_idx", "pad_from") else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if sizes["top_k"] > sizes["num_experts"]:
        raise ValueError(f"top_k ({sizes['top_k']}) cannot exceed num_experts ({sizes['num_experts']})")
    if activation != "silu":
        raise ValueError(f"activation {activation!r} is not supported; kt-kernel experts use 'silu'")
    reason = unavailable_reason(method)
    if reason is not None:
        from engines.kt.experts.methods import available_methods

        raise ExpertsUnsupportedError(f"experts method {method!r} is not supported here: {reason}; this CPU and "
                                      f"kt-kernel build support: {', '.join(available_methods()) or 'none'}")
    multiple = METHODS[method].size_multiple
    for name in ("hidden_size", "intermediate_size"):
        if sizes[name] % multiple:
            raise ValueError(f"{name}={sizes[name]} is not a multiple of {multiple}, which kt-kernel's {method} "
                             f"kernel needs")
    if method == "LLAMAFILE":
        check_llamafile_type(llamafile_type)
    if threads is not None:
        check_thread_count(threads)


class RoutedExpertsCPU(nn.Module):
    """All routed experts of one MoE layer, on the CPU through kt-kernel (hot experts optionally in torch).

    Not safe for concurrent calls on one instance; any single thread may call it. `sync()` waits for
    every task in the shared pool (other layers' too) and holds the GIL while it waits.
    """

    KWARGS = frozenset({"device", "method", "gpu_experts", "threads", "n_deferred_experts"})

    def __init__(self, *, layer_idx: int, num_experts: int, top_k: int, hidden_size: int,
                 intermediate_size: int, method: str = "BF16", threads: int | None = None,
                 max_tokens: int = 512, gpu_experts: list[int] | None = None, gpu_device: str = "cpu",
                 activation: str = "silu", llamafile_type: str = "Q8_0", out_device: str | None = None,
                 checkpoint: str | None = None, staging: SharedStaging | None = None, deferred: Any = 0,
                 deferral: ExpertDeferral | None = None, streamer: ExpertStreamer | None = None,
                 stream_tokens: int = 0, stream_experts: int | None = None, pad_from: int | None = None,
                 owned_experts: int = 0, read_experts: int | None = 0, resident_experts: int = 0,
                 swiglu_limit: float = 0.0, decode_kernel: DecodeKernelPolicy | None = None):
        super().__init__()
        method = str(method).upper()
        _check_config(method, layer_idx=layer_idx, num_experts=num_experts, top_k=top_k, hidden_size=hidden_size,
                      intermediate_size=intermediate_size, max_tokens=max_tokens, activation=activation,
                      threads=threads, llamafile_type=llamafile_type,
                      **({} if pad_from is None else {"pad_from": pad_from}))
        self.layer_idx, self.num_experts, self.top_k = layer_idx, num_experts, top_k
        if swiglu_limit and method not in CLAMPING_METHODS:
            raise ExpertsUnsupportedError(
                f"experts method {method}: these experts clamp their SwiGLU inputs (swiglu_limit={swiglu_limit}), "
                f"which kt-kernel computes only with {', '.join(sorted(CLAMPING_METHODS))}")
        # gate and up are clamped to [-limit, limit] (gate above only) before the activation; 0: not clamped
        self.swiglu_limit = float(swiglu_limit)
        self.hidden_size, self.intermediate_size, self.method = hidden_size, intermediate_size, method
        self.threads, self.max_tokens, self.llamafile_type = threads, max_tokens, llamafile_type
        self._ggml_types = (llamafile_type,) * 3  # gate, up, down blocks as kt-kernel reads them (LLAMAFILE)
        self.chunk_tokens = -(-max_tokens // _TOKEN_BLOCK) * _TOKEN_BLOCK
        self.gpu_experts = self._check_gpu_experts(gpu_experts)
        self.gpu_device = torch.device(gpu_device)
        self.out_device = torch.device(out_device) if out_device is not None else None
        self.checkpoint = checkpoint  # where expert LoRA re-reads this layer's base experts from
        # a family whose checkpoint names its experts its own way sets how to re-read them (read_base_weights)
        self.base_reader: Callable[[int | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        # and, where its experts are stored in the method's own form (V4's MXFP4), how to re-read them so
        # (`load_packed`'s terms), which kt-kernel's MXFP4 SFT kernel takes (sft_base_weights)
        self.packed_reader: Callable[[], dict[str, torch.Tensor]] | None = None
        self.deferred = check_deferred(deferred, top_k)  # experts per token a decode step runs one layer late
        self.defer_into: int | None = None  # the layer that takes them (expert_deferral.link); None: no deferral
        self.deferral = deferral if deferral is not None else ExpertDeferral()  # shared by the model's layers
        self._deferred_in: torch.Tensor | None = None  # the predecessor's deferred output, on the stream path
        # calls of at least `stream_tokens` tokens (prompt chunks, eager decode steps) hand part of the experts
        # to the GPU (engines/kt/experts/streaming.py); None: all on the CPU
        self.streamer = streamer if stream_tokens > 0 and stream_experts != 0 else None
        self.stream_tokens = stream_tokens
        # the experts (the first ones) the GPU side keeps copies of, hence may take (kt_gpu_prefill_memory)
        self.stream_experts = num_experts if stream_experts is None else min(stream_experts, num_experts)
        # experts [0, owned) live only as those copies, computed on the GPU in every call; kt-kernel holds the
        # others (as its experts 0..kernel_experts-1) and never sees these (kt_gpu_read_experts)
        self.owned = self._check_owned(owned_experts)
        # of those, [0, resident) lie in the GPU's memory instead of pinned host memory (kt_gpu_resident_experts)
        if not 0 <= resident_experts <= self.owned:
            raise ValueError(f"resident_experts of layer {layer_idx} must lie in 0..{self.owned} (the experts the "
                             f"GPU owns), got {resident_experts}")
        self.resident = resident_experts
        self.copy_bits = copy_bits(METHODS[method].bits)  # of the GPU side's copies: int4 for 4-bit methods
        self.kernel_experts = num_experts - self.owned
        if self.owned:
            self.stream_experts = self.owned
        # decode calls' share of those where they are extra copies (mapped_experts): as asked (kt_gpu_read_experts;
        # 0: none), None: the method's default (default_read_share)
        self._mapped_share = (min(read_experts, self.stream_experts) if read_experts is not None
                              else default_read_share(method, num_experts, self.stream_experts, hidden_size,
                                                      intermediate_size))
        self._share_is_default = read_experts is None
        # whether decode calls read this layer's copies on the GPU where they lie, host or GPU memory (mapped_experts)
        self._read_in_place = bool(self.owned or self._mapped_share)
        # calls of `pad_from` tokens or more that kt-kernel would compute on its per-token vector path are padded
        # with expert-less rows up to its matrix path (experts/methods.py: `matrix_tokens`); 0: never; None: the
        # method's measured default
        self.pad_from = default_pad_from(method, self.kernel_experts, top_k) if pad_from is None else pad_from
        # the rows a padded call is handed; 0 where this build's kernel has no matrix switch to pad across
        self._matrix_rows = matrix_tokens(self.kernel_experts, top_k) if pads_to_matrix(method) else 0
        self._no_experts: dict[torch.device, torch.Tensor] = {}  # -1 rows that pad a call, per device
        # whether decode-sized calls go to our kernel (kt_decode_kernel), decided at each load; None: all kt-kernel's
        self.decode_kernel = decode_kernel
        self.decode_calls: DecodeCalls | None = None
        # the decode kernel's stream tasks, one per buffer set and row count (captured graphs replay them)
        self._decode_tasks: dict[tuple[int, int], tuple[_StreamBuffers, Any]] = {}
        self.lora: CPUExpertsLora | None = None  # set while an adapter with expert LoRA on this layer is in
        # where a step's time goes (engines/kt/step_timing.py): blocking calls are timed on the host, and
        # stream-ordered ones with CUDA events once the runner sets `events`
        self.host_times = HostTimes()
        self.events: ExpertEvents | None = None
        # kt-kernel reads this mask (1 byte per expert) on every forward to skip the hot experts.
        self._gpu_mask = torch.zeros(self.kernel_experts, dtype=torch.bool, device="cpu")
        self._gpu_mask[self.gpu_experts] = True
        self._masks: dict[torch.device, torch.Tensor] = {}  # _gpu_mask per device topk_ids arrive on
        self._gpu_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._kernel_weights: tuple[torch.Tensor, ...] = ()  # tensors kt-kernel reads in place: kept alive
        self._kernel = None
        self._pool = None
        self._staging = staging if staging is not None else SharedStaging()  # host buffers, shared per model
        self._out_device: torch.Tensor | None = None  # where the stream path copies the output back to
        self._pending: _Pending | None = None
        self._lora_step: Any = None
        self._lock = threading.Lock()

    @classmethod
    def from_module(cls, module: nn.Module, name: str, config: Any, options: "OperatorOptions",
                    device: str = "cpu", method: str | None = None, gpu_experts: Any = None,
                    threads: int | None = None, n_deferred_experts: Any = 0, **_: Any) -> "RoutedExpertsCPU":
        """The operator for transformers' routed experts at `name`; output goes to `device`."""
        if isinstance(gpu_experts, int):
            gpu_experts = list(range(gpu_experts)) if gpu_experts > 0 else None
        num_experts = getattr(config, "n_routed_experts", None) or config.num_experts
        method, on_gpu = options.method_for(method), torch.device(device).type == "cuda"
        # the experts the GPU owns (kt_gpu_read_experts): only beside a plain CPU-expert layer whose output is
        # on a GPU, and not while duplicate copies stream (kt_gpu_prefill_tokens)
        owned, resident, deferred = 0, 0, check_deferred(n_deferred_experts, config.num_experts_per_tok)
        if on_gpu and (options.gpu_read_experts != 0 or options.gpu_resident_experts) \
                and not options.gpu_prefill_tokens and not gpu_experts and not deferred:
            # the first experts in GPU memory (kt_gpu_resident_experts), the next ones read from host memory
            resident = resident_experts(options.gpu_resident_experts, method, num_experts,
                                        config.num_experts_per_tok)
            owned = resident + (owned_experts(options.gpu_read_experts, method, METHODS[method].bits,
                                              num_experts - resident, config.num_experts_per_tok)
                                if options.gpu_read_experts != 0 else 0)
        streams = on_gpu and (options.gpu_prefill_tokens or owned)
        return cls(layer_idx=layer_index(name), num_experts=num_experts, top_k=config.num_experts_per_tok,
                   hidden_size=config.hidden_size, intermediate_size=config.moe_intermediate_size, method=method,
                   threads=options.cpu_threads or threads, max_tokens=options.max_tokens,
                   gpu_experts=gpu_experts or None, gpu_device=device, out_device=device,
                   checkpoint=options.checkpoint, staging=options.staging, deferred=n_deferred_experts,
                   deferral=options.deferral, stream_tokens=options.gpu_prefill_tokens or
                   (MAPPED_MAX_TOKENS + 1 if owned else 0),
                   stream_experts=options.gpu_prefill_experts, pad_from=options.expert_pad_from,
                   streamer=options.streamers.for_device(torch.device(device)) if streams else None,
                   owned_experts=owned, read_experts=options.gpu_read_experts, resident_experts=resident,
                   swiglu_limit=float(getattr(config, "swiglu_limit", 0.0) or 0.0),
                   decode_kernel=options.decode_kernel)

    # ------------------------------------------------------ what expert LoRA needs (engines/lora/cpu_experts.py)
    def sft_kernel(self) -> tuple[type, Any] | None:
        cls = sft_kernel_class(self.method)
        if cls is None or (METHODS[self.method].weights == "mxfp4" and self.packed_reader is None):
            return None  # MXFP4_SFT_MOE takes the released E2M1 bytes only; experts converted to MXFP4 keep none
        return cls, load_ext().moe.MOESFTConfig()

    def sft_base_weights(self, config: Any) -> tuple[tuple[torch.Tensor, ...], bool]:
        """Point `config` (sft_kernel's) at this layer's base experts in the form its kernel takes: bf16 matrices, or
        for MXFP4 the released bytes (per-expert E2M1 rows, bf16 multipliers per 32) with V4's SwiGLU clamp. Returns
        the tensors the pointers reach, and whether the kernel reads them after loading (MXFP4's copies them in)."""
        if METHODS[self.method].weights != "mxfp4":
            gate, up, down = (w.to("cpu", torch.bfloat16).contiguous() for w in self.read_base_weights())
            config.gate_proj, config.up_proj, config.down_proj = gate.data_ptr(), up.data_ptr(), down.data_ptr()
            return (gate, up, down), True
        packed, held = self.packed_reader(), []
        for m in ("gate", "up", "down"):
            rows = [packed[m][e].view(torch.uint8).contiguous() for e in range(self.num_experts)]
            scales = [mxfp4.scales_as_bf16(packed[f"{m}_scale"][e]) for e in range(self.num_experts)]
            setattr(config, f"{m}_projs", [[t.data_ptr() for t in rows]])
            setattr(config, f"{m}_scales", [[t.data_ptr() for t in scales]])
            held += rows + scales
        config.quant_config.bits, config.quant_config.group_size = 4, mxfp4.GROUP
        config.quant_config.zero_point = False
        config.swiglu_limit = self.swiglu_limit
        return tuple(held), False

    def worker_pool(self) -> Any:
        return shared_cpu_infer(self.threads)

    def read_base_weights(self, first: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This layer's experts from the checkpoint (with `first`, only experts [0, first))."""
        from engines.kt.loader import read_layer_experts

        if self.base_reader is not None:
            return self.base_reader(first)
        if self.checkpoint is None:
            raise ValueError(f"expert LoRA on layer {self.layer_idx}: the base model's checkpoint is unknown")
        return read_layer_experts(Path(self.checkpoint), f"model.layers.{self.layer_idx}.mlp.experts",
                                  self.num_experts, first)

    def _check_owned(self, owned: int) -> int:
        if not owned:
            return 0
        if not 0 < owned < self.num_experts:
            raise ValueError(f"owned_experts of layer {self.layer_idx} must lie in 0..{self.num_experts - 1}, "
                             f"got {owned}")
        why = ("no streamer holds their copies" if self.streamer is None else
               "hot experts (gpu_experts) are kept too" if self.gpu_experts else
               "experts are deferred (n_deferred_experts)" if self.deferred else
               f"{self.method} is not split" if self.method not in OWNABLE_METHODS else "")
        if why:
            raise ValueError(f"layer {self.layer_idx} cannot hand experts to the GPU side: {why}")
        return owned

    def _check_gpu_experts(self, gpu_experts: list[int] | None) -> list[int]:
        ids = sorted(set(int(e) for e in gpu_experts or ()))
        bad = [e for e in ids if not 0 <= e < self.num_experts]
        if bad:
            raise ValueError(f"gpu_experts {bad} are outside 0..{self.num_experts - 1}")
        return ids

    # ------------------------------------------------------------------------------------------ loading
    def load_weights(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                     cache_dir: str | os.PathLike | None = None) -> None:
        """Take this layer's expert weights: gate/up [E, I, H], down [E, H, I], any float dtype.

        Quantized methods quantize here. With `cache_dir`, their quantized form (and the hot experts' weights)
        is also written there, so that `load_quantized(cache_dir)` can skip this on the next start; BF16 and
        LLAMAFILE (quick to convert) write nothing. What kt-kernel needs is copied; the arguments may be freed.
        """
        self._check_idle()
        self._check_shapes(gate, up, down)
        with torch.no_grad():
            self._keep_gpu_weights(gate, up, down)
            self._keep_streamed_weights(gate, up, down)
            gate, up, down = (t[self.owned:].to("cpu", torch.bfloat16).contiguous() for t in (gate, up, down))
            self._ggml_types = (self.llamafile_type,) * 3
            self._load_prepared(lambda: self._prepare_weights(gate, up, down), cache_dir, floats=(gate, up, down))

    def load_stored(self, experts: "ExpertsLayer", *, cache_dir: str | os.PathLike | None = None) -> str:
        """Take this layer's experts in the checkpoint's stored form (engines/checkpoints/source.py): FP8 blocks go
        to an FP8 kernel as they are, a GGUF's ggml blocks to the LLAMAFILE kernel as they are where this build
        computes their types (`load_ggml`), anything else is converted to this layer's method (`load_weights`).
        Returns how the layer holds them, e.g. "FP8 in place", "Q4_K in place (llamafile)" or "AMXINT8 from
        FP8"."""
        if experts.form == "ggml" and self.load_ggml(experts.blocks()):
            return f"{experts.stored_as} in place (llamafile)"
        if experts.form != "fp8_blocks" or METHODS[self.method].weights != "fp8_blocks":
            self.load_weights(*experts.dequantized(), cache_dir=cache_dir)
            stored = experts.stored_as
            return self.method if self.method.lower() == stored.lower() else f"{self.method} from {stored}"
        self._check_idle()
        self._check_shapes(experts.gate, experts.up, experts.down)
        with torch.no_grad():
            if self.gpu_experts or self.streamer is not None:  # torch's share takes them as floats
                floats = experts.dequantized()
                self._keep_gpu_weights(*floats)
                self._keep_streamed_weights(*floats)
                del floats
            # the released blocks are the kernel's own form: nothing to convert, and nothing worth caching
            self._load_prepared(lambda: experts.blocks(self.owned), None)
        return "FP8 in place"

    def load_converted(self, converted: "ConvertedExperts") -> bool:
        """Read this layer from kt-kernel's pre-converted experts (kt_weight_path); False when they lack it."""
        self._check_idle()
        if converted.method != self.method or self.owned:
            raise ValueError(f"kt_weight_path holds {converted.method} experts; layer {self.layer_idx} runs "
                             f"{self.method}{' with experts the GPU owns' if self.owned else ''}")
        tensors = converted.layer(self.layer_idx, self.num_experts)
        if tensors is None:
            return False
        if self.gpu_experts or self.streamer is not None:  # torch's share takes them from the checkpoint
            floats = self.read_base_weights()
            self._keep_gpu_weights(*floats)
            self._keep_streamed_weights(*floats)
        if tensors:
            self._build_kernel(tensors)
        else:
            self._build_kernel({}, load_dir=converted.root)
        self._choose_decode_calls()
        return True

    def _check_shapes(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        E, I, H = self.num_experts, self.intermediate_size, self.hidden_size
        for name, tensor, shape in (("gate", gate, (E, I, H)), ("up", up, (E, I, H)), ("down", down, (E, H, I))):
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name} weights of layer {self.layer_idx} have shape {tuple(tensor.shape)}, "
                                 f"expected {shape}")
            if tensor.is_meta or not tensor.is_floating_point():
                raise ValueError(f"{name} weights of layer {self.layer_idx} must be real float tensors, "
                                 f"got {tensor.dtype} on {tensor.device}")

    def _load_prepared(self, prepare: Any, cache_dir: str | os.PathLike | None,
                       floats: tuple[torch.Tensor, ...] | None = None) -> None:
        """Build the kernel from `prepare()` (the method's form), saving it to `cache_dir` when given; the decode
        kernel (`decode_calls`) takes the same form, or the bf16 `floats` it was prepared from."""
        cache = self._cache(cache_dir) if cache_dir is not None and METHODS[self.method].cacheable else None
        if cache is not None:
            cache.begin_save()
        prepared = prepare()
        if cache is not None and not cache.written_by_kt_kernel:
            cache.save_prepared(prepared)
        self._build_kernel(prepared, save_dir=cache.root if cache and cache.written_by_kt_kernel else None)
        self._choose_decode_calls(floats=floats, prepared=prepared)
        if cache is not None:
            if self.decode_calls is not None and self.decode_calls.own_form:  # the kernel's own form: kept too
                kernel = self.decode_calls.kernel
                cache.save_decode_kernel(kernel.format, kernel.tensors)
            if self.owned:  # the experts kt-kernel does not hold: the GPU's copies are their only form
                cache.save_copies(self.streamer.layers[self.layer_idx], self.streamer.resident.get(self.layer_idx))
            cache.finish_save(self._gpu_weights, self.gpu_experts)

    def load_packed(self, weights: dict[str, torch.Tensor]) -> None:
        """Take this layer's experts in the method's own stored form, as a checkpoint ships them (V4's MXFP4:
        "gate"/"up"/"down" packed E2M1 [E, n, k/2] and "<m>_scale" UE8M0 [E, n, k/32]); kt-kernel reads them
        without a conversion. With a streamer (kt_gpu_prefill_tokens) the GPU side keeps copies of the same bytes
        (`HostExperts.mxfp4_of`: of the first `stream_experts`), pinned where a GPU reads them. Experts the GPU owns
        (kt_gpu_read_experts, kt_gpu_resident_experts) live only as such copies, the first `resident` of them in
        the GPU's memory; kt-kernel takes the others. Layers with hot experts take `load_weights` instead."""
        self._check_idle()
        if METHODS[self.method].weights != "mxfp4":
            raise ValueError(f"layer {self.layer_idx}: experts method {self.method} does not read packed weights")
        if self.gpu_experts:
            raise ValueError(f"layer {self.layer_idx}: packed experts cannot also be kept on the GPU as hot experts")
        E, I, H = self.num_experts, self.intermediate_size, self.hidden_size
        prepared: dict[str, Any] = {}
        for m, (n, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            packed, scale = weights[m], weights[f"{m}_scale"]
            if tuple(packed.shape) != (E, n, k // 2) or tuple(scale.shape) != (E, n, k // mxfp4.GROUP):
                raise ValueError(f"{m} experts of layer {self.layer_idx}: packed {tuple(packed.shape)} / scale "
                                 f"{tuple(scale.shape)}, expected ({E}, {n}, {k // 2}) / ({E}, {n}, "
                                 f"{k // mxfp4.GROUP})")
            prepared[m] = packed[self.owned:].view(torch.uint8).contiguous()
            prepared[f"{m}_scale"] = mxfp4.scales_as_bf16(scale[self.owned:])
        self._build_kernel(prepared)
        host = None
        if self.streamer is not None:
            device, first = self.streamer.device, self.resident

            def copies(start: int, stop: int, pin: bool = False) -> HostExperts:
                return HostExperts.mxfp4_of({name: tensor[start:stop] for name, tensor in weights.items()}, pin=pin)

            resident = copies(0, first).to(device) if first else None
            host = copies(first, self.stream_experts, pin=device.type == "cuda")
            self.streamer.register(self.layer_idx, host, self.top_k, read_in_place=self._read_in_place,
                                   resident=resident, limit=self.swiglu_limit)
        # the released bytes, read in place: the streamer's copy of them where it holds every expert in host memory
        # (kt-kernel's MXFP4 class keeps a copy of its own, so the released tensors need not stay alive beside it)
        whole = host is not None and self.resident == 0 and host.held == self.num_experts
        self._choose_decode_calls(packed=_copy_as_packed(host, self.intermediate_size) if whole else weights)

    def load_ggml(self, blocks: dict[str, tuple[torch.Tensor, str]]) -> bool:
        """Take this layer's experts as a GGUF file stores them, read in place by the LLAMAFILE kernel:
        {"gate" | "up" | "down": (uint8 [E, rows, row bytes], ggml type name)}; the tensors (views of the mapped
        file) are kept alive for as long as the kernel lives. False, with nothing loaded, where this layer cannot
        read them so (another method, hot or GPU-side experts, a type this build does not compute correctly:
        expert_methods.llamafile_computes); `load_stored` then converts them through `load_weights`."""
        self._check_idle()
        types = tuple(blocks[m][1] for m in ("gate", "up", "down"))
        if (self.method != "LLAMAFILE" or self.owned or self.gpu_experts or self.streamer is not None
                or not all(llamafile_computes(t) for t in types)):
            return False
        E, I, H = self.num_experts, self.intermediate_size, self.hidden_size
        for name, rows in (("gate", I), ("up", I), ("down", H)):
            tensor = blocks[name][0]
            if tensor.dtype != torch.uint8 or tuple(tensor.shape[:2]) != (E, rows):
                raise ValueError(f"{name} blocks of layer {self.layer_idx} have shape {tuple(tensor.shape)} "
                                 f"{tensor.dtype}, expected uint8 [{E}, {rows}, row bytes]")
        self._ggml_types = types
        prepared = {m: blocks[m][0] for m in ("gate", "up", "down")}
        self._build_kernel(prepared)
        self._choose_decode_calls(prepared=prepared)
        return True

    def load_quantized(self, cache_dir: str | os.PathLike) -> bool:
        """Load the form `load_weights(..., cache_dir=...)` wrote; False (nothing loaded) when there is no
        complete cache for this layer, method, shape, kt-kernel build and set of hot experts."""
        self._check_idle()
        if not METHODS[self.method].cacheable:
            return False
        cache = self._cache(cache_dir)
        if not cache.complete():
            return False
        if self.gpu_experts:
            hot = cache.load_hot(self.gpu_experts, self.gpu_device)
            if hot is None:
                return False
            self._gpu_weights = hot
        copies = None
        if self.owned:  # the GPU's copies of the experts kt-kernel does not hold are in the cache too
            device = self.streamer.device
            copies = cache.load_copies(pin=device.type == "cuda", resident=self.resident, device=device,
                                       bits=self.copy_bits)
            if copies is None:
                return False
        if cache.written_by_kt_kernel:  # kt-kernel only prints (and reads garbage) for a missing file: checked
            self._build_kernel({}, load_dir=cache.root)
            fmt = DECODE_FORMATS.get(self.method)  # the kernel's form is read only if the kernel takes the layer
            self._choose_decode_calls(quantized=(lambda: cache.load_decode_kernel(fmt)) if fmt else None)
        else:
            prepared = cache.load_prepared()
            self._build_kernel(prepared)
            self._choose_decode_calls(prepared=prepared)
        if copies is not None:
            resident, host = copies
            self.streamer.register(self.layer_idx, host, self.top_k, read_in_place=self._read_in_place,
                                   resident=resident, limit=self.swiglu_limit)
        elif self.streamer is not None:  # extra copies (kt_gpu_prefill_tokens) come from the checkpoint
            self._keep_streamed_weights(*self.read_base_weights(self.stream_experts))
        log.debug("layer %d: %s experts loaded from %s", self.layer_idx, self.method, cache.dir)
        return True

    def _choose_decode_calls(self, **forms: Any) -> None:
        """Whether decode-sized calls go to our kernel from now on, given the forms the layer was loaded from."""
        self.decode_calls = None
        if self.decode_kernel is not None:
            self.decode_calls = self.decode_kernel.build(self, **forms)

    @property
    def ggml_types(self) -> tuple[str, str, str]:
        """The ggml types of gate's, up's and down's blocks as the LLAMAFILE kernel reads them (LLAMAFILE only)."""
        return self._ggml_types

    def _cache(self, cache_dir: str | os.PathLike) -> LayerCache:
        return LayerCache(Path(cache_dir), self.layer_idx, self.method, self.kernel_experts, self.hidden_size,
                          self.intermediate_size, first_expert=self.owned)

    def _check_no_pending(self) -> None:
        if self._pending is not None:
            raise RuntimeError(f"experts of layer {self.layer_idx}: submit called again before sync")

    def _check_idle(self) -> None:
        if self._pending is not None:  # kt-kernel may still be reading the old weights
            raise RuntimeError(f"experts of layer {self.layer_idx}: weights reloaded between submit and sync")

    def _keep_gpu_weights(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        if not self.gpu_experts:
            self._gpu_weights = None
            return
        index = torch.tensor(self.gpu_experts, device="cpu")
        self._gpu_weights = tuple(t.index_select(0, index.to(t.device)).to(self.gpu_device)
                                  for t in (gate, up, down))

    def _keep_streamed_weights(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        if self.streamer is not None:
            device, held, first = self.streamer.device, self.stream_experts, self.resident
            host = HostExperts.quantize(gate[first:held], up[first:held], down[first:held], bits=self.copy_bits,
                                        work_device=device, pin=device.type == "cuda")
            resident = (HostExperts.quantize(gate[:first], up[:first], down[:first], bits=self.copy_bits,
                                             work_device=device).to(device) if first else None)
            self.streamer.register(self.layer_idx, host, self.top_k, read_in_place=self._read_in_place,
                                   resident=resident, limit=self.swiglu_limit)

    def _prepare_weights(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> dict[str, Any]:
        """bf16 [E, ...] weights -> what the method's kernel reads: {"gate": ..., ...} (plus "<m>_scale")."""
        form = METHODS[self.method].weights
        if form == "bf16":
            return {"gate": gate, "up": up, "down": down}
        if form == "ggml":
            return {m: _to_ggml_blocks(t, self.llamafile_type) for m, t in (("gate", gate), ("up", up), ("down", down))}
        quantize = {"fp8_blocks": quantize_fp8_blocks, "int4_groups": quantize_int4_groups,
                    "mxfp4": _quantize_mxfp4}[form]
        out: dict[str, Any] = {}
        for m, t in (("gate", gate), ("up", up), ("down", down)):
            parts = [quantize(expert) for expert in t]
            out[m], out[f"{m}_scale"] = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
        return out

    def _build_kernel(self, weights: dict[str, Any], *, save_dir: str | os.PathLike | None = None,
                      load_dir: str | os.PathLike | None = None) -> None:
        ext = load_ext()
        pool = shared_cpu_infer(self.threads)
        config = ext.moe.MOEConfig(self.kernel_experts, self.top_k, self.hidden_size, self.intermediate_size,
                                   self._gpu_mask.data_ptr())
        config.layer_idx = self.layer_idx
        config.pool = pool.backend_
        config.max_len = self.chunk_tokens
        form = METHODS[self.method].weights
        if form == "ggml":
            ggml = ext.kvcache.ggml_type
            config.gate_type, config.up_type, config.down_type = (getattr(ggml, t) for t in self._ggml_types)
            config.hidden_type = ggml.BF16
            # Batching settings as kt-kernel's own LlamafileMoEWrapper sets them.
            config.m_block, config.group_min_len, config.group_max_len = 32, 10, self.chunk_tokens
        if weights and isinstance(weights["gate"], list):  # kt_weight_path's merged layout: kt-kernel's own bytes
            for m in ("gate", "up", "down"):
                setattr(config, f"{m}_projs", [[t.data_ptr() for t in weights[m]]])
                setattr(config, f"{m}_scales", [[t.data_ptr() for t in weights[f"{m}_scale"]]])
            config.load = True
        elif form in ("fp8_blocks", "int4_groups", "mxfp4"):
            # one pointer per expert, as kt-kernel's native loaders pass checkpoint tensors
            for m in ("gate", "up", "down"):
                setattr(config, f"{m}_projs", [[weights[m][e].data_ptr() for e in range(self.kernel_experts)]])
                setattr(config, f"{m}_scales", [[weights[f"{m}_scale"][e].data_ptr()
                                                 for e in range(self.kernel_experts)]])
            fp8 = form == "fp8_blocks"
            config.swiglu_limit = self.swiglu_limit
            config.quant_config.bits = 8 if fp8 else 4
            config.quant_config.group_size = 128 if fp8 else self.hidden_size // weights["gate_scale"].shape[2]
            config.quant_config.zero_point = False
        elif weights:
            config.gate_proj, config.up_proj = weights["gate"].data_ptr(), weights["up"].data_ptr()
            config.down_proj = weights["down"].data_ptr()
        if save_dir is not None or load_dir is not None:
            config.path = os.fspath(save_dir if save_dir is not None else load_dir)
            config.save, config.load = save_dir is not None, load_dir is not None
        kernel = kernel_class(self.method)(config)
        identity = torch.arange(self.kernel_experts, dtype=torch.int64, device="cpu")  # physical -> logical ids
        pool.submit(kernel.load_weights_task(identity.data_ptr()))
        pool.sync()
        # Most classes quantize or pack the weights into buffers of their own while loading: ours may go (for
        # FP8 that is one byte a weight, 14.4 GB for V2-Lite). The few that read them in place keep them.
        self._kernel_weights = tuple(weights.values()) if reads_in_place(self.method) else ()
        self._kernel, self._pool = kernel, pool

    # ------------------------------------------------------------------------------------------ compute
    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """sum_k topk_weights[:, k] * expert_{topk_ids[:, k]}(hidden), as [T, H] in hidden's dtype, on
        `out_device` (hidden's device when that is None).

        hidden [T, H] any float dtype/device; topk_ids [T, top_k] integer (-1 = no expert: contributes 0);
        topk_weights [T, top_k]. Any T: kt-kernel sees chunks of at most `chunk_tokens` tokens.
        """
        self.submit(hidden, topk_ids, topk_weights)
        return self.wait()

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Start the CPU work and return; the hot experts (if any) are computed meanwhile on gpu_device.
        Rows of adapters with expert LoRA on this layer go to `lora` instead (computed in sync())."""
        self._lora_step = None
        if self.lora is not None:
            topk_ids, self._lora_step = self.lora.begin(hidden, topk_ids, topk_weights)
        self._submit_kernel(hidden, topk_ids, topk_weights)

    def sync(self) -> torch.Tensor:
        """Wait for the work `submit` started; returns what `forward` would have."""
        out = self._sync_kernel()
        step, self._lora_step = self._lora_step, None
        return out if step is None else self.lora.finish(out, step)

    def wait(self) -> torch.Tensor:
        """sync() with the output on `out_device`; a blocking wait is timed into `host_times`."""
        started = time.perf_counter()
        streamed = isinstance(self._pending, (_StreamPending, _GPUPending))
        out = self.sync()
        if not streamed:
            self.host_times.synced(started)
        return out if self.out_device is None else out.to(self.out_device)

    def abandon(self) -> None:
        if self._pending is None:
            return
        try:
            self.sync()  # kt-kernel may still be writing into the staged buffers: let it finish
        except Exception:  # the step already failed; what matters is that nothing stays pending
            self._pending, self._lora_step = None, None

    @torch.no_grad()
    def _submit_kernel(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        tokens = self._check_inputs(hidden, topk_ids, topk_weights)
        self.host_times.submitted_at = time.perf_counter()
        # the hot experts (torch, gpu_device) always run in their own layer: only kt-kernel's share is deferred
        immediate_ids, deferred_ids = topk_ids, None
        if self.deferral.active and self.defer_into is not None and 0 < tokens <= self.chunk_tokens:
            immediate_ids, deferred_ids = split_deferred(topk_ids, topk_weights, self.deferred)
        if (self.decode_calls is not None and self.decode_calls.covers(tokens) and not hidden.is_cuda
                and not self.deferral.active):
            return self._submit_decode(hidden, topk_ids, topk_weights, tokens)
        if self._can_use_stream(hidden, tokens):
            streamed = self._streamed_experts(tokens) if deferred_ids is None else 0
            if streamed == self.num_experts and not self.gpu_experts:
                return self._submit_streamed_only(hidden, topk_ids, topk_weights, tokens)
            mapped = 0 if streamed or deferred_ids is not None else self.mapped_experts(tokens)
            first = streamed or mapped
            if first:  # experts [0, first) run on the GPU: kt-kernel skips them
                immediate_ids = self._kernel_ids(immediate_ids, first)
            return self._submit_on_stream(hidden, topk_ids, immediate_ids, deferred_ids, topk_weights, tokens,
                                          streamed, mapped)
        with self._lock:
            if self._kernel is None:
                raise RuntimeError(f"experts of layer {self.layer_idx} have no weights yet; call load_weights")
            self._check_no_pending()
            # a deferred task outlives this call, so a deferring layer stages in the buffers of its parity:
            # the next layer (the other parity) cannot overwrite them while it runs
            role = "main" if deferred_ids is None else f"layer{self.layer_idx % 2}"
            rows = self._kernel_tokens(tokens)
            x, ids, weights, out = (t[:rows] for t in self._staging_for(rows, hidden.device, role))
            x[:tokens].copy_(hidden)
            # experts [0, first) are the streamer's: the ones the GPU owns, or a prompt chunk's streamed share
            first = self.owned or (self._streamed_experts(tokens) if deferred_ids is None else 0)
            self._stage_routing(ids, weights, self._kernel_ids(immediate_ids, first), topk_weights, tokens)
            if deferred_ids is not None:  # staged (and checked) before anything is submitted
                _, d_ids, d_weights, d_out = (t[:rows] for t in self._staging_for(rows, hidden.device,
                                                                                   f"deferred{self.layer_idx % 2}"))
                self._stage_routing(d_ids, d_weights, deferred_ids, topk_weights, tokens)
            staged: tuple[torch.Tensor, ...] = (x, ids, weights, out[:tokens],
                                                self._submit_chunks(x, ids, weights, out, rows))
            deferred = None
            if deferred_ids is not None:
                d_sizes = self._submit_chunks(x, d_ids, d_weights, d_out, rows)
                deferred = Deferred(self.defer_into, tokens, d_out[:tokens], keep=(x, d_ids, d_weights, d_sizes))
            try:
                gpu_part = self._hot_experts(hidden, topk_ids, topk_weights) if self._gpu_weights else None
                if first:  # no hot experts beside owned ones (_check_owned)
                    routed = self._without_hot_experts(topk_ids) if self.gpu_experts else topk_ids
                    part = self.streamer.compute(self.layer_idx, hidden, routed, topk_weights, first,
                                                 self.swiglu_limit)
                    gpu_part = part if gpu_part is None else gpu_part + part
            except BaseException:
                self._pool.sync()  # kt-kernel must be done with the staging buffers before anyone reuses them
                raise
            self._pending = _Pending(tokens, hidden.device, hidden.dtype, staged, gpu_part, deferred)

    def _submit_decode(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       tokens: int) -> None:
        """Start a call on our decode kernel (every expert is kt-kernel's: no hot, owned or streamed ones here)."""
        with self._lock:
            if self._kernel is None:
                raise RuntimeError(f"experts of layer {self.layer_idx} have no weights yet; call load_weights")
            self._check_no_pending()
            ids = topk_ids.to("cpu", torch.int64)
            low, high = int(ids.min()), int(ids.max())
            if high >= self.num_experts or low < -1:
                raise ValueError(f"topk_ids of layer {self.layer_idx} must lie in -1..{self.num_experts - 1}, "
                                 f"got {low}..{high}")
            kept = self.decode_calls.submit(hidden, ids, topk_weights)
            self._pending = _DecodePending(tokens, hidden.device, hidden.dtype, kept)

    def _stage_routing(self, ids: torch.Tensor, weights: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, tokens: int) -> None:
        """Copy a call's routing into the host buffers kt-kernel reads, checked and in the kernel's terms; rows
        past `tokens` (padding, see `matrix_tokens`) name no expert."""
        if ids.shape[0] > tokens:
            ids[tokens:] = -1
            weights[tokens:] = 0.0
            ids, weights = ids[:tokens], weights[:tokens]
        ids.copy_(topk_ids)
        weights.copy_(topk_weights)
        if tokens and (int(ids.max()) >= self.kernel_experts or int(ids.min()) < -1):
            low, high = int(ids.min()), int(ids.max()) + self.owned  # in the model's numbering (-1 stays -1)
            raise ValueError(f"topk_ids of layer {self.layer_idx} must lie in -1..{self.num_experts - 1}, "
                             f"got {low if low < 0 else low + self.owned}..{high}")
        if self.gpu_experts:
            ids.copy_(self._without_hot_experts(ids))
        if self.method == "LLAMAFILE":
            _fill_empty_slots(ids, weights, self._gpu_mask)

    def _submit_chunks(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                       tokens: int) -> torch.Tensor:
        """Submit the kernel over staged buffers in chunks of at most `chunk_tokens`; the chunk sizes, which
        kt-kernel reads until the work is done."""
        starts = range(0, tokens, self.chunk_tokens)
        sizes = torch.tensor([min(self.chunk_tokens, tokens - s) for s in starts], dtype=torch.int32, device="cpu")
        for i, start in enumerate(starts):
            self._pool.submit(self._kernel.forward_task(
                sizes[i].data_ptr(), self.top_k, ids[start].data_ptr(), weights[start].data_ptr(),
                x[start].data_ptr(), out[start].data_ptr(), False))
        return sizes

    def _sync_kernel(self) -> torch.Tensor:
        with self._lock:
            pending, self._pending = self._pending, None
            if pending is None:
                raise RuntimeError(f"experts of layer {self.layer_idx}: sync called without submit")
            prior = self._take_deferred(pending.tokens)
            if pending.deferred is not None:
                self.deferral.defer(pending.deferred)
            if isinstance(pending, _GPUPending):
                return pending.out.to(pending.dtype)
            if isinstance(pending, _DecodePending):
                self.decode_calls.wait()
                return pending.kept[-1].to(pending.device, pending.dtype)
            if isinstance(pending, _StreamPending):
                return self._sync_on_stream(pending, prior)
            if pending.tokens:
                # kt-kernel runs tasks in order: with this call's deferred task allowed to run on, the wait
                # still covers its immediate task and the previous layer's deferred one
                self._pool.sync(0 if pending.deferred is None else 1)
            out = pending.staged[3]
            if prior is not None:
                out = out.float() + prior.out.float()
            if pending.gpu_part is not None:
                result = out.to(pending.gpu_part.device, torch.float32) + pending.gpu_part
                return result.to(pending.device, pending.dtype)
            # copy=True: the staging buffer is reused by the next submit
            return out.to(pending.device, pending.dtype, copy=True)

    def _take_deferred(self, tokens: int) -> Deferred | None:
        """The previous layer's deferred experts this layer's output takes (decode steps with deferral)."""
        prior = self.deferral.take(self.layer_idx) if self.deferral.active else None
        if prior is not None and prior.tokens != tokens:
            raise RuntimeError(f"experts of layer {self.layer_idx}: the previous layer deferred {prior.tokens} "
                               f"tokens' experts into a call of {tokens}")
        return prior

    # ------------------------------------------------------------------------ GPU: stream-ordered path
    # With the hidden states on a CUDA device, nothing here blocks the Python thread: the copies into
    # pinned buffers, the start of the CPU work, the wait for it and the copy back are all queued on the
    # current CUDA stream (kt-kernel runs the CPU task from a stream callback). The GPU meanwhile runs
    # whatever was queued after submit (the shared experts), and Python can queue the next layers. This
    # also matters because kt-kernel's blocking sync() spins while holding the GIL.
    def _can_use_stream(self, hidden: torch.Tensor, tokens: int) -> bool:
        return (hidden.is_cuda and self.method != "LLAMAFILE" and 0 < tokens <= self.chunk_tokens
                and self._kernel is not None)

    def _stream_buffers(self, device: torch.device, role: str = "main", with_input: bool = True
                        ) -> _StreamBuffers:
        """The model's pinned buffers of `role` for `device` (one set per device and role: each device's layers
        run in order on its stream; a deferring layer uses its parity's own sets, since its deferred task runs
        on while the next layer stages); this layer's own device buffer is made here too."""
        rows = self.chunk_tokens
        if self._out_device is None or self._out_device.device != device:
            self._out_device = torch.empty(rows, self.hidden_size, dtype=torch.bfloat16, device=device)

        def build() -> _StreamBuffers:
            def pinned(cols: int, dtype: torch.dtype) -> torch.Tensor:
                return torch.zeros(rows, cols, dtype=dtype, device="cpu", pin_memory=True)
            return _StreamBuffers(x=pinned(self.hidden_size if with_input else 0, torch.bfloat16),
                                  ids=pinned(self.top_k, torch.int64), weights=pinned(self.top_k, torch.float32),
                                  out=pinned(self.hidden_size, torch.bfloat16), sizes={})
        return self._staging.get(("stream", role, device, rows, self.hidden_size, self.top_k),
                                 lambda b: True, build)

    def _kernel_ids(self, topk_ids: torch.Tensor, first: int) -> torch.Tensor:
        """topk_ids as kt-kernel takes them when the GPU computes experts [0, first): those become -1, and where
        kt-kernel does not hold them at all (`owned`), the others are renumbered from 0."""
        if not first:
            return topk_ids
        if self.owned:
            return torch.where(topk_ids >= self.owned, topk_ids - self.owned, -1)
        return topk_ids.masked_fill((topk_ids >= 0) & (topk_ids < first), -1)

    def _streamed_experts(self, tokens: int) -> int:
        """How many experts (the first ones) a call of `tokens` computes on the GPU from streamed weights."""
        if self.owned:  # every call computes them on the GPU: by the mapped kernels, or streamed when larger
            if tokens <= MAPPED_MAX_TOKENS:
                return 0
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"experts of layer {self.layer_idx}: a captured call of {tokens} tokens cannot "
                                   f"stream experts (graphs end at {MAPPED_MAX_TOKENS})")
            return self.owned
        if (self.streamer is None or tokens < self.stream_tokens or self.deferral.active  # deferring: never
                or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())):
            return 0
        cpu_bytes = self.num_experts * 3 * self.hidden_size * self.intermediate_size * METHODS[self.method].bits // 8
        return self.streamer.split(self.layer_idx, tokens, self.top_k, self.num_experts, cpu_bytes, self.method)

    def mapped_experts(self, tokens: int) -> int:
        """How many experts (the first ones) a call of `tokens` computes on the GPU straight from their host
        copies (engines/kt/experts/mapped.py): decode steps and other calls of a few tokens; 0: none."""
        mapped = self.streamer.mapped if self.streamer is not None else None
        if self.owned and 0 < tokens <= MAPPED_MAX_TOKENS:
            if mapped is None:  # the engine hands experts over only where the kernels run
                raise RuntimeError(f"experts of layer {self.layer_idx}: the GPU owns experts [0, {self.owned}) but "
                                   "cannot read them (no Triton)")
            return self.owned
        if (mapped is None or self.layer_idx not in mapped.layers or not 0 < tokens <= MAPPED_MAX_TOKENS
                or self.gpu_experts or self.deferral.active):
            return 0
        if self.decode_calls is not None and self._share_is_default and self.decode_calls.covers(tokens):
            # our decode kernel reads the experts at the host memory's own rate, and the GPU's reads over PCIe
            # come from that same memory: by default it reads them all (V4-Flash's shape, 4 layers, H200 host,
            # 2026-12-02: batch-1 TPOT 7.7 ms reading none on the GPU, 8.1 ms reading the 144 of 256 balanced
            # against kt-kernel's rate, 8.3 ms with kt-kernel; bench/results/nvidia-h200-2026-12-02-v4-decode-kernel;
            # with MXFP4's two activation passes, 2026-12-03: 8.17 ms against kt-kernel and the GPU's 144 at 8.15,
            # 16 clients 267 tok/s against 170; bench/results/nvidia-h200-2026-12-03-two-pass).
            # Calls it does not cover are kt-kernel's, whose rate the share is balanced against: 32 clients of that
            # shape decoded 85.8 tok/s with kt-kernel reading every expert, 165 with the GPU reading its share
            # (bench/results/nvidia-h200-2026-12-02-v4-paged)
            return 0
        return self._mapped_share

    def _submit_streamed_only(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                              tokens: int) -> None:
        """Every expert on the GPU: no copies to the host, no kt-kernel task, no wait for one."""
        with self._lock:
            self._check_no_pending()
            out = self.streamer.compute(self.layer_idx, hidden, topk_ids, topk_weights, self.num_experts,
                                        self.swiglu_limit)
            self._pending = _GPUPending(tokens, out, hidden.dtype)

    def _submit_on_stream(self, hidden: torch.Tensor, topk_ids: torch.Tensor, immediate_ids: torch.Tensor,
                          deferred_ids: torch.Tensor | None, topk_weights: torch.Tensor, tokens: int,
                          streamed: int = 0, mapped: int = 0) -> None:
        with self._lock:
            self._check_no_pending()
            parity = self.layer_idx % 2
            b = self._stream_buffers(hidden.device, "main" if deferred_ids is None else f"layer{parity}")
            stream = torch.cuda.current_stream(hidden.device)
            b.x[:tokens].copy_(hidden, non_blocking=True)
            # our decode kernel takes the call where it covers it (no deferral, no streamed share: those calls
            # are kt-kernel's), every row as it is: no padding to kt-kernel's matrix path
            ours = (self.decode_calls is not None and deferred_ids is None and not streamed
                    and self.decode_calls.covers(tokens))
            # the kernels read the token count through a pointer when the stream reaches the task, so each
            # count has its own never-changing pinned cell (captured CUDA graphs replay these pointers).
            rows = tokens if ours else self._kernel_tokens(tokens)
            size = b.sizes.get(rows)
            if size is None:
                size = b.sizes[rows] = torch.full((1,), rows, dtype=torch.int32, pin_memory=True)
            if self.events is not None:
                self.events.record("submitted", stream)
            task = self._stream_task(stream, b, b, size, immediate_ids, topk_weights, tokens, rows, ours)
            deferred = None
            if deferred_ids is not None:
                d = self._stream_buffers(hidden.device, f"deferred{parity}", with_input=False)
                self._stream_task(stream, b, d, size, deferred_ids, topk_weights, tokens, rows)
                deferred = Deferred(self.defer_into, tokens, d.out)
            gpu_part = self._hot_experts(hidden, topk_ids, topk_weights) if self._gpu_weights else None
            if streamed:
                ids = self._without_hot_experts(topk_ids) if self.gpu_experts else topk_ids
                part = self.streamer.compute(self.layer_idx, hidden, ids, topk_weights, streamed,
                                             self.swiglu_limit)
                gpu_part = part if gpu_part is None else gpu_part + part
            elif mapped:  # no hot experts here (`mapped_experts`): the routing goes as it is
                gpu_part = self.streamer.mapped.compute(self.layer_idx, hidden, topk_ids, topk_weights, mapped)
            self._pending = _StreamPending(tokens, b, hidden.dtype, stream, gpu_part, deferred, task)

    def _stream_task(self, stream: "torch.cuda.Stream", inputs: _StreamBuffers, task: _StreamBuffers,
                     size: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, tokens: int,
                     rows: int, ours: bool = False) -> Any:
        """Queue on `stream`: copy the ids and weights into `task`'s buffers, then the kernel over the input
        staged in `inputs`, writing `task.out`; `rows` (`size`'s count) >= `tokens`: padded (`matrix_tokens`).
        `ours`: our decode kernel computes it (returns its StreamTask, which the wait queues too), else kt-kernel
        (None)."""
        task.ids[:tokens].copy_(self._without_hot_experts(topk_ids) if self.gpu_experts else topk_ids,
                                non_blocking=True)
        task.weights[:tokens].copy_(topk_weights, non_blocking=True)
        if rows > tokens:  # the buffers are shared with larger calls: the padding rows must be reset every time
            none = self._no_experts.get(topk_ids.device)
            if none is None:
                none = self._no_experts[topk_ids.device] = torch.full(
                    (self.chunk_tokens, self.top_k), -1, dtype=torch.int64, device=topk_ids.device)
            task.ids[tokens:rows].copy_(none[:rows - tokens], non_blocking=True)
        if ours:
            key = (id(task), rows)
            made = self._decode_tasks.get(key)
            if made is None or made[0] is not task:
                made = self._decode_tasks[key] = (task, self.decode_calls.stream_task(
                    size, self.top_k, inputs.x, task.ids, task.weights, task.out))
            made[1].launch(stream.cuda_stream)
            return made[1]
        self._pool.submit_with_cuda_stream(stream.cuda_stream, self._kernel.forward_task(
            size.data_ptr(), self.top_k, task.ids.data_ptr(), task.weights.data_ptr(), inputs.x.data_ptr(),
            task.out.data_ptr(), False))
        return None

    def padded_tokens(self) -> range:
        """The token counts of a call that go padded to kt-kernel's matrix path (empty: none)."""
        if not (self._matrix_rows and self.pad_from and self._matrix_rows <= self.chunk_tokens):
            return range(0)
        return range(self.pad_from, self._matrix_rows)

    def _kernel_tokens(self, tokens: int) -> int:
        """The rows kt-kernel is handed for a call of `tokens`: `tokens`, or padded up to its matrix path."""
        padded = self.padded_tokens()
        return padded.stop if tokens in padded else tokens

    def _without_hot_experts(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """topk_ids with the hot experts as -1, on topk_ids' device: the torch part computes those, and
        whether a kt-kernel build skips them by the mask alone differs between builds (the amx build did not)."""
        mask = self._masks.get(topk_ids.device)
        if mask is None:  # once per device: the hot set never changes after construction
            mask = self._masks[topk_ids.device] = self._gpu_mask.to(topk_ids.device)
        return topk_ids.masked_fill(mask[topk_ids.clamp_min(0)] & (topk_ids >= 0), -1)

    def _sync_on_stream(self, pending: "_StreamPending", prior: Deferred | None) -> torch.Tensor:
        b = pending.buffers
        if self.events is not None:
            self.events.record("waiting", pending.stream)
        if pending.ours is not None:
            pending.ours.launch_wait(pending.stream.cuda_stream)
        else:
            self._pool.sync_with_cuda_stream(pending.stream.cuda_stream, 0 if pending.deferred is None else 1)
        if self.events is not None:
            self.events.record("done", pending.stream)
        out = self._out_device[:pending.tokens]
        out.copy_(b.out[:pending.tokens], non_blocking=True)
        if prior is None and pending.gpu_part is None:
            return out.to(pending.dtype)
        total = out.float()
        if prior is not None:
            if self._deferred_in is None or self._deferred_in.device != out.device:
                self._deferred_in = torch.empty_like(self._out_device)
            carried = self._deferred_in[:pending.tokens]
            carried.copy_(prior.out[:pending.tokens], non_blocking=True)
            total = total + carried.float()
        if pending.gpu_part is not None:
            total = total + pending.gpu_part
        return total.to(pending.dtype)

    def _check_inputs(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> int:
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [tokens, {self.hidden_size}], got {tuple(hidden.shape)}")
        expected = (hidden.shape[0], self.top_k)
        for name, tensor in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{name} must be {list(expected)} for layer {self.layer_idx}, "
                                 f"got {list(tensor.shape)}")
        if topk_ids.is_floating_point() or topk_ids.is_complex():
            raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
        return hidden.shape[0]

    def _staging_for(self, tokens: int, device: torch.device, role: str = "main") -> tuple[torch.Tensor, ...]:
        """The model's CPU buffers of `role` kt-kernel reads and writes (input, ids, weights, output), grown on
        demand; pinned when a GPU is on the other side. A deferred task reads its layer's input: its set has
        none of its own."""
        pin = device.type == "cuda" or self.gpu_device.type == "cuda"

        def build() -> tuple[torch.Tensor, ...]:
            rows = max(tokens, self.chunk_tokens)

            def make(cols: int, dtype: torch.dtype) -> torch.Tensor:
                return torch.zeros(rows, cols, dtype=dtype, device="cpu", pin_memory=pin)
            # kt-kernel's forward reads bf16 input, int64 ids, float32 weights and writes bf16 output
            return (make(0 if role.startswith("deferred") else self.hidden_size, torch.bfloat16),
                    make(self.top_k, torch.int64), make(self.top_k, torch.float32),
                    make(self.hidden_size, torch.bfloat16))
        return self._staging.get(("host", role, pin, self.hidden_size, self.top_k),
                                 lambda staged: staged[1].shape[0] >= tokens, build)

    def _hot_experts(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The hot experts' share of the output, computed with torch on gpu_device (float32)."""
        gate, up, down = self._gpu_weights
        x = hidden.to(self.gpu_device, gate.dtype)
        ids, weights = topk_ids.to(self.gpu_device), topk_weights.to(self.gpu_device, torch.float32)
        out = torch.zeros(hidden.shape[0], self.hidden_size, dtype=torch.float32, device=self.gpu_device)
        for slot, expert in enumerate(self.gpu_experts):
            token, k = (ids == expert).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            h = x.index_select(0, token)
            y = (F.silu(h @ gate[slot].T) * (h @ up[slot].T)) @ down[slot].T
            out.index_add_(0, token, y.float() * weights[token, k].unsqueeze(1))
        return out
