"""Which routed-expert methods this CPU can run, and which one serves when a rule asks for another.

Everything that depends on kt-kernel's build lives here: method names, the kernel classes behind them,
their size rules, the SFT (expert LoRA) kernels and the fallback order. kt-kernel ships one extension per
CPU level and loads one at import (`kt_kernel.__cpu_variant__`; `KT_KERNEL_CPU_VARIANT` forces a lower
one), so availability is read from the classes that build really exports, never from /proc/cpuinfo.

What the builds of kt-kernel 0.7.2 export and compute (checked with the expert tests on each variant):

| method    | weights             | amx / avx512_* builds            | avx2 build       |
|-----------|---------------------|----------------------------------|------------------|
| AMXINT8   | int8, per row       | AMXInt8_MOE (tiles only on amx)  | -                |
| AMXINT4   | int4, per row       | AMXInt4_MOE                      | -                |
| BF16      | bf16                | AMXBF16_MOE                      | AVX2BF16_MOE     |
| FP8       | e4m3, 128x128 block | AMXFP8_MOE                       | AVX2FP8_MOE      |
| RAWINT4   | int4, groups of 32  | AMXInt4_KGroup_MOE               | AVX2RawInt4_MOE  |
| LLAMAFILE | GGUF blocks         | MOE (LLAMAFILE_IN_PLACE's types) | MOE (the same)   |
| MXFP4     | e2m1, UE8M0 per 32  | AMXFP4_KGroup_MOE                | AVX2MXFP4_MOE    |

AMXINT8/AMXINT4/BF16 take bf16 weights and quantize inside kt-kernel; FP8 and RAWINT4 take weights we
quantize on load (`quantize_fp8_blocks`, `quantize_int4_groups`), as kt-kernel's own loaders hand them
over from FP8 / compressed-tensors checkpoints. MXFP4 is DeepSeek-V4's released expert format, read in place
(`RoutedExpertsCPU.load_packed`; engines/checkpoints/mxfp4.py), or quantized to it on load from other weights.
FP8 and MXFP4 are the methods whose kernels clamp the SwiGLU inputs (`swiglu_limit`, V4's routed experts).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from engines.checkpoints.fp8 import quantize_blocks
from engines.kt.experts.cpuinfer import load_ext

log = logging.getLogger("ktserve.engine.kt")

FP8_BLOCK = 128
INT4_GROUP = 32


@dataclass(frozen=True, slots=True)
class ExpertMethod:
    name: str
    bits: int  # weight bits, for choosing a replacement of the same precision
    kernels: tuple[str, ...]  # kt-kernel classes, preferred first
    size_multiple: int  # hidden and intermediate sizes must be multiples of this
    weights: str  # "bf16" (kt-kernel quantizes), "fp8_blocks", "int4_groups", "ggml"
    sft_kernel: str | None  # kt-kernel class computing these experts with a LoRA inside, if any
    cacheable: bool  # the quantized form is worth saving for the next start (--kt-weight-cache)
    # on the amx build, calls of at least this many tokens per expert (tokens x top_k / experts) are faster
    # padded up to the matrix kernels (`matrix_tokens`); 0: not measured faster, never padded by default
    pad_ratio: float = 0.0


# Size rules measured with kt-kernel 0.7.2: other sizes fail in kt-kernel, crash the process or (LLAMAFILE)
# silently return zeros. LLAMAFILE: kt-kernel demands intermediate % 256, and with hidden sizes below 256
# its batched path returned zeros, so hidden must be a multiple of 256 as well.
METHODS: dict[str, ExpertMethod] = {m.name: m for m in (
    ExpertMethod("AMXINT8", 8, ("AMXInt8_MOE",), 64, "bf16", "AMXInt8_SFT_MOE", True, pad_ratio=2.25),
    ExpertMethod("AMXINT4", 4, ("AMXInt4_MOE",), 128, "bf16", "AMXInt4_SFT_MOE", True, pad_ratio=1.5),
    ExpertMethod("BF16", 16, ("AMXBF16_MOE", "AVX2BF16_MOE"), 32, "bf16", "AMXBF16_SFT_MOE", False,
                 pad_ratio=1.125),
    ExpertMethod("FP8", 8, ("AMXFP8_MOE", "AVX2FP8_MOE"), FP8_BLOCK, "fp8_blocks", None, True),
    ExpertMethod("RAWINT4", 4, ("AMXInt4_KGroup_MOE", "AVX2RawInt4_MOE"), 64, "int4_groups", None, True),
    ExpertMethod("LLAMAFILE", 8, ("MOE",), 256, "ggml", None, False),
    ExpertMethod("MXFP4", 4, ("AMXFP4_KGroup_MOE", "AVX2MXFP4_MOE"), 32, "mxfp4", "MXFP4_SFT_MOE", False),
)}
CLAMPING_METHODS = frozenset({"FP8", "MXFP4"})  # kernels honouring MOEConfig.swiglu_limit
DEFAULT_METHOD = "AMXINT8"  # what a rule without `backend`/`method` asks for, as in KTransformers


def default_method(stored_form: str) -> str:
    """What a rule naming no method asks for, given the form the checkpoint stores its experts in
    (engines/checkpoints/source.py): an FP8 release's own method, whose kernel reads the blocks as they are,
    else DEFAULT_METHOD."""
    return "FP8" if stored_form == "fp8_blocks" else DEFAULT_METHOD

# When a rule asks for a method this build lacks, the candidates in order: the first that runs here, fits the
# model's sizes and whose experts fit in memory serves (else the most compact that runs). Measured with
# `python -m bench.expert_methods` under the avx2 build (the only build without AMX* classes): BF16 is the
# fastest kernel there (FP8 and RAWINT4 convert every weight in software: 8x and 4x slower than BF16 per call),
# so an 8-bit rule gets BF16 when its experts fit in memory, then the 8-bit LLAMAFILE (Q8_0) and FP8 kernels;
# a 4-bit rule keeps 4 bits (RAWINT4), the reason to ask for INT4 being memory.
FALLBACKS: dict[str, tuple[str, ...]] = {
    "AMXINT8": ("BF16", "LLAMAFILE", "FP8"),
    "AMXINT4": ("RAWINT4", "BF16"),
    "FP8": ("AMXINT8", "BF16", "LLAMAFILE"),
    "RAWINT4": ("AMXINT4", "BF16"),
    "BF16": (),
    "LLAMAFILE": ("BF16", "FP8"),
    "MXFP4": ("FP8",),
}
MEMORY_HEADROOM = 0.9  # of MemAvailable the routed experts may take
# The kt-kernel classes that keep reading the weight tensors they were given, for as long as they live; every other
# class quantizes or packs them into buffers of its own while loading, after which those tensors may be freed.
# Checked with kt-kernel 0.7.2 by zeroing the tensors after the load and computing again (the avx512_bf16 and
# avx2 builds; the amx build's classes are those of the avx512 ones): tests/engines/kt/experts/test_kt_experts_cpu.py.
READS_IN_PLACE = frozenset({"AVX2RawInt4_MOE", "MOE"})


def matrix_tokens(num_experts: int, top_k: int) -> int:
    """The fewest tokens of a call that kt-kernel's AMX-family MoE kernels (classes named AMX*) compute with
    their matrix kernels.

    Up to 4 x experts / top_k tokens (42 for V2-Lite's 64 experts, 6 a token) they take a vector path whose cost
    grows with every token an expert gets, as if each token read the expert's weights again; above it, matrix
    kernels that read each chosen expert once for all its tokens. Rows whose experts are all -1 count as tokens
    for that choice and cost nothing else (kt-kernel skips expert -1), so a call can be padded across it."""
    return 4 * num_experts // top_k + 1


def default_pad_from(method: str, num_experts: int, top_k: int) -> int:
    """The fewest tokens from which a call of `method` goes padded to `matrix_tokens` by default; 0: never.

    Measured on the amx build only (`python -m bench.expert_padding`; the figures: docs/performance.md, "Many
    streams"). Where the gain starts is a matter of tokens per expert (the vector path's cost follows tokens x
    top_k, the matrix path's the experts chosen), hence `pad_ratio` x experts / top_k: 24, 16 and 12 tokens for
    V2-Lite. Other builds' AMX* classes run without tiles and gained nothing on the 2-core
    avx512_bf16 box, so they are padded only when asked (`kt_expert_pad_from`)."""
    ratio = METHODS[method].pad_ratio if method in METHODS else 0.0
    if not ratio or cpu_variant() != "amx":
        return 0
    return math.ceil(ratio * num_experts / top_k)


def _kernel_name(method: str) -> str:
    kernel = kernel_class(method)
    return "" if kernel is None else kernel.__name__


def reads_in_place(method: str) -> bool:
    """Whether this build's kernel for `method` reads the weights it was loaded from for as long as it lives."""
    return _kernel_name(method) in READS_IN_PLACE


def pads_to_matrix(method: str) -> bool:
    """Whether this build computes `method` with a kernel that switches at `matrix_tokens` (an AMX* class)."""
    return _kernel_name(method).startswith("AMX")


@dataclass(frozen=True, slots=True)
class ExpertShape:
    """What the fallback choice needs to know of a model's routed experts."""

    hidden_size: int
    intermediate_size: int
    params: int  # routed-expert weights of all layers (layers x experts x 3 x hidden x intermediate)

    def fits(self, method: str) -> bool:
        multiple = METHODS[method].size_multiple
        return self.hidden_size % multiple == 0 and self.intermediate_size % multiple == 0

    def nbytes(self, method: str) -> int:
        return self.params * METHODS[method].bits // 8


def memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ggml block types LLAMAFILE weights are converted to on load, and the builds that compute each correctly.
LLAMAFILE_TYPES = ("Q8_0", "BF16")
_BF16_BLOCK_VARIANTS = ("amx", "avx512_bf16")  # the avx2 build aborts with "llamafile not supported"
_EVERY_BUILD = ("amx", "avx512_bf16", "avx512_vbmi", "avx512_vnni", "avx512_base", "avx2")
# The ggml types of GGUF routed experts (ffn_*_exps) the llamafile kernel computes in place, and on which builds.
# Measured with kt-kernel 0.7.2 against the gguf package's dequantize (tests/engines/checkpoints/test_gguf_experts.py; 8
# experts, top-2, H=256, I=512, 1 and 24 tokens): the kernel quantizes activations to 8 bits, so its output differs by
# 1.2% (Q8_0, Q4_0, Q5_0) and 1.6-2.2% (Q4_K, Q5_K, Q6_K) relative to the dequantized weights on the
# avx512_bf16, avx512_vbmi, avx512_vnni, avx512_base and avx2 builds; BF16 by 0.2% on avx512_bf16, while the
# other avx512 builds return garbage (135%) and avx2 aborts. IQ4_XS gave 2.7-7.1% on every build, more than
# its 4 bits explain next to Q4_K's: it is converted at load. The amx build, not measured here, is taken to
# behave as avx512_bf16, whose llamafile code it shares. Types absent here are converted at load.
LLAMAFILE_IN_PLACE: dict[str, tuple[str, ...]] = {
    "Q8_0": _EVERY_BUILD, "Q4_0": _EVERY_BUILD, "Q5_0": _EVERY_BUILD,
    "Q4_K": _EVERY_BUILD, "Q5_K": _EVERY_BUILD, "Q6_K": _EVERY_BUILD,
    "BF16": _BF16_BLOCK_VARIANTS,
}
# Bits per weight of ggml types (the block's bytes x 8 / its values), for choosing the conversion method.
GGML_BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8.5, "Q6_K": 6.56, "Q5_0": 5.5, "Q5_1": 6, "Q5_K": 5.5,
             "Q4_0": 4.5, "Q4_1": 5, "Q4_K": 4.5, "IQ4_XS": 4.25, "IQ4_NL": 4.5}


def llamafile_computes(ggml_type: str) -> bool:
    """Whether this process's kt-kernel build computes GGUF experts of `ggml_type` correctly in place."""
    return cpu_variant() in LLAMAFILE_IN_PLACE.get(ggml_type, ())


class ExpertsUnsupportedError(ValueError):
    """The requested experts method cannot run with this CPU and kt-kernel build."""


def _moe_module() -> Any | None:
    try:
        return load_ext().moe
    except ImportError:
        return None


def cpu_variant() -> str:
    """The kt-kernel build this process loaded ("amx", "avx512_bf16", ..., "avx2"), or "none"."""
    if _moe_module() is None:
        return "none"
    import kt_kernel

    return str(getattr(kt_kernel, "__cpu_variant__", "unknown"))


def kernel_class(method: str) -> type | None:
    moe = _moe_module()
    if moe is None or method not in METHODS:
        return None
    return next((getattr(moe, n) for n in METHODS[method].kernels if hasattr(moe, n)), None)


def sft_kernel_class(method: str) -> type | None:
    """kt-kernel's expert-LoRA kernel for `method` in this build, or None (then LoRA runs in torch)."""
    moe, name = _moe_module(), METHODS[method].sft_kernel if method in METHODS else None
    return getattr(moe, name, None) if moe is not None and name else None


def unavailable_reason(method: str) -> str | None:
    """None when `method` runs here, else why not."""
    if method not in METHODS:
        return f"unknown method; known: {', '.join(METHODS)}"
    if _moe_module() is None:
        return "kt-kernel is not installed or does not load on this CPU"
    if kernel_class(method) is None:
        return f"kt-kernel's {cpu_variant()} build has none of {', '.join(METHODS[method].kernels)}"
    return None


def available_methods() -> list[str]:
    return [m for m in METHODS if unavailable_reason(m) is None]


def check_llamafile_type(ggml_type: str) -> None:
    if ggml_type not in LLAMAFILE_TYPES:
        raise ValueError(f"llamafile_type {ggml_type!r} is not one of {', '.join(LLAMAFILE_TYPES)}")
    if ggml_type == "BF16" and cpu_variant() not in _BF16_BLOCK_VARIANTS:
        raise ExpertsUnsupportedError(
            f"llamafile_type BF16 needs kt-kernel's amx or avx512_bf16 build; this CPU runs the {cpu_variant()} "
            "build, whose llamafile kernel has no BF16 path (use Q8_0 blocks, or method BF16)")


@dataclass(frozen=True, slots=True)
class MethodChoice:
    """The method that serves, the one that was asked for, and why they differ (empty when they don't)."""

    method: str
    requested: str
    reason: str = ""

    def describe(self) -> dict[str, str]:
        return {"experts_method": self.method, "experts_method_requested": self.requested,
                "cpu_variant": cpu_variant(), **({"experts_method_reason": self.reason} if self.reason else {})}


def choose_method(requested: str | None, *, explicit: str | None = None, source: str = "the rule file",
                  shape: ExpertShape | None = None) -> MethodChoice:
    """The method experts run with.

    `explicit` (the `kt_method` setting) must run here, or ExpertsUnsupportedError names the key, this
    build and the methods that do run. Otherwise the rule's `requested` method (DEFAULT_METHOD when the
    rule names none) is kept when it runs here, and replaced by the first of its FALLBACKS that runs, fits
    `shape`'s sizes and whose experts fit in memory when not (the most compact runnable one if none fits)."""
    if explicit:
        method = normalize_method(explicit, "kt_method")
        reason = unavailable_reason(method)
        if reason is not None:
            raise ExpertsUnsupportedError(
                f"kt_method {method}: {reason}. This CPU runs kt-kernel's {cpu_variant()} build, which runs: "
                f"{', '.join(available_methods()) or 'none'} (leave kt_method unset to let the rules choose)")
        return MethodChoice(method, method)
    wanted = normalize_method(requested or DEFAULT_METHOD, "method")
    reason = unavailable_reason(wanted)
    if reason is None and shape is not None and not shape.fits(wanted):
        reason = (f"the experts' sizes ({shape.hidden_size}, {shape.intermediate_size}) are not multiples of "
                  f"{METHODS[wanted].size_multiple}")
    if reason is None:
        return MethodChoice(wanted, wanted)
    runnable = [m for m in FALLBACKS.get(wanted, ()) if unavailable_reason(m) is None
                and (shape is None or shape.fits(m))]
    if not runnable:
        raise ExpertsUnsupportedError(f"experts method {wanted} (from {source}): {reason}, and no replacement runs "
                                      f"here (available: {', '.join(available_methods()) or 'none'})")
    budget = memory_available()
    fitting = [m for m in runnable if shape is None or budget is None or shape.nbytes(m) <= budget * MEMORY_HEADROOM]
    method = fitting[0] if fitting else min(runnable, key=lambda m: METHODS[m].bits)
    why = "the fastest replacement" if fitting else "the most compact replacement (none fits in memory)"
    return MethodChoice(method, wanted, f"{source} asks for {wanted}, but {reason}; {method} is {why} it runs")


def choose_gguf_method(types: set[str], *, explicit: str | None = None,
                       shape: ExpertShape | None = None) -> MethodChoice:
    """The method a GGUF checkpoint's routed experts run with: LLAMAFILE, reading the file's blocks, where this
    build computes every one of their `types` (LLAMAFILE_IN_PLACE) and the sizes fit; else the kt-kernel method
    of the nearest precision this build runs (AMXINT4 for types of 4-5 bits, AMXINT8 above, and their
    FALLBACKS), converted at load. `explicit` (kt_method) is obeyed as `choose_method` obeys it."""
    if explicit:
        return choose_method(None, explicit=explicit)
    listed = "/".join(sorted(types))
    slow = sorted(t for t in types if not llamafile_computes(t))
    fits = shape is None or shape.fits("LLAMAFILE")
    if not slow and fits and unavailable_reason("LLAMAFILE") is None:
        return MethodChoice("LLAMAFILE", "LLAMAFILE")
    wanted = "AMXINT4" if max(GGML_BITS.get(t, 16) for t in types) <= 5 else "AMXINT8"
    choice = choose_method(wanted, source=f"GGUF {listed} experts", shape=shape)
    why = (f"kt-kernel's {cpu_variant()} llamafile kernel does not compute {'/'.join(slow)} in place" if slow
           else f"the llamafile kernel needs sizes that are multiples of {METHODS['LLAMAFILE'].size_multiple}")
    detail = f" ({choice.reason})" if choice.reason else ""
    return MethodChoice(choice.method, "LLAMAFILE", f"{why}: {listed} experts are converted at load to "
                                                    f"{choice.method}{detail}")


_SPELLINGS = {"AMXINT8": "AMXINT8", "AMXINT4": "AMXINT4", "AMXBF16": "BF16", "BF16": "BF16", "FP8": "FP8",
              "RAWINT4": "RAWINT4", "LLAMAFILE": "LLAMAFILE", "INT8": "AMXINT8", "INT4": "AMXINT4",
              "MXFP4": "MXFP4"}


def normalize_method(value: object, key: str) -> str:
    """A method as a user or rule file spells it (kt-kernel's or KTransformers' names, any case)."""
    method = _SPELLINGS.get(str(value).upper().replace("_", ""), None) if isinstance(value, str) else None
    if method is None:
        raise ExpertsUnsupportedError(f"{key} {value!r} is not an experts method; known: {', '.join(METHODS)}")
    return method


def best_method(bits: int) -> str:
    """The preferred runnable method with `bits`-bit weights (tests and benchmarks ask 'the 8-bit method here')."""
    return next(m for m in ("AMXINT8", "AMXINT4", "FP8", "RAWINT4", "LLAMAFILE", "BF16")
                if METHODS[m].bits == bits and unavailable_reason(m) is None)


# ----------------------------------------------------------------------------------- online quantization
def quantize_fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] -> (e4m3 bytes [rows, cols] as uint8, float32 scales [rows/128, cols/128]);
    weight ~= fp8 * scale per 128x128 block (DeepSeek-V3's `weight_scale_inv` layout)."""
    quant, scale = quantize_blocks(weight, (FP8_BLOCK, FP8_BLOCK))
    return quant.view(torch.uint8).contiguous(), scale.contiguous()


def quantize_int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] -> (packed uint8 [rows, cols/2], bf16 scales [rows, cols/32]); symmetric int4 per group
    of 32 along a row, stored as value + 8, two per byte, the earlier column in the low nibble."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // INT4_GROUP, INT4_GROUP)
    scale = (groups.abs().amax(-1, keepdim=True) / 7).clamp_min(1e-12).bfloat16().float()
    nibbles = (torch.clamp(torch.round(groups / scale), -8, 7) + 8).to(torch.uint8).reshape(rows, cols)
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return packed.contiguous(), scale.squeeze(-1).bfloat16().contiguous()
