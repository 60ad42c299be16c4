"""MXFP4 weights (OCP microscaling FP4), as DeepSeek-V4 ships its routed experts: E2M1 values packed two
to a byte, the earlier column in the low nibble, `[n, k/2]` (int8 or uint8), with one UE8M0 multiplier per
32 consecutive weights of a row, `[n, k/32]` (float8_e8m0fnu or uint8). A value is `e2m1 * 2^(e - 127)`.
kt-kernel's MXFP4 kernels read exactly this layout (scales as bf16, which holds a power of two exactly)."""
from __future__ import annotations

import functools

import torch

from engines.checkpoints.fp8 import ue8m0_to_float

GROUP = 32
# E2M1 magnitudes by the low three bits of a nibble; bit 3 is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0


@functools.lru_cache(maxsize=None)
def _table(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # made once per device: on a GPU each new one is a copy from host memory the host waits for
    values = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return torch.cat([values, -values])


def _check(packed: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    if packed.ndim != 2 or packed.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"MXFP4 weight must be a 2-D int8/uint8 tensor of packed pairs, got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if tuple(scale.shape) != (n, k // GROUP):
        raise ValueError(f"MXFP4 scale has shape {tuple(scale.shape)}; a [{n}, {k}] weight in groups of {GROUP} "
                         f"needs [{n}, {k // GROUP}]")
    return n, k


def unpack_e2m1(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[n, k/2] packed bytes -> [n, k] E2M1 values (unscaled) in `dtype` (exact in any float dtype)."""
    codes = packed.view(torch.uint8)
    nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(codes.shape[0], -1)
    return _table(packed.device, dtype)[nibbles.int()]


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[n, k/2] packed E2M1 + [n, k/32] UE8M0 -> [n, k] in `dtype`, on packed's device (a GPU dequantizes streamed
    V4 experts so: engines/kt/experts/streaming.py). In bf16 and float32 the products are computed in `dtype`
    (exact: a power of two times an E2M1 value of at most two significant bits), others through float32."""
    n, k = _check(packed, scale)
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    values = unpack_e2m1(packed, work).view(n, k // GROUP, GROUP)
    return (values * ue8m0_to_float(scale).to(packed.device, work)[..., None]).view(n, k).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, k] float -> (packed uint8 [n, k/2], UE8M0 exponents uint8 [n, k/32]): each group's multiplier is
    the smallest power of two that brings its largest magnitude within E2M1's 6, values rounded to the
    nearest E2M1 code. For writing checkpoints in V4's layout and converting experts at load."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"MXFP4 needs rows of a multiple of {GROUP} values, got {k}")
    groups = weight.float().reshape(n, k // GROUP, GROUP)
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -126)
    exponents = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponents)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=weight.device)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1).to(torch.uint8)
    codes |= (scaled < 0).to(torch.uint8) << 3
    codes = codes.reshape(n, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), (exponents + 127).to(torch.uint8).contiguous()


def scales_as_bf16(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 exponents -> the bf16 multipliers kt-kernel's MXFP4 kernels read (exact: bf16 has 8 exponent
    bits; exponent code 0, 2^-127, is a bf16 subnormal)."""
    return ue8m0_to_float(scale).to(torch.bfloat16).contiguous()
