"""Decode steps' routed experts computed partly on the GPU, read straight out of pinned host memory.

A decode step of a few sequences reads each chosen expert once; kt-kernel does that from DRAM at ~50 GB/s with
14 threads (`python -m bench.expert_floor`), and the GPU waits. The GPU has a path of its own to the same memory:
a kernel can read pinned host memory through PCIe (unified addressing: the host address is valid on the device),
without a copy issued from the host first, so it needs no host sync to learn which experts the router chose and
fits inside a captured CUDA graph. Measured on an H100 machine (2026-11-26, bench/results/nvidia-h100-2026-11-26-
mapped/): the kernels below read the experts at 46-47 GB/s (50-51 since `down` reads longer rows), and
kt-kernel computing half of a token's experts meanwhile slowed by 9% (0.55 -> 0.60 ms a V2-Lite layer), so both
sides together read ~90 GB/s where kt-kernel alone reads ~50.

The GPU reads int8 copies of a layer's first experts (`HostExperts`, engines/kt/experts/host_copies.py), int4 ones for
4-bit methods (the same kernels, compiled apart for that form, unpack them and read their group scales beside them),
and DeepSeek-V4's MXFP4 experts as released (`HostExperts.mxfp4_of`: compiled apart again, they decode each E2M1 pair
and its UE8M0 group code, and clamp the SwiGLU inputs at the layer's `swiglu_limit`). By
default (`kt_gpu_read_experts`, `owned_experts`) those experts are the GPU's alone: kt-kernel is built over the others,
so host memory holds one copy of each expert, and every call computes them on the GPU (here up to `MAX_TOKENS` tokens,
through the streamer's ring above). Where the copies are extra ones for streamed prompt chunks
(`kt_gpu_prefill_tokens`), calls of up to `MAX_TOKENS` tokens read a share of them here instead (`decode_experts`). Two
Triton kernels per layer: gate and up (with SiLU) per (expert, block of rows), then down per (expert, block of
outputs), each skipping experts no token chose, each reading an expert's rows once for all the tokens that chose it;
the outputs of a token's routing slots are summed in a fixed order (deterministic).

With `kt_gpu_resident_experts` the first of the GPU's experts lie in its own memory instead (`resident_experts`):
the kernels take a second base pointer and read experts below that count from it, the others through PCIe, so a
token's bytes from host DRAM shrink by what moved.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from engines.kt.experts.methods import METHODS
from engines.kt.experts.host_copies import (CPU_EXPERT_BYTES_PER_S, INT4_GROUP, HostExperts, copy_bits,
                                           expert_copy_bytes)

log = logging.getLogger("ktserve.engine.kt")

# Calls of up to this many tokens (decode steps, short chunks) go through the kernels, longer ones through the
# streamer's ring (engines/kt/experts/streaming.py). The kernels are bound by reading the experts, so a call of 128
# tokens costs them what one of 64 does (H100 machine, 2026-11-27, `python -m bench.mapped_experts --tokens 64,128`
# with this at 128, every V2-Lite expert on the GPU: AMXINT4's int4 copies 6.70 / 6.57 ms a layer, AMXINT8's int8
# 10.94 / 11.34), while the ring's per-expert matrix products from Python and its host sync per layer made a
# 128-token chunk slower split than in kt-kernel alone (the cached-prefix TTFT, 1,920 of 2,048 tokens cached, with
# AMXINT4: 0.216 s split through the ring, 0.169 s all in kt-kernel, 0.122 s split through the kernels).
MAX_TOKENS = 128
# MXFP4 copies go through the kernels this many tokens at a time. Triton 3.6's build of their form for blocks of
# 64 tokens and more reads out of range (H200 machine, 2026-11-28: compute-sanitizer reports "Out-of-range shared
# or local address" in gate_up, sums off by 1e3 at V4's tiny dimensions, an illegal access at V4-Flash's), while
# blocks of 16 and 32 match the float32 reference (tests/engines/kt/families/deepseek_v4/test_v4_gpu.py). A call of 64
# or 128 tokens (a prompt's tail) then reads the experts two or four times; decode steps of up to 32 sequences, once.
MXFP4_TOKENS = 32
# The kernels' read rate, alone, H100 machine, 2026-11-26: 50.3-51.0 GB/s for each kernel at 1 and 16 tokens
# (bench/results/nvidia-h100-2026-11-26-fork/tune/; a host-issued copy read 53.9-54.3 GB/s on such machines). Every
# share below is weighed with it, as kt-kernel's side is with its own rate alone (CPU_EXPERT_BYTES_PER_S).
GPU_READ_BYTES_PER_S = 50e9
# MXFP4 experts (V4's, as released; the GPU reads the same bytes), H200 machine with AMX, 2026-11-28,
# `python -m bench.mapped_experts --shape v4-flash` (bench/results/nvidia-h200-2026-11-28-v4-share/): one token's
# six experts of a V4-Flash layer (80.2 MB) took kt-kernel's MXFP4 kernel alone 2.142 ms (37.4 GB/s; calls of 2-8
# tokens read at 22-26 GB/s), the kernels alone 48.3 GB/s. Their balance, 144 of 256 experts, sits in the flat
# optimum measured there at one token (96-160: 1.38-1.39 ms a layer, against 2.14 with kt-kernel alone).
MXFP4_CPU_BYTES_PER_S = 37.4e9
MXFP4_GPU_READ_BYTES_PER_S = 48.3e9


def decode_experts(num_experts: int, held: int, cpu_bytes_per_expert: float, gpu_bytes_per_expert: float,
                   gpu_bytes_per_s: float = GPU_READ_BYTES_PER_S, cpu_bytes_per_s: float = CPU_EXPERT_BYTES_PER_S
                   ) -> int:
    """How many of a layer's experts (the first ones, at most `held`) the GPU reads from host memory in a decode
    step, so that both readers take about as long: each side's time grows with the experts it owns."""
    cpu = cpu_bytes_per_expert / cpu_bytes_per_s
    gpu = gpu_bytes_per_expert / gpu_bytes_per_s
    return max(0, min(held, round(num_experts * cpu / (cpu + gpu))))


def _mxfp4_balance(num_experts: int, held: int) -> int:
    """decode_experts for MXFP4 experts: both readers read the same bytes, each at its measured rate."""
    return decode_experts(num_experts, held, 1.0, 1.0, MXFP4_GPU_READ_BYTES_PER_S, MXFP4_CPU_BYTES_PER_S)


def default_read_share(method: str, num_experts: int, held: int, hidden: int, intermediate: int) -> int:
    """How many of the `held` copies (the first experts) a decode call reads on the GPU where kt_gpu_read_experts
    is unset and the copies are there anyway (streamed prompts keep them): the two readers' balance, each at its
    own measured rate (int8 / int4 copies against kt-kernel's 8- and 4-bit forms; MXFP4 copies, the same bytes
    kt-kernel reads, at MXFP4's rates)."""
    spec = METHODS[method]
    if spec.weights == "mxfp4":
        return _mxfp4_balance(num_experts, held)
    return decode_experts(num_experts, held, 3 * hidden * intermediate * spec.bits / 8,
                          expert_copy_bytes(hidden, intermediate, copy_bits(spec.bits)))


# Methods whose kt-kernel classes computed every count of experts tried (8-40, odd ones included; code/expert_counts.py
# in bench/results/nvidia-h100-2026-11-26-mapped/, avx512_bf16 and avx2 builds); the avx512_bf16 build's RAWINT4
# class crashed the process for some counts (33 experts of 256 x 256; 12, 13 and 20 of 128 x 64), and LLAMAFILE
# has no stream path. MXFP4 (DeepSeek-V4's released experts, whose copies are the released bytes) computed 13 and
# 9 of 20 experts of 256 x 128 on both builds (tests/engines/kt/families/deepseek_v4/test_v4_streamed_experts.py).
OWNABLE_METHODS = frozenset({"AMXINT8", "AMXINT4", "BF16", "FP8", "MXFP4"})


def copies_as_precise(method: str) -> bool:
    """Whether the GPU's copies of `method`'s experts hold what kt-kernel computes (MXFP4 as released, int8 / int4
    copies of 8- and 4-bit methods): the methods whose experts it takes by default, owned or streamed."""
    spec = METHODS[method]
    return method in OWNABLE_METHODS and (spec.weights == "mxfp4" or copy_bits(spec.bits) == spec.bits)


def owned_experts(setting: int | None, method: str, bits: int, num_experts: int, top_k: int) -> int:
    """How many of a layer's experts (the first ones) the GPU owns, computing them in every call from its copies
    (int8, or int4 for 4-bit methods: `copy_bits`) in pinned host memory instead of kt-kernel
    (`kt_gpu_read_experts`): `setting`, or where it is None the decode balance of the two readers (kt-kernel
    reading `bits`-bit experts at CPU_EXPERT_BYTES_PER_S, the kernels the copies at GPU_READ_BYTES_PER_S; MXFP4
    experts, whose copies are the released bytes, at MXFP4's measured rates) for methods whose copies are as
    precise as their own form (8- and 4-bit ones and MXFP4: host memory still holds each expert once, at its size),
    none for 16-bit ones (their copies would lose precision); kt-kernel keeps at least `top_k` experts (a token's
    worth). 0 without Triton, and for methods outside OWNABLE_METHODS."""
    if method not in OWNABLE_METHODS:
        return 0
    if setting is None:
        if not copies_as_precise(method):
            return 0
        setting = (_mxfp4_balance(num_experts, num_experts) if METHODS[method].weights == "mxfp4"
                   else decode_experts(num_experts, num_experts, bits / 8, copy_bits(bits) / 8))
    if setting <= 0 or not triton_available():
        return 0
    return max(0, min(setting, num_experts - top_k))


def resident_experts(setting: int, method: str, num_experts: int, top_k: int) -> int:
    """How many of a layer's experts (the first ones) the GPU keeps in its own memory and computes in every call
    (`kt_gpu_resident_experts`): `setting`, 0 without Triton and for methods outside OWNABLE_METHODS. kt-kernel
    keeps at least `top_k` experts (a token's worth): asking for more is an error."""
    if setting <= 0 or method not in OWNABLE_METHODS or not triton_available():
        return 0
    if setting > num_experts - top_k:
        raise ValueError(f"kt_gpu_resident_experts={setting}: kt-kernel keeps at least a token's {top_k} of a layer's "
                         f"{num_experts} experts, so at most {num_experts - top_k} can stay in GPU memory")
    return setting


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or broken without a CUDA toolchain: the kernels are off
        return False
    return True


# ------------------------------------------------------------------------------ a device view of host memory
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]
_DL_CUDA = 2
_DL_DTYPES = {torch.int8: (0, 8), torch.uint8: (1, 8), torch.float32: (2, 32), torch.bfloat16: (4, 16)}


@_DELETER
def _release(_: object) -> None:  # the host tensor's owner frees the memory, not the view
    pass


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor on `device` over the same bytes as `host`, which must lie in page-locked host memory
    (cudaHostRegister'ed or pinned): with unified addressing the host address is valid on the device. The view
    keeps `host` alive; reading it from a kernel reads host memory over PCIe."""
    if not host.is_contiguous() or host.dtype not in _DL_DTYPES:
        raise ValueError(f"device_view takes a contiguous {list(_DL_DTYPES)} tensor, got {host.dtype}")
    shape = (ctypes.c_int64 * host.dim())(*host.shape)
    managed = _DLManagedTensor()
    code, bits = _DL_DTYPES[host.dtype]
    managed.dl_tensor = _DLTensor(host.data_ptr(), _DLDevice(_DL_CUDA, device.index or 0), host.dim(),
                                  _DLDataType(code, bits, 1), shape, None, 0)
    managed.deleter = _release
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    view = torch.utils.dlpack.from_dlpack(new_capsule(ctypes.addressof(managed), b"dltensor", None))
    view._host_owner = (host, managed, shape)  # the struct and the host memory live as long as the view
    return view


# ------------------------------------------------------------------------------ the kernels
@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    # Each kernel is compiled once per block of tokens (BLOCK_T) and form: the token count and the resident
    # experts are left out of Triton's specialization on integer values (1, multiples of 16), which would compile
    # another variant for each kind of batch size the first time it comes (`MappedExperts.warm_up`).
    @triton.jit
    def _chosen(ids_ptr, tokens, e, K: tl.constexpr, BLOCK_T: tl.constexpr, K_P: tl.constexpr):
        """Of a call's tokens (rows of `ids_ptr`, K routing slots each): the (token, slot) pairs that chose expert
        e, the tokens that chose it, and in which slot (a token picks an expert at most once)."""
        t = tl.arange(0, BLOCK_T)
        k = tl.arange(0, K_P)
        ids = tl.load(ids_ptr + t[:, None] * K + k[None, :], mask=(t[:, None] < tokens) & (k[None, :] < K),
                      other=-1)
        hit = ids == e
        return hit, tl.sum(hit.to(tl.int32), axis=1) > 0, tl.sum(tl.where(hit, k[None, :], 0), axis=1)

    @triton.jit
    def _expert(host_ptr, resident_ptr, resident, e, size):
        """Where expert e's `size` elements start: experts below `resident` lie in GPU memory (`resident_ptr`),
        the others in host memory (`host_ptr`), numbered from `resident` there."""
        if e < resident:
            start = resident_ptr + e.to(tl.int64) * size
        else:
            start = host_ptr + (e - resident).to(tl.int64) * size
        return start

    @triton.jit
    def _slot_weights(wt_ptr, hit, K: tl.constexpr, BLOCK_T: tl.constexpr, K_P: tl.constexpr):
        """Each token's routing weight for the expert of its `hit` slot (0 for the tokens that did not choose it)."""
        t = tl.arange(0, BLOCK_T)
        k = tl.arange(0, K_P)
        return tl.sum(tl.load(wt_ptr + t[:, None] * K + k[None, :], mask=hit, other=0.0), axis=1)

    @triton.jit
    def _int4_dot(acc, xb_lo, xb_hi, packed, s_lo, s_hi):
        """acc + x . w^T over one packed block: its low nibbles are the block's first group of weights, its high
        nibbles the second, each group scaled by its own row scales."""
        lo = ((packed & 15).to(tl.int32) - 8).to(tl.bfloat16)
        hi = ((packed >> 4).to(tl.int32) - 8).to(tl.bfloat16)
        return (acc + tl.dot(xb_lo, tl.trans(lo)) * s_lo.to(tl.float32)[None, :]
                + tl.dot(xb_hi, tl.trans(hi)) * s_hi.to(tl.float32)[None, :])

    @triton.jit
    def _e2m1(nibble, scale):
        """E2M1 codes (sign, 2-bit exponent, 1-bit mantissa: 0, 0.5, 1, 1.5, 2, 3, 4, 6) times `scale`, in bf16 (exact:
        two significant bits times a power of two)."""
        n = nibble.to(tl.int32)
        e, m = (n >> 1) & 3, n & 1
        # twice the magnitude: m where e = 0 (0, 0.5), (2 + m) * 2^(e - 1) above (1, 1.5, 2, 3, 4, 6)
        twice = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0)).to(tl.float32)
        return (tl.where(n >= 8, -0.5, 0.5) * twice * scale).to(tl.bfloat16)

    @triton.jit
    def _mxfp4_dot(acc, x_even, x_odd, packed, codes):
        """acc + x . w^T over bytes of packed E2M1 pairs (the earlier column in the low nibble: x_even's), each
        scaled by its group's UE8M0 code `codes` (2^(code - 127); code 0, 2^-127, reads as 0)."""
        scale = (codes.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        return (acc + tl.dot(x_even, tl.trans(_e2m1(packed & 15, scale)))
                + tl.dot(x_odd, tl.trans(_e2m1(packed >> 4, scale))))

    # Both kernels take int8 copies (BITS = 8: rows of H or I bytes, a float32 scale per row of every held expert,
    # on the device at `s_ptr`) or 4-bit ones (BITS = 4: rows of HP / 2 or IP / 2 packed bytes, the input width
    # padded to whole blocks of 2G weights, group scales [HP / G, rows] per expert beside the weights: the resident
    # experts' at `sr_ptr`). Experts below `resident` are read from `wr_ptr` (GPU memory), the others from `w_ptr`
    # (host memory), numbered from `resident` there. MXFP4 = True: V4's released experts instead (rows of H / 2 or
    # I / 2 packed E2M1 pairs, a UE8M0 code per 32 weights of a row, [rows, H / 32] per expert, beside the weights),
    # compiled apart; CLAMP: gate clamped from above at `limit`, up to [-limit, limit], before the activation.
    @triton.jit(do_not_specialize=["tokens", "resident"])
    def gate_up(x_ptr, ids_ptr, w_ptr, wr_ptr, s_ptr, sr_ptr, resident, h_ptr, tokens, limit, H: tl.constexpr,
                HP: tl.constexpr, I: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_H: tl.constexpr, G: tl.constexpr, K_P: tl.constexpr, BITS: tl.constexpr,
                MXFP4: tl.constexpr, CLAMP: tl.constexpr):
        """h[t, k, rows] = silu(x[t] . gate[e, rows]) * (x[t] . up[e, rows]) for the tokens t that chose e
        (in their slot k)."""
        e = tl.program_id(0)
        t = tl.arange(0, BLOCK_T)
        _, chose, slot = _chosen(ids_ptr, tokens, e, K, BLOCK_T, K_P)
        if tl.max(chose.to(tl.int32), axis=0) == 0:
            return
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        rows = r < I
        acc_g = tl.zeros((BLOCK_T, BLOCK_R), tl.float32)
        acc_u = tl.zeros((BLOCK_T, BLOCK_R), tl.float32)
        if MXFP4:  # BLOCK_H bytes of a row at a time: 2 * BLOCK_H weights, even columns low, odd ones high
            base = _expert(w_ptr, wr_ptr, resident, e, 2 * I * (H // 2))
            sbase = _expert(s_ptr, sr_ptr, resident, e, 2 * I * (H // 32))
            j = tl.arange(0, BLOCK_H)
            for b0 in range(0, H // 2, BLOCK_H):
                byte = b0 + j
                inside = byte < H // 2
                x_mask = chose[:, None] & inside[None, :]
                x_even = tl.load(x_ptr + t[:, None] * H + 2 * byte[None, :], mask=x_mask, other=0.0)
                x_odd = tl.load(x_ptr + t[:, None] * H + 2 * byte[None, :] + 1, mask=x_mask, other=0.0)
                w_mask = rows[:, None] & inside[None, :]
                group = byte[None, :] // 16
                wg = tl.load(base + r[:, None] * (H // 2) + byte[None, :], mask=w_mask, other=0)
                wu = tl.load(base + (I + r[:, None]) * (H // 2) + byte[None, :], mask=w_mask, other=0)
                cg = tl.load(sbase + r[:, None] * (H // 32) + group, mask=w_mask, other=0)
                cu = tl.load(sbase + (I + r[:, None]) * (H // 32) + group, mask=w_mask, other=0)
                acc_g = _mxfp4_dot(acc_g, x_even, x_odd, wg, cg)
                acc_u = _mxfp4_dot(acc_u, x_even, x_odd, wu, cu)
        elif BITS == 8:
            base = _expert(w_ptr, wr_ptr, resident, e, 2 * I * H)
            for h0 in range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                inside = cols < H
                xb = tl.load(x_ptr + t[:, None] * H + cols[None, :], mask=chose[:, None] & inside[None, :],
                             other=0.0)
                w_mask = rows[:, None] & inside[None, :]
                wg = tl.load(base + r[:, None] * H + cols[None, :], mask=w_mask, other=0).to(tl.bfloat16)
                wu = tl.load(base + (I + r[:, None]) * H + cols[None, :], mask=w_mask, other=0).to(tl.bfloat16)
                acc_g += tl.dot(xb, tl.trans(wg))
                acc_u += tl.dot(xb, tl.trans(wu))
            acc_g *= tl.load(s_ptr + e * (2 * I) + r, mask=rows, other=0.0)[None, :]
            acc_u *= tl.load(s_ptr + e * (2 * I) + I + r, mask=rows, other=0.0)[None, :]
        else:
            base = _expert(w_ptr, wr_ptr, resident, e, 2 * I * HP // 2)
            sbase = _expert(s_ptr, sr_ptr, resident, e, HP // G * 2 * I)
            j = tl.arange(0, G)
            for h0 in range(0, HP, 2 * G):
                lo_in, hi_in = h0 + j < H, h0 + G + j < H
                x_lo = tl.load(x_ptr + t[:, None] * H + (h0 + j)[None, :], mask=chose[:, None] & lo_in[None, :],
                               other=0.0)
                x_hi = tl.load(x_ptr + t[:, None] * H + (h0 + G + j)[None, :],
                               mask=chose[:, None] & hi_in[None, :], other=0.0)
                byte = h0 // 2 + j
                wg = tl.load(base + r[:, None] * (HP // 2) + byte[None, :], mask=rows[:, None], other=8)
                wu = tl.load(base + (I + r[:, None]) * (HP // 2) + byte[None, :], mask=rows[:, None], other=8)
                g0 = h0 // G
                acc_g = _int4_dot(acc_g, x_lo, x_hi, wg, tl.load(sbase + g0 * 2 * I + r, mask=rows, other=0.0),
                                  tl.load(sbase + (g0 + 1) * 2 * I + r, mask=rows, other=0.0))
                acc_u = _int4_dot(acc_u, x_lo, x_hi, wu, tl.load(sbase + g0 * 2 * I + I + r, mask=rows, other=0.0),
                                  tl.load(sbase + (g0 + 1) * 2 * I + I + r, mask=rows, other=0.0))
        if CLAMP:
            acc_g = tl.minimum(acc_g, limit)
            acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(h_ptr + (t[:, None] * K + slot[:, None]) * I + r[None, :], act.to(tl.bfloat16),
                 mask=chose[:, None] & rows[None, :])

    @triton.jit(do_not_specialize=["tokens", "resident"])
    def down(h_ptr, ids_ptr, wt_ptr, w_ptr, wr_ptr, s_ptr, sr_ptr, resident, part_ptr, tokens, H: tl.constexpr,
             I: tl.constexpr, IP: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr,
             BLOCK_I: tl.constexpr, G: tl.constexpr, K_P: tl.constexpr, BITS: tl.constexpr, MXFP4: tl.constexpr):
        """part[t, k, outs] = weight(t, k) * (h[t, k] . down[e, outs]) for the tokens t that chose e in slot k
        (the other slots stay as they were: zeros)."""
        e = tl.program_id(0)
        t = tl.arange(0, BLOCK_T)
        hit, chose, slot = _chosen(ids_ptr, tokens, e, K, BLOCK_T, K_P)
        if tl.max(chose.to(tl.int32), axis=0) == 0:
            return
        weight = _slot_weights(wt_ptr, hit, K, BLOCK_T, K_P)
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        outs = o < H
        acc = tl.zeros((BLOCK_T, BLOCK_O), tl.float32)
        row = h_ptr + (t[:, None] * K + slot[:, None]) * I
        if MXFP4:  # BLOCK_I bytes of a row at a time, as gate_up reads them
            base = _expert(w_ptr, wr_ptr, resident, e, H * (I // 2))
            sbase = _expert(s_ptr, sr_ptr, resident, e, H * (I // 32))
            j = tl.arange(0, BLOCK_I)
            for b0 in range(0, I // 2, BLOCK_I):
                byte = b0 + j
                inside = byte < I // 2
                h_mask = chose[:, None] & inside[None, :]
                h_even = tl.load(row + 2 * byte[None, :], mask=h_mask, other=0.0)
                h_odd = tl.load(row + 2 * byte[None, :] + 1, mask=h_mask, other=0.0)
                w_mask = outs[:, None] & inside[None, :]
                wd = tl.load(base + o[:, None] * (I // 2) + byte[None, :], mask=w_mask, other=0)
                codes = tl.load(sbase + o[:, None] * (I // 32) + byte[None, :] // 16, mask=w_mask, other=0)
                acc = _mxfp4_dot(acc, h_even, h_odd, wd, codes)
        elif BITS == 8:
            base = _expert(w_ptr, wr_ptr, resident, e, H * I)
            for i0 in range(0, I, BLOCK_I):
                cols = i0 + tl.arange(0, BLOCK_I)
                inside = cols < I
                hb = tl.load(row + cols[None, :], mask=chose[:, None] & inside[None, :], other=0.0)
                wd = tl.load(base + o[:, None] * I + cols[None, :], mask=outs[:, None] & inside[None, :],
                             other=0).to(tl.bfloat16)
                acc += tl.dot(hb, tl.trans(wd))
            acc *= tl.load(s_ptr + e * H + o, mask=outs, other=0.0)[None, :]
        else:
            base = _expert(w_ptr, wr_ptr, resident, e, H * IP // 2)
            sbase = _expert(s_ptr, sr_ptr, resident, e, IP // G * H)
            j = tl.arange(0, G)
            for i0 in range(0, IP, 2 * G):
                lo_in, hi_in = i0 + j < I, i0 + G + j < I
                h_lo = tl.load(row + (i0 + j)[None, :], mask=chose[:, None] & lo_in[None, :], other=0.0)
                h_hi = tl.load(row + (i0 + G + j)[None, :], mask=chose[:, None] & hi_in[None, :], other=0.0)
                wd = tl.load(base + o[:, None] * (IP // 2) + (i0 // 2 + j)[None, :], mask=outs[:, None], other=8)
                g0 = i0 // G
                acc = _int4_dot(acc, h_lo, h_hi, wd, tl.load(sbase + g0 * H + o, mask=outs, other=0.0),
                                tl.load(sbase + (g0 + 1) * H + o, mask=outs, other=0.0))
        tl.store(part_ptr + (t[:, None] * K + slot[:, None]) * H + o[None, :], acc * weight[:, None],
                 mask=chose[:, None] & outs[None, :])

    @triton.jit(do_not_specialize=["rows", "cols"])
    def unpack4(q_ptr, s_ptr, out_ptr, rows, cols, HP: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr):
        """out[e, rows, :cols] = the bf16 weights of expert e's 4-bit copy: rows of HP / 2 packed bytes, scales
        [HP / G, rows] per expert (as `dequantize_int4`)."""
        e = tl.program_id(0)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        inside = r < rows
        q_base = q_ptr + e.to(tl.int64) * rows * (HP // 2)
        s_base = s_ptr + e.to(tl.int64) * (HP // G) * rows
        o_base = out_ptr + e.to(tl.int64) * rows * cols
        j = tl.arange(0, G)
        for h0 in range(0, HP, 2 * G):
            packed = tl.load(q_base + r[:, None] * (HP // 2) + (h0 // 2 + j)[None, :], mask=inside[:, None],
                             other=8)
            s_lo = tl.load(s_base + (h0 // G) * rows + r, mask=inside, other=0.0).to(tl.float32)
            s_hi = tl.load(s_base + (h0 // G + 1) * rows + r, mask=inside, other=0.0).to(tl.float32)
            lo = ((packed & 15).to(tl.int32) - 8).to(tl.float32) * s_lo[:, None]
            hi = ((packed >> 4).to(tl.int32) - 8).to(tl.float32) * s_hi[:, None]
            tl.store(o_base + r[:, None] * cols + (h0 + j)[None, :], lo.to(tl.bfloat16),
                     mask=inside[:, None] & (h0 + j < cols)[None, :])
            tl.store(o_base + r[:, None] * cols + (h0 + G + j)[None, :], hi.to(tl.bfloat16),
                     mask=inside[:, None] & (h0 + G + j < cols)[None, :])

    @triton.jit(do_not_specialize=["rows"])
    def unpack_mxfp4(q_ptr, c_ptr, out_ptr, rows, COLS: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_B: tl.constexpr):
        """out[e, rows, COLS] = the bf16 weights of expert e's MXFP4 matrix: rows of COLS / 2 packed E2M1 pairs
        (the earlier column in the low nibble), a UE8M0 code per 32 weights of a row (as engines/checkpoints/
        mxfp4.py's `dequantize`: code c is 2^(c - 127), code 0 the float32 subnormal 2^-127)."""
        e = tl.program_id(0)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        inside = r < rows
        q_base = q_ptr + e.to(tl.int64) * rows * (COLS // 2)
        c_base = c_ptr + e.to(tl.int64) * rows * (COLS // 32)
        o_base = out_ptr + e.to(tl.int64) * rows * COLS
        j = tl.arange(0, BLOCK_B)
        for b0 in range(0, COLS // 2, BLOCK_B):
            held = inside[:, None] & (b0 + j < COLS // 2)[None, :]
            packed = tl.load(q_base + r[:, None] * (COLS // 2) + (b0 + j)[None, :], mask=held, other=0)
            code = tl.load(c_base + r[:, None] * (COLS // 32) + ((b0 + j) // 16)[None, :], mask=held,
                           other=127).to(tl.int32)
            scale = tl.where(code == 0, 0x400000, code << 23).to(tl.float32, bitcast=True)
            values = tl.interleave(_e2m1(packed & 15, scale), _e2m1(packed >> 4, scale))
            c = 2 * b0 + tl.arange(0, 2 * BLOCK_B)
            tl.store(o_base + r[:, None] * COLS + c[None, :], values, mask=inside[:, None] & (c < COLS)[None, :])

    return triton, gate_up, down, unpack4, unpack_mxfp4


def dequantize_int4_into(out: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`out` [n, rows, cols] (bf16, contiguous, on a GPU) = `dequantize_int4` of each of the n experts' packed rows
    [n, rows, HP / 2] and scales [n, HP / G, rows], in one launch, with no temporaries: torch took ~7 kernels per
    matrix and expert (a V2-Lite layer at 2,048 tokens with every expert through the ring, one H200 machine: 19.7
    ms with torch's, 9.5 with this; int8 copies 11.8 on an H100)."""
    n, rows, half = packed.shape
    if out.shape[:2] != (n, rows) or not out.is_contiguous() or out.dtype != torch.bfloat16:
        raise ValueError(f"dequantize_int4_into: out {tuple(out.shape)} {out.dtype} for packed {tuple(packed.shape)}")
    triton, _, _, unpack4, _ = _kernels()
    with torch.cuda.device(out.device):
        unpack4[(n, triton.cdiv(rows, BLOCK_R))](packed.contiguous(), scale.contiguous(), out, rows, out.shape[2],
                                                 half * 2, INT4_GROUP, BLOCK_R)
    return out


def dequantize_mxfp4_into(out: torch.Tensor, packed: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """`out` [n, rows, cols] (bf16, contiguous, on a GPU) = engines/checkpoints/mxfp4.py's `dequantize` of each of
    the n experts' packed E2M1 rows [n, rows, cols / 2] and UE8M0 codes [n, rows, cols / 32], in one launch. Torch's
    ops took ~10 kernels per matrix and expert: 6 s of an 11.7 s 32k-token prompt at V4-Flash's shape, 4 layers
    (one H200 machine, 2026-12-02, `python -m bench.v4_trace --prompt 32768 --profile-prefill`)."""
    n, rows, half = packed.shape
    if (out.shape != (n, rows, 2 * half) or not out.is_contiguous() or out.dtype != torch.bfloat16
            or codes.shape != (n, rows, 2 * half // 32)):
        raise ValueError(f"dequantize_mxfp4_into: out {tuple(out.shape)} {out.dtype} for packed "
                         f"{tuple(packed.shape)} and codes {tuple(codes.shape)}")
    triton, *_, unpack_mxfp4 = _kernels()
    with torch.cuda.device(out.device):
        unpack_mxfp4[(n, triton.cdiv(rows, BLOCK_R))](packed.contiguous().view(torch.uint8),
                                                      codes.contiguous().view(torch.uint8), out, rows, 2 * half,
                                                      BLOCK_R, 64)
    return out


# Each program reads rows of BLOCK_H (gate, up) or BLOCK_I (down) contiguous bytes at a time: `down` read 42 GB/s
# with 64-byte rows and 50 with 128 (bench/results/nvidia-h100-2026-11-26-fork/tune/: every block size, warp count
# and pipeline depth tried; `gate_up` was within 1% of its best as it stands).
BLOCK_R, BLOCK_H, BLOCK_O, BLOCK_I = 32, 128, 32, 128


@dataclass(slots=True)
class _Layer:
    host: HostExperts  # kept: its memory is unpinned when it goes, and the views below would then read nothing
    gate_up: torch.Tensor  # device views of the host copies (int8, packed int4 or MXFP4): experts [resident, held)
    down: torch.Tensor
    resident: int  # experts [0, resident) lie in GPU memory (kt_gpu_resident_experts)
    resident_gate_up: torch.Tensor  # those (on the device; the host views where there are none)
    resident_down: torch.Tensor
    # int8: every held expert's row scales, on the device (a few hundred KB a layer); int4: the host experts'
    # group scales, viewed from the device as their weights are (a V3 layer's would take ~90 MB of GPU memory);
    # MXFP4: the UE8M0 codes, viewed so too
    gate_up_scale: torch.Tensor
    down_scale: torch.Tensor
    resident_gate_up_scale: torch.Tensor  # int4: the resident experts' group scales (stand-ins where none)
    resident_down_scale: torch.Tensor
    bits: int
    hidden: int
    intermediate: int
    mxfp4: bool = False  # V4's released MXFP4 weights (HostExperts.mxfp4): its UE8M0 codes viewed as its weights are
    limit: float = 0.0  # V4's swiglu_limit: gate and up clamped before the activation; 0: not clamped

    @property
    def held(self) -> int:
        return self.resident + self.host.held


class MappedExperts:
    """The GPU side of decode steps on `device`: each registered layer's host copies, viewed from the device
    (and its first experts where they lie in GPU memory), and the scratch the kernels write, per token and
    routing slot (allocated once for the largest layer, so that captured graphs keep their addresses)."""

    def __init__(self, device: torch.device):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda": the current device, as tensors name it
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.layers: dict[int, _Layer] = {}
        self._h: torch.Tensor | None = None  # bf16, [MAX_TOKENS, top_k, I] of the largest layer (V3: 4 MB)
        self._part: torch.Tensor | None = None  # float32, [MAX_TOKENS, top_k, H] of the largest layer (V3: 29 MB)
        self._top_k = 0

    @torch.no_grad()
    def warm_up(self) -> None:
        """Compile the kernels for each size of token block they take (calls of up to 16, 32, 64 and MAX_TOKENS
        tokens; MXFP4 copies' up to MXFP4_TOKENS) and each form of copies registered, before a request waits for
        it: a first compile took ~2 s on the GPU machine (the first 128-token prompt tail after start: 2.17 s instead
        of 0.11). Triton keeps them on disk for the next start."""
        shapes = {(c.bits, c.mxfp4, bool(c.limit), c.hidden, c.intermediate): layer
                  for layer, c in self.layers.items()}
        for (_, mxfp4_form, _, hidden, _), layer in shapes.items():
            tokens = 16
            while tokens <= (MXFP4_TOKENS if mxfp4_form else MAX_TOKENS):  # routed nowhere: compile, launch, return
                ids = torch.full((tokens, self._top_k), -1, dtype=torch.int64, device=self.device)
                self.compute(layer, torch.zeros(tokens, hidden, dtype=torch.bfloat16, device=self.device), ids,
                             torch.zeros(tokens, self._top_k, device=self.device), self.layers[layer].held)
                tokens *= 2

    def register(self, layer: int, host: HostExperts, top_k: int, resident: HostExperts | None = None,
                 limit: float = 0.0) -> None:
        """Read `layer`'s `host` copies from where they lie, after the first experts `resident` (on this device);
        `limit`: the layer's swiglu_limit (V4's experts clamp gate and up before the activation; 0: they do not)."""
        parts = [p for p in (resident, host) if p is not None and p.held]
        if not parts:
            raise ValueError(f"mapped experts of layer {layer}: the copies hold no expert")
        if resident is not None and resident.held and resident.gate_up.device != self.device:
            raise ValueError(f"mapped experts of layer {layer}: resident copies on {resident.gate_up.device}, "
                             f"the kernels run on {self.device}")
        if len({p.form for p in parts}) > 1:
            raise ValueError(f"mapped experts of layer {layer}: resident and host copies of different forms")
        count = resident.held if resident is not None else 0
        # a kernel reads one of the two per expert; where a layer has no experts of one kind, the other's
        # tensors stand in (never read)
        viewed = tuple(device_view(t, self.device) for t in host.tensors()) if host.held else resident.tensors()
        kept = resident.tensors() if count else viewed
        gate_up, gate_up_scale, down, down_scale = viewed
        if parts[0].form == "int8":  # the row scales of every held expert move to the device
            gate_up_scale = torch.cat([p.gate_up_scale.to(self.device) for p in parts])
            down_scale = torch.cat([p.down_scale.to(self.device) for p in parts])
        self.layers[layer] = _Layer(host, gate_up, down, count, kept[0], kept[2], gate_up_scale, down_scale,
                                    kept[1], kept[3], parts[0].bits, parts[0].hidden, parts[0].intermediate,
                                    parts[0].mxfp4, float(limit))
        self._top_k = max(self._top_k, top_k)
        h, part = MAX_TOKENS * top_k * parts[0].intermediate, MAX_TOKENS * top_k * parts[0].hidden
        if self._h is None or self._h.numel() < h or self._part.numel() < part:
            self._h = torch.empty(h, dtype=torch.bfloat16, device=self.device)
            self._part = torch.empty(part, dtype=torch.float32, device=self.device)

    @torch.no_grad()
    def compute(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                experts: int) -> torch.Tensor:
        """sum over the routed experts below `experts` of weight * expert(hidden), float32 [T, H] on the device,
        queued on the current stream without a host sync (CUDA-graph safe)."""
        tokens, top_k = topk_ids.shape
        if tokens > MAX_TOKENS:
            raise ValueError(f"mapped experts take calls of at most {MAX_TOKENS} tokens, got {tokens}")
        copy = self.layers[layer]
        if copy.mxfp4 and tokens > MXFP4_TOKENS:  # a block of each (the scratch is reused once `sum` has read it)
            return torch.cat([self.compute(layer, hidden[s:s + MXFP4_TOKENS], topk_ids[s:s + MXFP4_TOKENS],
                                           topk_weights[s:s + MXFP4_TOKENS], experts)
                              for s in range(0, tokens, MXFP4_TOKENS)])
        held, size, inter = copy.held, copy.hidden, copy.intermediate
        if not 0 < experts <= held:
            raise ValueError(f"mapped experts of layer {layer}: {experts} asked for, copies of {held} held")
        x = hidden.to(self.device, torch.bfloat16).contiguous()
        ids = topk_ids.to(self.device, torch.int64).contiguous()
        weights = topk_weights.to(self.device, torch.float32).contiguous()
        part = self._part[:tokens * top_k * size].view(tokens, top_k, size)
        part.zero_()  # the slots of experts the GPU does not own stay zero
        triton, gate_up, down, *_ = _kernels()
        block_t = max(16, triton.next_power_of_2(tokens))
        k_p = triton.next_power_of_2(top_k)
        # int8: rows as wide as the matrices, every expert's row scales at `*_scale`; int4: padded packed rows
        # (two weights a byte), the resident experts' group scales apart; MXFP4: rows of packed pairs, unpadded
        padded = copy.bits == 4 and not copy.mxfp4
        hp, ip = (copy.gate_up.shape[2] * 2, copy.down.shape[2] * 2) if padded else (size, inter)
        with torch.cuda.device(self.device):
            gate_up[(experts, triton.cdiv(inter, BLOCK_R))](
                x, ids, copy.gate_up, copy.resident_gate_up, copy.gate_up_scale, copy.resident_gate_up_scale,
                copy.resident, self._h, tokens, copy.limit, size, hp, inter, top_k, block_t, BLOCK_R, BLOCK_H,
                INT4_GROUP, k_p, copy.bits, copy.mxfp4, copy.limit > 0)
            down[(experts, triton.cdiv(size, BLOCK_O))](
                self._h, ids, weights, copy.down, copy.resident_down, copy.down_scale, copy.resident_down_scale,
                copy.resident, part, tokens, size, inter, ip, top_k, block_t, BLOCK_O, BLOCK_I, INT4_GROUP, k_p,
                copy.bits, copy.mxfp4)
        return part.sum(1)
