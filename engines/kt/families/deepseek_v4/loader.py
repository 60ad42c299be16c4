"""Stream a released V4 checkpoint into the placed model, one tensor at a time.

FP8 projections arrive as `.weight` (float8_e4m3fn) + `.scale` (UE8M0 per 128x128 block) and are dequantized
to the model's dtype on arrival of the second of the pair. A layer's routed experts (MXFP4: packed E2M1
`.weight` + UE8M0 `.scale` per 32) are staged until the layer is complete, then handed to kt-kernel as they
are (`RoutedExpertsCPU.load_packed`, which also keeps copies of them to stream with kt_gpu_prefill_tokens), or
dequantized for another method or for a torch experts module. Peak host memory: what stays on the CPU plus one
layer's packed experts (and the streamed copies, which stay)."""
from __future__ import annotations

from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engines.checkpoints import mxfp4
from engines.checkpoints.fp8 import dequantize_blocks
from engines.checkpoints.source import checkpoint_files, iter_tensors
from engines.kt.experts.cpu import RoutedExpertsCPU
from engines.kt.families.deepseek_v4.names import EXPERT, PROJECTIONS, draft_layer_name, is_draft, module_name
from engines.kt.loader import float32_names, missing_tensors, set_tensor


class _Experts:
    """One layer's staged expert tensors: (projection, expert, "weight"|"scale") -> tensor."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.parts: dict[tuple[str, int, str], torch.Tensor] = {}

    def add(self, proj: str, expert: int, kind: str, tensor: torch.Tensor) -> bool:
        self.parts[(PROJECTIONS[proj], expert, kind)] = tensor
        return len(self.parts) == self.num_experts * 6

    def packed(self) -> dict[str, torch.Tensor]:
        out = {}
        for m in ("gate", "up", "down"):
            out[m] = torch.stack([self.parts[(m, e, "weight")] for e in range(self.num_experts)])
            out[f"{m}_scale"] = torch.stack([self.parts[(m, e, "scale")] for e in range(self.num_experts)])
        return out

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(torch.stack([mxfp4.dequantize(self.parts[(m, e, "weight")], self.parts[(m, e, "scale")])
                                  for e in range(self.num_experts)]) for m in ("gate", "up", "down"))


def load_v4_checkpoint(model: nn.Module, model_path: Path, device_of: Any, dtype: torch.dtype,
                       draft_layer: int | None = None) -> None:
    """Put every tensor the model uses in place; ValueError naming what the checkpoint lacks or has extra.
    `draft_layer`: the index the multi-token-prediction layer was appended at (engines/kt/families/deepseek_v4/
    mtp.py), whose `mtp.0.*` tensors then load as that layer's; None: they are skipped."""
    config = model.config
    layers, num_experts = config.num_hidden_layers, config.n_routed_experts
    # what transformers keeps in float32 whatever the model's dtype (hyper-connections, norms, sinks, position
    # biases); its non-strict list (the compressors' projections) follows the model's dtype, as there
    float32 = float32_names(model, strict_only=True)
    fp8_halves: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    staged: dict[int, _Experts] = {}
    unexpected: list[str] = []
    for name, tensor in iter_tensors(checkpoint_files(model_path)):
        drafts = is_draft(name)
        if drafts:  # the MTP layer: loaded only to draft with
            name = draft_layer_name(name, draft_layer) if draft_layer is not None else None
            if name is None:
                continue
        layer = _layer(name)
        if layer is not None and layer >= layers and not drafts:
            continue  # layers past config.num_hidden_layers (a model cut shorter for a benchmark)
        expert = EXPERT.match(name)
        if expert:
            stage = staged.setdefault(layer, _Experts(num_experts))
            if stage.add(expert.group(3), int(expert.group(2)), expert.group(4), tensor):
                _load_experts(model, layer, staged.pop(layer), device_of, dtype, model_path)
            continue
        if name.endswith(".scale") or tensor.dtype == torch.float8_e4m3fn:
            stem = name.rpartition(".")[0]
            fp8_halves[stem]["scale" if name.endswith(".scale") else "weight"] = tensor
            if len(fp8_halves[stem]) < 2:
                continue
            pair = fp8_halves.pop(stem)
            name, tensor = f"{stem}.weight", dequantize_blocks(pair["weight"], pair["scale"], torch.float32)
        target = module_name(name)
        if target is None or not _put(model, target, tensor, device_of, dtype, float32):
            unexpected.append(name)
    if unexpected:
        raise ValueError(f"model: {len(unexpected)} checkpoint tensors match no module of the V4 model, e.g. "
                         f"{', '.join(unexpected[:5])}")
    if fp8_halves:
        raise ValueError(f"model: FP8 weights without their .scale (or the reverse): {', '.join(list(fp8_halves)[:5])}")
    if staged:
        raise ValueError(f"model: routed experts incomplete in the checkpoint for layers {sorted(staged)}")
    missing = missing_tensors(model)
    if missing:
        raise ValueError(f"model: the checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:5])}")


def _layer(name: str) -> int | None:
    if not name.startswith("layers."):
        return None
    return int(name.split(".", 2)[1])


def _put(model: nn.Module, target: str, tensor: torch.Tensor, device_of: Any, dtype: torch.dtype,
         float32: Any) -> bool:
    module_path, _, attr = target.rpartition(".")
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        return False
    if attr not in module._parameters and attr not in module._buffers:
        return False
    if not tensor.is_floating_point():
        set_tensor(module, attr, tensor.long(), device_of(target), None)  # the hash-routing table: indices
        return True
    keep = torch.float32 if float32 is not None and float32.search(target) else dtype
    set_tensor(module, attr, tensor, device_of(target), keep)
    return True


def read_layer_experts(model_path: Path, layer: int, num_experts: int, first: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's routed experts re-read from the release and dequantized: gate, up [E, I, H], down [E, H, I]
    (with `first`, experts [0, first)). Expert LoRA computes the LoRA'd rows from these
    (engines/lora/cpu_experts.py); only this layer's tensors are read."""
    return _read_layer(model_path, layer, num_experts, first).dequantized()


def read_layer_packed(model_path: Path, layer: int, num_experts: int) -> dict[str, torch.Tensor]:
    """One layer's routed experts re-read from the release as they are stored, in `RoutedExpertsCPU.load_packed`'s
    terms ("gate", "gate_scale", ...)."""
    return _read_layer(model_path, layer, num_experts).packed()


def _read_layer(model_path: Path, layer: int, num_experts: int, first: int | None = None) -> _Experts:
    from safetensors import safe_open

    count = num_experts if first is None else min(first, num_experts)
    stage = _Experts(count)
    for path in checkpoint_files(model_path):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                match = EXPERT.match(name)
                if match and int(match.group(1)) == layer and int(match.group(2)) < count:
                    stage.add(match.group(3), int(match.group(2)), match.group(4), f.get_tensor(name))
    if len(stage.parts) != count * 6:
        raise ValueError(f"model: routed experts of layer {layer} are incomplete in {model_path}")
    return stage


def _load_experts(model: nn.Module, layer: int, stage: _Experts, device_of: Any, dtype: torch.dtype,
                  model_path: Path) -> None:
    prefix = f"model.layers.{layer}.mlp.experts"
    module = model.get_submodule(prefix)
    if isinstance(module, RoutedExpertsCPU):
        module.base_reader = partial(read_layer_experts, model_path, layer, stage.num_experts)
        module.packed_reader = partial(read_layer_packed, model_path, layer, stage.num_experts)
        if module.method == "MXFP4" and not module.gpu_experts:  # streamed, owned by the GPU, or neither
            module.load_packed(stage.packed())
        else:  # another method (converted here) or experts the GPU keeps
            module.load_weights(*stage.dequantized())
        return
    gate, up, down = stage.dequantized()  # transformers' own experts module (a `default` rule)
    set_tensor(module, "gate_up_proj", torch.cat([gate, up], dim=1), device_of(f"{prefix}.gate_up_proj"), dtype)
    set_tensor(module, "down_proj", down, device_of(f"{prefix}.down_proj"), dtype)
