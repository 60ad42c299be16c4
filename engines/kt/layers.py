"""Where a model's decoder layers are, for every family: a module's layer index from its name, the device each layer
computes on, and the CUDA device scope to launch in."""
from __future__ import annotations

import contextlib
import re

import torch
from torch import nn

_LAYER = re.compile(r"layers\.(\d+)(\.|$)")


def layer_index(name: str) -> int:
    match = _LAYER.search(name)
    if match is None:
        raise ValueError(f"cannot tell the layer index of module {name!r}")
    return int(match.group(1))


def device_scope(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def layer_devices(model: nn.Module) -> list[torch.device]:
    """Where each decoder layer computes: the device of its attention's output projection."""
    return [layer.self_attn.o_proj.weight.device for layer in model.model.layers]


def attention_devices(model: torch.nn.Module) -> list[torch.device]:
    """Where each decoder layer's attention computes (transformers' `model.model.layers[i].self_attn`)."""
    return [next(layer.self_attn.parameters()).device for layer in model.model.layers]
