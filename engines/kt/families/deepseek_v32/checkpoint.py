"""Reading DeepSeek's FP8 release: each float8_e4m3fn `X.weight` comes with `X.weight_scale_inv`, one float32
multiplier per 128x128 block (engines/checkpoints/fp8.py). The loader sees ordinary weights: each pair is
dequantized as it completes (the two may sit in different shards, in either order), so the routed experts reach
kt-kernel as bf16 and are converted there to the method the rules ask for, and everything else reaches its
device in the model's dtype."""
from __future__ import annotations

from typing import Any, Iterator

import torch

from engines.checkpoints.fp8 import DEFAULT_BLOCK, dequantize_blocks

SCALE_SUFFIX = "_scale_inv"


def block_shape(config: Any) -> tuple[int, int]:
    """The FP8 block of the checkpoint's `quantization_config` (DeepSeek: 128 x 128)."""
    quant = getattr(config, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = quant.to_dict()
    block = quant.get("weight_block_size") or DEFAULT_BLOCK
    if len(block) != 2:
        raise ValueError(f"quantization_config.weight_block_size: expected two sizes, got {block!r}")
    return int(block[0]), int(block[1])


def dequantized(tensors: Iterator[tuple[str, torch.Tensor]], block: tuple[int, int] = DEFAULT_BLOCK,
                dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` with every FP8 weight and its `weight_scale_inv` replaced by the dequantized weight in `dtype`."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith(".weight" + SCALE_SUFFIX):
            weight_name = name[:-len(SCALE_SUFFIX)]
            if weight_name in weights:
                yield weight_name, _dequantize(weight_name, weights.pop(weight_name), tensor, block, dtype)
            else:
                scales[weight_name] = tensor
        elif tensor.dtype == torch.float8_e4m3fn:
            if name in scales:
                yield name, _dequantize(name, tensor, scales.pop(name), block, dtype)
            else:
                weights[name] = tensor
        else:
            yield name, tensor
    if weights:
        raise ValueError(f"model: {len(weights)} FP8 weights lack their weight{SCALE_SUFFIX} multipliers in the "
                         f"checkpoint, e.g. {', '.join(sorted(weights)[:3])}")
    if scales:
        raise ValueError(f"model: {len(scales)} weight{SCALE_SUFFIX} tensors have no FP8 weight beside them, e.g. "
                         f"{', '.join(sorted(n + SCALE_SUFFIX for n in scales)[:3])}")


def _dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                dtype: torch.dtype) -> torch.Tensor:
    try:
        return dequantize_blocks(weight, scale, dtype, block)
    except ValueError as exc:
        raise ValueError(f"model: {name}: {exc}") from None
