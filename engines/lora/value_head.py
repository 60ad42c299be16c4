"""LLaMA-Factory's reward-model value head: `value_head.safetensors` (or `value_head.bin`) holding
`v_head.summary.weight` [1, H] and `v_head.summary.bias` [1], in an adapter or a model directory."""
from __future__ import annotations

from pathlib import Path

import torch

from engines.lora.adapter import AdapterFormatError, ValueHead
from engines.lora.files import AdapterFiles

FILES = ("value_head.safetensors", "value_head.bin")
PREFIX = "v_head.summary."


def find(directory: Path, files: AdapterFiles = AdapterFiles()) -> Path | None:
    return next((directory / f for f in FILES if files.has(directory / f)), None)


def read(directory: str | Path, files: AdapterFiles = AdapterFiles()) -> ValueHead | None:
    """The value head in `directory`, or None when it has none."""
    path = find(Path(directory), files)
    if path is None:
        return None
    real = files.open_path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        tensors = load_file(str(real))
    else:
        tensors = torch.load(real, map_location="cpu", weights_only=True)
    weight = tensors.get(PREFIX + "weight")
    if weight is None or weight.dim() != 2 or weight.shape[0] != 1:
        shape = None if weight is None else list(weight.shape)
        raise AdapterFormatError(f"{path}: expected '{PREFIX}weight' of shape [1, hidden_size], got {shape}")
    return ValueHead(weight=weight.float(), bias=None if tensors.get(PREFIX + "bias") is None
                     else tensors[PREFIX + "bias"].float().reshape(1))
