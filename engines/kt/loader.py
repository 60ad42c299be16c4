"""Build a DeepSeek model for the KT engine without ever holding the whole checkpoint in memory.

1. transformers builds the model on the meta device (no memory);
2. the placement rules replace modules with our operators and assign every module a device;
3. tensors stream from the safetensors shards, one at a time, straight to their final device; a layer's
   routed experts are staged until all of them arrived and then handed to kt-kernel (which quantizes them).
Peak host memory is what lives on the CPU plus one layer of staged experts."""
from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from engines.kt.experts import RoutedExperts

log = logging.getLogger("ktserve.engine.kt")

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_files(model_path: Path) -> list[Path]:
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_path / n for n in names]
    single = model_path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_path.glob("*.safetensors"))
    if not found:
        raise ValueError(f"model: no safetensors weights in {model_path}")
    return found


def iter_tensors(files: list[Path], progress: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
        if progress is not None:
            progress.update(1)


class ExpertStager:
    """Collects one layer's per-expert tensors until the layer is complete, then loads it in one go."""

    def __init__(self, model: nn.Module, num_experts: int, dtype: torch.dtype, device_of: Any,
                 weight_cache: Path | None = None):
        self.model = model
        self.weight_cache = weight_cache  # pre-quantized experts from an earlier start, when given
        self.device_of = device_of
        self.num_experts = num_experts
        self.dtype = dtype  # for experts kept as a torch module; kt-kernel takes the checkpoint's own
        self._parts: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
        self.loaded: set[str] = set()

    def add(self, prefix: str, expert: int, which: str, tensor: torch.Tensor) -> None:
        if prefix in self.loaded or (prefix not in self._parts and self._from_cache(prefix)):
            return  # already loaded pre-quantized: the checkpoint's copy is not needed
        parts = self._parts[prefix]
        parts[which][expert] = tensor
        if all(len(parts[w]) == self.num_experts for w in ("gate_proj", "up_proj", "down_proj")):
            stacked = {w: torch.stack([parts[w][e] for e in range(self.num_experts)]) for w in parts}
            del self._parts[prefix]
            self._load(prefix, stacked["gate_proj"], stacked["up_proj"], stacked["down_proj"])

    def _from_cache(self, prefix: str) -> bool:
        module = self.model.get_submodule(prefix)
        if self.weight_cache is None or not isinstance(module, RoutedExperts):
            return False
        if module.load_quantized(self.weight_cache):
            self.loaded.add(prefix)
            return True
        return False

    def _load(self, prefix: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        module = self.model.get_submodule(prefix)
        if isinstance(module, RoutedExperts):  # kt-kernel experts (quantized here, saved for next time)
            module.load_weights(gate, up, down, cache_dir=self.weight_cache)
        else:  # experts kept as transformers' fused module (a `default` rule)
            device = self.device_of(f"{prefix}.gate_up_proj")
            set_tensor(module, "gate_up_proj", torch.cat([gate, up], dim=1), device, self.dtype)
            set_tensor(module, "down_proj", down, device, self.dtype)
        self.loaded.add(prefix)

    def incomplete(self) -> list[str]:
        return sorted(self._parts)


def set_tensor(module: nn.Module, name: str, tensor: torch.Tensor, device: str | torch.device,
               dtype: torch.dtype | None) -> None:
    """Put a checkpoint tensor into a parameter or buffer of `module`, on its final device and dtype."""
    if tensor.is_floating_point() and dtype is not None:
        tensor = tensor.to(dtype)
    tensor = tensor.to(device)
    if name in module._buffers:
        module._buffers[name] = tensor
    else:
        module._parameters[name] = nn.Parameter(tensor, requires_grad=False)


def float32_names(model: nn.Module) -> re.Pattern | None:
    """The parameters transformers keeps in float32 whatever the model's dtype (the class's
    `_keep_in_fp32_modules[_strict]`: DeepSeek's router weights), as a pattern over parameter names."""
    keep = [*(getattr(model, "_keep_in_fp32_modules", None) or []),
            *(getattr(model, "_keep_in_fp32_modules_strict", None) or [])]
    if not keep:
        return None
    return re.compile(r"(^|\.)(" + "|".join(re.escape(k) for k in keep) + r")(\.|$)")


def load_checkpoint(model: nn.Module, model_path: Path, device_of: Any, dtype: torch.dtype,
                    num_layers: int, num_experts: int, weight_cache: Path | None = None,
                    read_tensors: Callable = iter_tensors) -> None:
    """Stream every tensor to its place. `device_of(param_name)` gives the final device; `read_tensors(files,
    progress)` yields the checkpoint's (name, tensor) pairs (a family reading another format passes its own)."""
    from tqdm import tqdm

    files = checkpoint_files(model_path)
    stager = ExpertStager(model, num_experts, dtype, device_of, weight_cache)
    unexpected: list[str] = []
    fused_experts = []
    # kept in float32 as transformers keeps them: the router computes in float32 and would otherwise cast
    # its weight on every call (one more kernel per MoE layer and decode step on a GPU)
    float32 = float32_names(model)
    with tqdm(total=len(files), desc="loading shards", unit="shard", leave=False) as progress:
        for name, tensor in read_tensors(files, progress):
            layer = _LAYER_KEY.match(name)
            if layer and int(layer.group(1)) >= num_layers:
                continue  # e.g. DeepSeek-V3's multi-token-prediction layer, which serving does not use
            expert = _PER_EXPERT.match(name)
            if expert:
                stager.add(expert.group(1), int(expert.group(2)), expert.group(3), tensor)
                continue
            module_name, _, attr = name.rpartition(".")
            try:
                module = model.get_submodule(module_name)
            except AttributeError:
                unexpected.append(name)
                continue
            if isinstance(module, RoutedExperts) and attr in ("gate_up_proj", "down_proj"):
                fused_experts.append((module, attr, tensor))  # a checkpoint saved in the fused layout
                continue
            if attr not in module._parameters and attr not in module._buffers:
                unexpected.append(name)
                continue
            keep = torch.float32 if attr in module._buffers or (float32 and float32.search(name)) else dtype
            set_tensor(module, attr, tensor, device_of(name), keep)
    _load_fused(fused_experts)
    if unexpected:
        raise ValueError(f"model: {len(unexpected)} checkpoint tensors match no module of the model, e.g. "
                         f"{', '.join(unexpected[:5])}")
    if stager.incomplete():
        raise ValueError(f"model: routed experts incomplete in the checkpoint for {', '.join(stager.incomplete()[:3])}")


def _load_fused(entries: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
    by_module: dict[int, dict[str, Any]] = defaultdict(dict)
    for module, attr, tensor in entries:
        by_module[id(module)]["module"] = module
        by_module[id(module)][attr] = tensor
    for parts in by_module.values():
        gate_up, down = parts["gate_up_proj"], parts["down_proj"]
        gate, up = gate_up.chunk(2, dim=1)
        parts["module"].load_weights(gate, up, down)


def missing_tensors(model: nn.Module) -> list[str]:
    names = [n for n, p in model.named_parameters() if p.is_meta]
    names += [n for n, b in model.named_buffers() if b.is_meta]
    return names


def read_layer_experts(model_path: Path, prefix: str, num_experts: int, first: int | None = None
                       ) -> tuple[torch.Tensor, ...]:
    """One layer's routed experts straight from the checkpoint, stacked: gate, up [E, I, H], down [E, H, I]
    (per-expert tensors, or the fused gate_up_proj / down_proj layout); with `first`, only experts [0, first)
    (per-expert tensors past them are not read)."""
    count = num_experts if first is None else min(first, num_experts)
    from safetensors import safe_open

    parts: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    fused: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(Path(model_path)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if not name.startswith(prefix + "."):
                    continue
                expert = _PER_EXPERT.match(name)
                if expert and expert.group(1) == prefix:
                    if int(expert.group(2)) < count:
                        parts[expert.group(3)][int(expert.group(2))] = f.get_tensor(name)
                elif name in (f"{prefix}.gate_up_proj", f"{prefix}.down_proj"):
                    fused[name.rpartition(".")[2]] = f.get_tensor(name)
    if len(fused) == 2:
        gate, up = fused["gate_up_proj"][:count].chunk(2, dim=1)
        return gate, up, fused["down_proj"][:count]
    if any(len(parts[w]) != count for w in ("gate_proj", "up_proj", "down_proj")):
        raise ValueError(f"model: routed experts incomplete in the checkpoint for {prefix}")
    if any(t.dtype == torch.float8_e4m3fn for w in parts.values() for t in w.values()):
        raise ValueError(f"model: {prefix} is stored in FP8 blocks; re-reading base experts from an FP8 checkpoint "
                         "(expert LoRA, streamed copies over a weight cache) is not supported yet")
    return tuple(torch.stack([parts[w][e] for e in range(count)]) for w in ("gate_proj", "up_proj", "down_proj"))
