"""Quantizers for the ggml block types the gguf package can read but not write (Q4_K, Q5_K, Q6_K, IQ4_XS),
and one entry point, `quantize`, for every type the writer offers. Plain per-block min/max and absmax
rounding, not llama.cpp's searched scales: valid blocks, checked by dequantizing with the gguf package,
for writing test and benchmark checkpoints."""
from __future__ import annotations

import numpy as np

QK_K = 256
_IQ4_VALUES = np.array((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), dtype=np.float32)


def quantize(values: np.ndarray, type_name: str) -> np.ndarray:
    """float rows [..., n] -> the type's blocks as uint8 rows [..., bytes] (F32/F16 stay float arrays)."""
    import gguf

    values = np.ascontiguousarray(values, dtype=np.float32)
    if type_name == "F32":
        return values
    if type_name == "F16":
        return values.astype(np.float16)
    own = _QUANTIZERS.get(type_name)
    if own is None:
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name])
    if values.shape[-1] % QK_K:
        raise ValueError(f"{type_name} needs rows that are a multiple of {QK_K} values, got {values.shape[-1]}")
    blocks = own(values.reshape(-1, QK_K))
    return blocks.reshape(*values.shape[:-1], values.shape[-1] // QK_K * blocks.shape[-1])


def _half(x: np.ndarray) -> np.ndarray:
    """x rounded to float16 (as it is stored), back as float32."""
    return x.astype(np.float16).astype(np.float32)


def _inverse(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(x == 0, 0.0, 1.0 / x).astype(np.float32)


def _asymmetric(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K's form: 8 sub-blocks of 32 with 6-bit scales and mins under an fp16 d and dmin;
    value = d * sc * q - dmin * m. Returns (d, dmin, sc, m, q)."""
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - low) / levels
    d, dmin = _half(scale.max(-1) / 63), _half(-low.min(-1) / 63)
    sc = np.clip(np.rint(scale * _inverse(d)[:, None]), 0, 63)
    m = np.clip(np.rint(-low * _inverse(dmin)[:, None]), 0, 63)
    step, offset = (d[:, None] * sc)[..., None], (dmin[:, None] * m)[..., None]
    q = np.clip(np.rint((sub + offset) * _inverse(step)), 0, levels).astype(np.uint8)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> the 12 bytes Q4_K/Q5_K keep them in."""
    head = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    mins = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    tail = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return np.concatenate([head, mins, tail], axis=1).astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 2k, 32] 4-bit values -> [n, 32k] bytes: group 2j in the low nibbles of chunk j, 2j+1 in the high."""
    pairs = q.reshape(q.shape[0], -1, 2, 32) & 15
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(q.shape[0], -1)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _asymmetric(blocks, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, m), _nibbles(q)], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _asymmetric(blocks, 31)
    high = ((q >> 4) & 1).astype(np.uint8)  # bit g of byte i: sub-block g, value i
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for g in range(8):
        qh |= high[:, g] << g
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, m), qh, _nibbles(q & 15)], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = _half(np.abs(scale).max(-1) / 127)
    sc = np.clip(np.rint(scale * _inverse(d)[:, None]), -128, 127)
    step = (d[:, None] * sc)[..., None]
    q = (np.clip(np.rint(sub * _inverse(step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    # per half of 128 values: group s (of 32) has its low nibbles in ql[(s % 2) * 32 + i] at shift 4 * (s // 2)
    # and its top two bits in qh[i] at shift 2 * s
    ql = (q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)
    ql = np.stack(ql, axis=2).reshape(q.shape[0], -1)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    return np.concatenate([ql, qh.reshape(q.shape[0], -1), sc.astype(np.int8).view(np.uint8), _f16_bytes(d)],
                          axis=1).astype(np.uint8)


def _iq4_xs(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 8, 32)
    scale = np.abs(sub).max(-1) / 127
    d = _half(scale.max(-1) / 31)
    ls = np.clip(np.rint(scale * _inverse(d)[:, None]), -32, 31)
    step = (d[:, None] * ls)[..., None]
    index = np.abs((sub * _inverse(step))[..., None] - _IQ4_VALUES).argmin(-1).astype(np.uint8)
    stored = (ls + 32).astype(np.uint8)
    scales_l = (stored[:, 0::2] & 15) | ((stored[:, 1::2] & 15) << 4)
    scales_h = np.zeros(sub.shape[0], dtype=np.uint16)
    for g in range(8):
        scales_h |= ((stored[:, g] >> 4) & 3).astype(np.uint16) << (2 * g)
    qs = (index[:, :, :16] | (index[:, :, 16:] << 4)).reshape(sub.shape[0], -1)
    return np.concatenate([_f16_bytes(d), scales_h.reshape(-1, 1).view(np.uint8), scales_l, qs], axis=1)


_QUANTIZERS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_XS": _iq4_xs}
