"""Build a DeepSeek model for the KT engine without ever holding the whole checkpoint in memory.

1. transformers builds the model on the meta device (no memory);
2. the placement rules replace modules with our operators and assign every module a device;
3. the checkpoint source (engines/checkpoints/source.py) hands over its tensors one at a time in their stored
   form, and each goes straight to its final device (FP8 weights are dequantized there, a GGUF's as they are
   read); a layer's routed experts arrive together, in their stored form, and go to kt-kernel, which reads FP8
   blocks (and a GGUF's ggml blocks, in the llamafile kernel) as they are or takes them converted to its method.
   A layer found pre-converted (kt_weight_path, or the weight cache of an earlier start) is read from there
   instead.
Peak host memory is what lives on the CPU plus one layer of experts in flight (stored form, and the converted
form when converting)."""
from __future__ import annotations

import logging
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engines.base import CheckpointStorage
from engines.checkpoints.formats import open_source
from engines.checkpoints.source import CheckpointSource, ExpertsLayer, StorageNotes, StoredTensor
from engines.kt.experts.protocol import RoutedExperts

log = logging.getLogger("ktserve.engine.kt")


class ExpertPlacer:
    """Puts each layer's routed experts into their module: from a pre-converted folder when one holds the layer
    (`converted`: kt_weight_path, read-only; then `weight_cache`), else from the checkpoint's stored form."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device_of: Any, notes: StorageNotes,
                 weight_cache: Path | None = None, converted: Path | None = None):
        self.model, self.dtype, self.device_of, self.notes = model, dtype, device_of, notes
        self.weight_cache = weight_cache  # pre-quantized experts from an earlier start, when given
        self.converted = converted

    def preload(self) -> frozenset[str]:
        """Load every experts layer a pre-converted folder holds; their names (the checkpoint's copies of them are
        then not read at all)."""
        loaded = set()
        for prefix, module in self.model.named_modules():
            if not isinstance(module, RoutedExperts):
                continue
            if self.converted is not None and module.load_converted(self.converted):
                self.notes.note("experts", f"{module.method} from kt_weight_path")
            elif self.weight_cache is not None and module.load_quantized(self.weight_cache):
                self.notes.note("experts", f"{module.method} from the weight cache")
            else:
                continue
            loaded.add(prefix)
        return frozenset(loaded)

    def place(self, experts: ExpertsLayer) -> None:
        module = self.model.get_submodule(experts.prefix)
        if isinstance(module, RoutedExperts):  # kt-kernel experts (converted here when their method asks, saved)
            self.notes.note("experts", module.load_stored(experts, cache_dir=self.weight_cache))
            return
        # experts kept as transformers' fused module (a `default` rule)
        gate, up, down = experts.dequantized()
        device = self.device_of(f"{experts.prefix}.gate_up_proj")
        set_tensor(module, "gate_up_proj", torch.cat([gate, up], dim=1), device, self.dtype)
        set_tensor(module, "down_proj", down, device, self.dtype)
        self.notes.loaded(experts.prefix + ".", experts.stored_as, self.dtype)


def set_tensor(module: nn.Module, name: str, tensor: torch.Tensor, device: str | torch.device,
               dtype: torch.dtype | None) -> None:
    """Put a checkpoint tensor into a parameter or buffer of `module`, on its final device and dtype."""
    _assign(module, name, StoredTensor(name, tensor).load(device, dtype))


def _assign(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    if name in module._buffers:
        module._buffers[name] = tensor
    else:
        module._parameters[name] = nn.Parameter(tensor, requires_grad=False)


def float32_names(model: nn.Module, strict_only: bool = False) -> re.Pattern | None:
    """The parameters transformers keeps in float32 whatever the model's dtype (the class's
    `_keep_in_fp32_modules[_strict]`: DeepSeek's router weights), as a pattern over parameter names;
    `strict_only`: only the strict list (where the other one follows a bf16 model's dtype, as V4's does)."""
    keep = [*([] if strict_only else getattr(model, "_keep_in_fp32_modules", None) or []),
            *(getattr(model, "_keep_in_fp32_modules_strict", None) or [])]
    if not keep:
        return None
    return re.compile(r"(^|\.)(" + "|".join(re.escape(k) for k in keep) + r")(\.|$)")


def load_checkpoint(model: nn.Module, source: CheckpointSource, device_of: Any, dtype: torch.dtype,
                    num_experts: int, weight_cache: Path | None = None, converted: Path | None = None
                    ) -> CheckpointStorage:
    """Stream every tensor of `source` to its place. `device_of(param_name)` gives the final device; returns the
    checkpoint's format and how each part of the model now holds it."""
    from tqdm import tqdm

    notes = StorageNotes()
    placer = ExpertPlacer(model, dtype, device_of, notes, weight_cache, converted)
    unexpected: list[str] = []
    fused_experts = []
    # kept in float32 as transformers keeps them: the router computes in float32 and would otherwise cast
    # its weight on every call (one more kernel per MoE layer and decode step on a GPU)
    float32 = float32_names(model)
    preloaded = placer.preload()
    with tqdm(total=len(getattr(source, "files", ())), desc="loading shards", unit="shard", leave=False) as bar:
        for item in source.items(num_experts, bar, skip=preloaded):
            if not isinstance(item, StoredTensor):  # a layer's routed experts
                placer.place(item)
                continue
            name = item.name
            module_name, _, attr = name.rpartition(".")
            try:
                module = model.get_submodule(module_name)
            except AttributeError:
                unexpected.append(name)
                continue
            if isinstance(module, RoutedExperts) and attr in ("gate_up_proj", "down_proj"):
                fused_experts.append((module, attr, item.load("cpu", None)))  # a checkpoint in the fused layout
                continue
            if attr not in module._parameters and attr not in module._buffers:
                unexpected.append(name)
                continue
            keep = torch.float32 if attr in module._buffers or (float32 and float32.search(name)) else dtype
            _assign(module, attr, item.load(device_of(name), keep))
            notes.loaded(name, item.stored_as, keep)
    for module in _load_fused(fused_experts):
        notes.note("experts", f"{module.method} from bf16")
    if unexpected:
        raise ValueError(f"model: {len(unexpected)} checkpoint tensors match no module of the model, e.g. "
                         f"{', '.join(unexpected[:5])}")
    return notes.report(source.format)


def _load_fused(entries: list[tuple[nn.Module, str, torch.Tensor]]) -> list[nn.Module]:
    by_module: dict[int, dict[str, Any]] = defaultdict(dict)
    for module, attr, tensor in entries:
        by_module[id(module)]["module"] = module
        by_module[id(module)][attr] = tensor
    for parts in by_module.values():
        gate_up, down = parts["gate_up_proj"], parts["down_proj"]
        gate, up = gate_up.chunk(2, dim=1)
        parts["module"].load_weights(gate, up, down)
    return [parts["module"] for parts in by_module.values()]


def missing_tensors(model: nn.Module) -> list[str]:
    names = [n for n, p in model.named_parameters() if p.is_meta]
    names += [n for n, b in model.named_buffers() if b.is_meta]
    return names


def read_layer_experts(model_path: Path, prefix: str, num_experts: int, first: int | None = None
                       ) -> tuple[torch.Tensor, ...]:
    """One layer's routed experts straight from the checkpoint, stacked as floats: gate, up [E, I, H], down
    [E, H, I] (per-expert tensors, or the fused gate_up_proj / down_proj layout; FP8 and GGUF blocks
    dequantized); with `first`, only experts [0, first) (per-expert tensors past them are not read)."""
    return open_source(model_path).layer_experts(prefix, num_experts, first).dequantized()
