"""ktserve's own routed-expert kernel for decode-sized calls (a few rows), on the CPU.

Decoding reads each chosen expert's weights once per call, so a call is bound by memory bandwidth; this kernel
streams every expert a call uses once, for all rows routed to it (gate and up fused, SwiGLU with V4's clamp,
down, the weighted sum), reading the weights in place: MXFP4 (V4's E2M1 + UE8M0 per 32), FP8 e4m3 in 128 x 128
blocks with float multipliers (V3/R1), a GGUF's ggml Q8_0 and Q4_0 blocks (fp16 scale + 32 int8 / 32 nibbles) and
Q4_K and Q6_K super-blocks (256 values: 6-bit scales and mins over 4-bit codes / int8 scales over 6-bit codes), as
the file maps them, and INT8 (per-row scales) / INT4 (bf16 scales per 32) quantized at load. The down projection may
be of another format than gate and up (a GGUF "Q4_K_M": Q4_K gate/up, Q6_K down in some layers).
A row's result is bit-identical whatever else is in the call and whatever the thread count (src/dk.c says how).

MXFP4, INT4, Q8_0, Q4_0, Q4_K and Q6_K take their dot products in integers where the CPU has them (AVX512-VNNI,
AVX-VNNI, or AVX2's byte multiply-adds): each row's activations, and its SwiGLU output, are quantized once per call
to int8 in groups of 32 with a float scale each, the four-bit codes become bytes by a table (Q8_0's signed bytes
are offset by 128, or taken by magnitude and sign; Q4_K's nibbles go in as they are, its mins by one more FMA per
group against the group's activation sum; Q6_K's 6-bit codes offset by 32, a scale per 16 columns per int32 lane),
and one float FMA per group scales the exact int32 sums (src/isa_impl.h; `activation_passes` says where). The
four-bit formats were bound by their per-weight float work, not by memory
(bench/results/nvidia-h200-2026-12-02-decode-kernel); the int8 activations add their rounding, at most half a step
(amax / 254 of the group) per element. MXFP4, whose weights are the checkpoint's own values, takes its activations
in two int8 passes (the second quantizes what the first leaves in steps of 1/256 of the first's, both in one int32
sum): ~8 bits more, twice the integer products, the same weight reads and float work. FP8 and INT8 stay in float,
as every format does on the AVX-512 half without VNNI (Q4_K's and Q6_K's blocks dequantized there per 32 columns as the gguf package's float32 reads them).

The C library is built by build.py (halves avx512-vnni, avx512, avx2-vnni, avx2, the best the CPU has chosen at
run time; KTSERVE_DECODE_KERNEL_ISA names another: avx2 forces the plain AVX2 one, avx512 the AVX-512 one without
VNNI, which computes every format in float). Where it cannot be built or loaded, `unavailable_reason()` says why
and callers keep kt-kernel. streams.py queues calls on CUDA streams."""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engines.kt.experts.decode_kernel.streams import Doorbells, StreamTask

log = logging.getLogger("ktserve.engine.kt")

FORMATS = {"mxfp4": 0, "fp8": 1, "int8": 2, "int4": 3, "q8_0": 4, "q4_0": 5, "q4_k": 6, "q6_k": 7}
# ggml block types the kernel reads in place -> its format
GGML_FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_K": "q4_k", "Q6_K": "q6_k"}
# a block's bytes (Q8_0, Q4_0: 32 values, fp16 d then the quants; Q4_K, Q6_K: super-blocks of 256, dk.h)
GGML_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_k": 144, "q6_k": 210}
GGML_BLOCK_VALUES = {"q8_0": 32, "q4_0": 32, "q4_k": 256, "q6_k": 256}
ISA_ENV = "KTSERVE_DECODE_KERNEL_ISA"
SPIN_US = 2000  # how long an idle worker spins before it sleeps (a decode step calls every layer within that)

_lib: ctypes.CDLL | None = None
_why: str | None = None
_load_lock = threading.RLock()  # shared_pool holds it while DecodePool loads the library
_pool: "DecodePool | None" = None


def _declare(lib: ctypes.CDLL) -> None:
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.dk_isa.restype = i
    lib.dk_isa_name.restype = ctypes.c_char_p
    lib.dk_force_isa.argtypes = [ctypes.c_char_p]
    lib.dk_force_isa.restype = i
    lib.dk_activation_passes.argtypes = [i]
    lib.dk_activation_passes.restype = i
    lib.dk_layer_create.argtypes = [i, i, i, i, p, f]
    lib.dk_layer_create.restype = p
    lib.dk_layer_create_mixed.argtypes = [i, i, i, i, i, p, f]
    lib.dk_layer_create_mixed.restype = p
    lib.dk_layer_destroy.argtypes = [p]
    lib.dk_pool_create.argtypes = [i, p, i]
    lib.dk_pool_create.restype = p
    lib.dk_pool_destroy.argtypes = [p]
    call = [p, p, i, i, p, i, p, p, p, i]
    lib.dk_submit.argtypes = call
    lib.dk_submit.restype = i
    lib.dk_forward.argtypes = call
    lib.dk_forward.restype = i
    lib.dk_wait.argtypes = [p]
    lib.dk_task_create.argtypes = [p, p, p, i, p, i, p, p, p, i]
    lib.dk_task_create.restype = p
    lib.dk_task_destroy.argtypes = [p]
    lib.dk_task_bind.argtypes = [p, p]
    lib.dk_task_bind.restype = i
    lib.dk_pool_watch.argtypes = [p, p]
    lib.dk_pool_watch.restype = i
    lib.dk_pool_bells.restype = i


def library() -> ctypes.CDLL | None:
    """The loaded library (built first where needed), or None: `unavailable_reason()` says why."""
    global _lib, _why
    with _load_lock:
        if _lib is not None or _why is not None:
            return _lib
        from engines.kt.experts.decode_kernel import build

        try:
            lib = ctypes.CDLL(str(build.build()))
            _declare(lib)
        except (OSError, RuntimeError, AttributeError) as exc:
            _why = f"the decode kernel could not be built or loaded ({exc}); kt-kernel serves decode calls"
            log.warning(_why)
            return None
        if lib.dk_isa() == 0:
            _why = "this CPU has neither AVX-512 nor AVX2 (or KTSERVE_DECODE_KERNEL_ISA=none); kt-kernel serves"
            log.info(_why)
            return None
        _lib = lib
        return lib


def unavailable_reason() -> str | None:
    library()
    return _why


ISAS = ("avx512-vnni", "avx512", "avx2-vnni", "avx2")  # the vector halves, best first


def isa() -> str:
    """One of ISAS, or "none": the vector half this process runs."""
    lib = library()
    return lib.dk_isa_name().decode() if lib is not None else "none"


def force_isa(name: str) -> bool:
    """Run the `name` half (one of ISAS) from now on, if this CPU has it (tests of every path in one process;
    never while a call runs). False where it cannot."""
    lib = library()
    return lib is not None and bool(lib.dk_force_isa(name.encode()))


def activation_passes(fmt: str) -> int:
    """In how many int8 passes the half this process runs takes `fmt`'s activations (and SwiGLU outputs), each
    row quantized in groups of 32, symmetric, scale amax / 127 (src/isa_impl.h, the integer path: MXFP4, INT4,
    Q8_0, Q4_0, Q4_K and Q6_K on avx512-vnni, avx2-vnni and avx2): 1, or for MXFP4 2, the second pass quantizing
    what the first leaves (v - q x scale) in steps of scale / 256, saturated to int8. 0: float dot products (no rounding). In a layer of two formats,
    gate's and up's decides for the activations, down's for the SwiGLU output."""
    lib = library()
    return max(lib.dk_activation_passes(FORMATS[fmt]), 0) if lib is not None else 0


def quantizes_activations(fmt: str) -> bool:
    """Whether `fmt`'s dot products take int8-rounded activations here (activation_passes > 0)."""
    return activation_passes(fmt) > 0


class DecodePool:
    """The kernel's own worker threads (pinned one per CPU of `cpus` when given). One per process, as kt-kernel's."""

    def __init__(self, threads: int, cpus: list[int] | None = None, spin_us: int = SPIN_US):
        lib = library()
        if lib is None:
            raise RuntimeError(unavailable_reason())
        if cpus is not None and len(cpus) < threads:
            raise ValueError(f"{threads} decode kernel threads need {threads} CPUs to pin to, got {cpus}")
        cpu_array = (ctypes.c_int * threads)(*cpus[:threads]) if cpus else None
        self.threads, self.cpus = threads, cpus[:threads] if cpus else None
        self._lib = lib
        self._handle = lib.dk_pool_create(threads, cpu_array, spin_us)
        if not self._handle:
            raise RuntimeError("the decode kernel's worker pool could not start")
        self._doorbells = None

    def doorbells(self) -> "Doorbells":
        """The cells CUDA streams start this pool's calls through (streams.py), its watcher thread started with
        the first call."""
        if self._doorbells is None:
            from engines.kt.experts.decode_kernel.streams import Doorbells

            with _load_lock:
                if self._doorbells is None:
                    self._doorbells = Doorbells(self._lib, self._handle)
        return self._doorbells

    @property
    def handle(self) -> int:
        return self._handle

    def wait(self) -> None:
        """Wait for the call `DecodeLayer.submit` started (returns at once when none runs)."""
        self._lib.dk_wait(self._handle)

    def close(self) -> None:
        if getattr(self, "_handle", None):  # a constructor that raised left none
            self._lib.dk_pool_destroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()


def shared_pool(threads: int, cpus: list[int] | None = None) -> DecodePool:
    """The process's pool, started with `threads` workers on first call (later calls get that one)."""
    global _pool
    with _load_lock:
        if _pool is None:
            _pool = DecodePool(threads, cpus)
            log.info("decode kernel (%s) worker pool started with %d threads%s", isa(), threads,
                     f", pinned to CPUs {cpus[:threads]}" if cpus else "")
        return _pool


def _u8(t: torch.Tensor) -> torch.Tensor:
    """`t` as bytes; the kernel takes a pointer per expert, so each expert's block must be contiguous (views of a
    larger copy, e.g. gate and up side by side, are read where they lie)."""
    t = t if t.dtype == torch.uint8 else t.view(torch.uint8)
    if t.device.type != "cpu" or not t[0].is_contiguous():
        raise ValueError("decode kernel weights must be CPU tensors, each expert's block contiguous")
    return t


def block_values(fmt: str) -> int:
    """What a row's length must be a multiple of in `fmt`: 256 for ggml's super-blocks (Q4_K, Q6_K), else 32."""
    return GGML_BLOCK_VALUES.get(fmt, 32)


class DecodeLayer:
    """One MoE layer's routed experts as the kernel reads them. The tensors are kept (read in place). gate and
    up are in `fmt`, down in `down_format` (None: `fmt` too)."""

    def __init__(self, fmt: str, hidden: int, inter: int, tensors: dict[str, torch.Tensor], *,
                 swiglu_limit: float = 0.0, down_format: str | None = None):
        lib = library()
        if lib is None:
            raise RuntimeError(unavailable_reason())
        down_format = fmt if down_format is None else down_format
        for f in (fmt, down_format):
            if f not in FORMATS:
                raise ValueError(f"decode kernel format {f!r} is not one of {', '.join(FORMATS)}")
        if hidden % 32 or inter % 32:
            raise ValueError(f"decode kernel sizes must be multiples of 32, got hidden {hidden}, intermediate {inter}")
        for what, k, f in (("hidden", hidden, fmt), ("intermediate", inter, down_format)):
            if k % block_values(f):
                raise ValueError(f"decode kernel: {f} rows need a multiple of {block_values(f)} values, got {what} "
                                 f"{k}")
        self.format, self.hidden, self.inter, self.swiglu_limit = fmt, hidden, inter, float(swiglu_limit)
        self.down_format = down_format
        self.tensors = tensors
        self.experts = tensors["gate"].shape[0]
        ptrs = []
        for m in ("gate", "up", "down"):
            w = tensors[m]
            s = tensors.get(f"{m}_scale", w)  # ggml blocks hold their scales: the kernel reads none beside
            ptrs += [w[e].data_ptr() for e in range(self.experts)]
            ptrs += [s[e].data_ptr() for e in range(self.experts)]
        array = (ctypes.c_int64 * len(ptrs))(*ptrs)
        self._lib = lib
        self._handle = lib.dk_layer_create_mixed(FORMATS[fmt], FORMATS[down_format], self.experts, hidden, inter,
                                                 array, self.swiglu_limit)
        if not self._handle:
            raise ValueError(f"decode kernel: layer of {self.formats} experts refused (sizes, or FP8 multipliers of "
                             f"2^8 or more)")

    @property
    def formats(self) -> str:
        """The layer's format, or gate/up's and down's as "q4_k/q6_k" where they differ."""
        return self.format if self.down_format == self.format else f"{self.format}/{self.down_format}"

    # ------------------------------------------------------------------ the formats, as checkpoints hold them
    @classmethod
    def mxfp4(cls, packed: dict[str, torch.Tensor], *, swiglu_limit: float = 0.0) -> "DecodeLayer":
        """V4's released experts: "gate"/"up"/"down" E2M1 pairs [E, n, k/2], "<m>_scale" UE8M0 [E, n, k/32]."""
        t = {m: _u8(packed[m]) for m in packed}
        E, inter, half = t["gate"].shape
        return cls("mxfp4", half * 2, inter, t, swiglu_limit=swiglu_limit)

    @classmethod
    def fp8(cls, blocks: dict[str, torch.Tensor], *, swiglu_limit: float = 0.0) -> "DecodeLayer":
        """e4m3 "gate"/"up"/"down" [E, n, k] with float32 "<m>_scale" [E, n/128, k/128] (weight_scale_inv)."""
        t = {m: (_u8(v) if not m.endswith("_scale") else v.float().contiguous()) for m, v in blocks.items()}
        E, inter, hidden = t["gate"].shape
        return cls("fp8", hidden, inter, t, swiglu_limit=swiglu_limit)

    @classmethod
    def ggml(cls, blocks: dict[str, torch.Tensor], ggml_type: str | tuple[str, str, str], *,
             swiglu_limit: float = 0.0) -> "DecodeLayer":
        """A GGUF's routed experts as its file stores them (engines/checkpoints/gguf: GGUFExperts.blocks), read in
        place: "gate"/"up"/"down" uint8 [E, rows, row bytes] of GGML_FORMATS' types, one for all three or gate's,
        up's and down's (gate and up of one type; down may differ, as a "Q4_K_M" file's Q6_K down). Q8_0 / Q4_0:
        per 32 values of a row an fp16 scale d, then Q8_0: 32 int8 q, value d x q; Q4_0: 16 bytes, the low nibbles
        values 0..15 and the high ones 16..31, value d x (q - 8). Q4_K / Q6_K: super-blocks of 256 values
        (src/dk.h), rows of a multiple of 256 values only (ggml writes no other)."""
        types = (ggml_type,) * 3 if isinstance(ggml_type, str) else tuple(ggml_type)
        for t in types:
            if t not in GGML_FORMATS:
                raise ValueError(f"decode kernel: ggml type {t!r} is not one of {', '.join(GGML_FORMATS)}")
        if len(types) != 3 or types[0] != types[1]:
            raise ValueError(f"decode kernel: gate and up must be of one ggml type, got {'/'.join(types)}")
        fmt, down_fmt = GGML_FORMATS[types[0]], GGML_FORMATS[types[2]]
        t = {m: _u8(blocks[m]) for m in ("gate", "up", "down")}
        E, inter, row = t["gate"].shape
        block, values = GGML_BLOCK_BYTES[fmt], GGML_BLOCK_VALUES[fmt]
        down_block, down_values = GGML_BLOCK_BYTES[down_fmt], GGML_BLOCK_VALUES[down_fmt]
        hidden = row // block * values
        if inter % down_values:  # ggml writes no such rows: refused before the shapes they would need
            raise ValueError(f"decode kernel: {down_fmt} rows need a multiple of {down_values} values, got "
                             f"intermediate {inter}")
        expected = {"gate": (E, inter, row), "up": (E, inter, row),
                    "down": (E, hidden, inter // down_values * down_block)}
        for m, shape in expected.items():
            if row % block or tuple(t[m].shape) != shape:
                raise ValueError(f"decode kernel: {'/'.join(types)} {m} blocks have shape {tuple(t[m].shape)}, "
                                 f"expected {shape} (gate {tuple(t['gate'].shape)}; rows of {block}-byte blocks of "
                                 f"{values} values, down's of {down_block}-byte blocks of {down_values})")
        return cls(fmt, hidden, inter, t, swiglu_limit=swiglu_limit, down_format=down_fmt)

    @classmethod
    def quantize(cls, fmt: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                 swiglu_limit: float = 0.0) -> "DecodeLayer":
        """INT8 (symmetric per row, float scales) or INT4 (symmetric per 32, bf16 scales, value + 8 two to a
        byte, the earlier column low: methods.quantize_int4_groups) from float weights gate/up [E, I, H], down
        [E, H, I]."""
        t: dict[str, torch.Tensor] = {}
        for m, w in (("gate", gate), ("up", up), ("down", down)):
            t[m], t[f"{m}_scale"] = (quantize_int8_rows if fmt == "int8" else quantize_int4_groups)(w)
        return cls(fmt, gate.shape[2], gate.shape[1], t, swiglu_limit=swiglu_limit)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weights this layer computes with, as float32 [E, ...] (the tests' reference)."""
        return tuple(dequantize(f, self.tensors[m], self.tensors.get(f"{m}_scale"))
                     for m, f in (("gate", self.format), ("up", self.format), ("down", self.down_format)))

    @property
    def nbytes_per_expert(self) -> int:
        """Bytes one expert's three matrices and their scales take: what a call reads per expert."""
        return sum(t[0].nbytes for t in self.tensors.values())

    @property
    def handle(self) -> int:
        return self._handle

    # ------------------------------------------------------------------------------------------ calls
    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, pool: DecodePool,
                out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """sum_k weights[:, k] * expert_{ids[:, k]}(x) for x [T, hidden] (bf16 or float32), ids [T, k] (-1: none),
        as [T, hidden] `out_dtype` (float32 or bf16), blocking."""
        x, ids, weights, out = self._prepare(x, ids, weights, out, out_dtype)
        rc = self._lib.dk_forward(pool.handle, self._handle, x.shape[0], ids.shape[1], x.data_ptr(),
                                  int(x.dtype == torch.bfloat16), ids.data_ptr(), weights.data_ptr(), out.data_ptr(),
                                  int(out.dtype == torch.bfloat16))
        if rc:
            raise RuntimeError(f"decode kernel call failed ({rc})")
        return out

    def submit(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, pool: DecodePool,
               out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`forward`'s call started and left running on `pool`; `pool.wait()` ends it. Returns the tensors the
        workers read and write, which must stay alive until then."""
        x, ids, weights, out = self._prepare(x, ids, weights, out, out.dtype)
        rc = self._lib.dk_submit(pool.handle, self._handle, x.shape[0], ids.shape[1], x.data_ptr(),
                                 int(x.dtype == torch.bfloat16), ids.data_ptr(), weights.data_ptr(), out.data_ptr(),
                                 int(out.dtype == torch.bfloat16))
        if rc:
            raise RuntimeError(f"decode kernel call failed ({rc})")
        return x, ids, weights, out

    def _prepare(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [tokens, {self.hidden}], got {tuple(x.shape)}")
        if x.dtype not in (torch.bfloat16, torch.float32):
            x = x.float()
        x = x.contiguous()
        ids = ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        if ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
            raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be [{x.shape[0]}, k]")
        if out is None:
            out = torch.empty(x.shape[0], self.hidden, dtype=out_dtype)
        return x, ids, weights, out

    def task(self, pool: DecodePool, tokens: torch.Tensor, top_k: int, x: torch.Tensor, ids: torch.Tensor,
             weights: torch.Tensor, out: torch.Tensor) -> "StreamTask":
        """A call over fixed (pinned) buffers, started and awaited from a CUDA stream (streams.StreamTask)."""
        from engines.kt.experts.decode_kernel.streams import StreamTask

        return StreamTask(self, pool, tokens, top_k, x, ids, weights, out)

    def close(self) -> None:
        if getattr(self, "_handle", None):
            self._lib.dk_layer_destroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()


# ----------------------------------------------------------------------------------- formats in torch
def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, n, k] float -> (int8 [E, n, k], float32 scales [E, n]): symmetric per row."""
    w = w.float()
    scale = (w.abs().amax(-1) / 127).clamp_min(1e-12)
    q = torch.clamp(torch.round(w / scale[..., None]), -127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def quantize_int4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from engines.kt.experts.methods import quantize_int4_groups as one

    parts = [one(e) for e in w]
    return torch.stack([p[0] for p in parts]).contiguous(), torch.stack([p[1] for p in parts]).contiguous()


def dequantize(fmt: str, w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """[E, n, *] weights and scales in `fmt` (ggml formats: None, the blocks hold them) -> float32 [E, n, k]."""
    from engines.checkpoints import mxfp4
    from engines.checkpoints.fp8 import dequantize_blocks

    if fmt == "mxfp4":
        return torch.stack([mxfp4.dequantize(w[e], s[e], torch.float32) for e in range(w.shape[0])])
    if fmt == "fp8":
        return torch.stack([dequantize_blocks(w[e].view(torch.float8_e4m3fn), s[e], torch.float32)
                            for e in range(w.shape[0])])
    if fmt == "int8":
        return w.view(torch.int8).float() * s[..., None]
    if fmt == "q8_0":
        b = w.view(torch.uint8).reshape(*w.shape[:-1], -1, 34)
        d = b[..., :2].contiguous().view(torch.float16).float()
        return (b[..., 2:].contiguous().view(torch.int8).float() * d).reshape(*w.shape[:-1], -1)
    if fmt == "q4_0":
        b = w.view(torch.uint8).reshape(*w.shape[:-1], -1, 18)
        d = b[..., :2].contiguous().view(torch.float16).float()
        q = torch.cat([b[..., 2:] & 0x0F, b[..., 2:] >> 4], dim=-1).float() - 8
        return (q * d).reshape(*w.shape[:-1], -1)
    if fmt in ("q4_k", "q6_k"):
        return dequantize_k_blocks(fmt, w)
    codes = w.view(torch.uint8)
    q = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(*codes.shape[:-1], -1).float() - 8
    return (q.view(*q.shape[:-1], -1, 32) * s.float()[..., None]).reshape(q.shape)


def dequantize_k_blocks(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q6_K rows [..., row bytes] -> float32 [..., values], in float32 as the gguf package rounds it
    (src/dk.h gives the layouts): Q4_K (d x sc) x q - dmin x m per sub-block of 32, Q6_K (d x scale) x (q - 32)
    per 16."""
    b = w.view(torch.uint8).reshape(*w.shape[:-1], -1, GGML_BLOCK_BYTES[fmt]).to(torch.int32)
    lead = b.shape[:-1]
    if fmt == "q4_k":
        d, dmin = (b[..., o:o + 2].to(torch.uint8).contiguous().view(torch.float16).float() for o in (0, 2))
        s = b[..., 4:16]
        low, high = s[..., 0:4], s[..., 4:8]
        sc = torch.cat([low & 63, (s[..., 8:12] & 15) | (low >> 6) << 4], dim=-1)  # sub-blocks 0..7
        mn = torch.cat([high & 63, (s[..., 8:12] >> 4) | (high >> 6) << 4], dim=-1)
        qs = b[..., 16:].reshape(*lead, 4, 1, 32)
        q = ((qs >> torch.tensor([0, 4]).view(2, 1)) & 15).reshape(*lead, 8, 32).float()
        return ((d * sc.float())[..., None] * q - (dmin * mn.float())[..., None]).reshape(*lead[:-1], -1)
    ql, qh = b[..., :128].reshape(*lead, 2, 1, 2, 32), b[..., 128:192].reshape(*lead, 2, 1, 1, 32)
    scales = b[..., 192:208].to(torch.uint8).contiguous().view(torch.int8).float()
    d = b[..., 208:210].to(torch.uint8).contiguous().view(torch.float16).float()
    # [..., half, nibble, ql half, 32]: quarter c = 2 x nibble + ql half, its qh bits 2c
    low = (ql >> torch.tensor([0, 4]).view(2, 1, 1)) & 15
    high = (qh >> torch.tensor([0, 2, 4, 6]).view(2, 2, 1)) & 3
    q = (low | high << 4).reshape(*lead, 16, 16).float() - 32
    return ((d * scales)[..., None] * q).reshape(*lead[:-1], -1)
