"""Block-scaled FP8 weights: float8_e4m3fn values with one float32 multiplier per block (128 x 128 in every
DeepSeek release). DeepSeek-V3/R1 name the multiplier `weight_scale_inv` (it is the inverse of the scale
used to quantize, so dequantizing multiplies by it); V4 names it `.scale` and stores it as UE8M0 (a power of
two kept as a biased 8-bit exponent). Both dequantize as `fp8 * multiplier` over each block."""
from __future__ import annotations

import torch

DEFAULT_BLOCK = (128, 128)


def ue8m0_to_float(exponents: torch.Tensor) -> torch.Tensor:
    """UE8M0 multipliers (uint8 or float8_e8m0fnu biased exponents) -> float32 powers of two."""
    if exponents.dtype != torch.uint8:
        exponents = exponents.view(torch.uint8)
    return torch.exp2(exponents.to(torch.float32) - 127.0)


def block_multipliers(scale: torch.Tensor) -> torch.Tensor:
    """A checkpoint's per-block multiplier tensor as float32, whichever way it is stored."""
    if scale.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
        return ue8m0_to_float(scale)
    return scale.to(torch.float32)


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                      block: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """[n, k] FP8 `weight` with `scale` of [ceil(n / bn), ceil(k / bk)] multipliers -> [n, k] in `dtype`,
    computed on the weight's device (move it to the GPU first to dequantize there)."""
    n, k = weight.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    if tuple(scale.shape) != (rows, cols):
        raise ValueError(f"FP8 block scale has shape {tuple(scale.shape)}; a [{n}, {k}] weight in {bn}x{bk} "
                         f"blocks needs [{rows}, {cols}]")
    multipliers = block_multipliers(scale).to(weight.device)
    full = multipliers.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (weight.to(torch.float32) * full).to(dtype)


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK, ue8m0: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, as DeepSeek's release tooling writes it: (float8_e4m3fn weight, per-block multipliers:
    float32, or uint8 UE8M0 exponents rounded up to a power of two when `ue8m0`). For writing test and
    benchmark checkpoints in the released layout."""
    n, k = weight.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.float()
    blocks = padded.view(rows, bn, cols, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    multipliers = amax / torch.finfo(torch.float8_e4m3fn).max
    if ue8m0:
        exponents = torch.ceil(torch.log2(multipliers)).clamp(-127, 127)
        multipliers = torch.exp2(exponents)
    q = (blocks / multipliers[:, None, :, None]).view(rows * bn, cols * bk)[:n, :k].to(torch.float8_e4m3fn)
    if ue8m0:
        return q, (exponents + 127).to(torch.uint8)
    return q, multipliers
