"""Putting adapters into a loaded model: LoRA wrappers replace the targeted modules the first time an
adapter needs them and stay (a wrapper with no update for the step's adapters costs one dict lookup).

`prepare` (any thread) checks the adapter against the model and moves its tensors to their devices;
`install` / `remove` (the engine thread, between steps) only swap dictionary entries."""
from __future__ import annotations

import itertools
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engines.lora import kt_manifest
from engines.lora.adapter import LoraAdapter
from engines.lora.bind import ModelTargets, bind, describe
from engines.lora.cpu_experts import CPUExperts, CPUExpertsLora
from engines.lora.modules import LoraContext, LoraLinear, RouterLora, TorchExpertsLora

_ROUTER = re.compile(r"\.mlp\.gate$")
log = logging.getLogger("ktserve.lora")


@dataclass
class PreparedAdapter:
    linears: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)
    experts: dict[int, Any] = field(default_factory=dict)  # layer -> what the experts module's install takes
    nbytes: int = 0
    expert_lora: str | None = None  # where the routed-expert LoRA runs, for /v1/models and the log


class LoraModules:
    """The LoRA wrappers of one model and the context its runner fills for each forward."""

    def __init__(self, model: nn.Module, hidden_size: int, checkpoint: Path | None = None):
        self.model = model
        self.hidden_size = hidden_size
        self.checkpoint = checkpoint  # the served checkpoint, which KT-SFT manifests are checked against
        self.context = LoraContext()
        self._wrapped: dict[str, nn.Module] = {}
        # name -> which install it is: a name unloaded and loaded again is a different adapter (prefix caching)
        self.installs: dict[str, int] = {}
        self._install_count = itertools.count(1)

    def targets(self) -> ModelTargets:
        return describe(self.model, self.hidden_size)

    def prefix_key(self, adapter: str | None) -> str:
        """What besides the tokens decides a prefix cache's pages or states: the adapter, as installed (a LoRA
        anywhere changes the residual stream, hence every later layer's cache; one loaded again is another)."""
        return "" if adapter is None else f"{adapter}\0{self.installs.get(adapter, 0)}"

    # --------------------------------------------------------------------------- any thread
    def prepare(self, adapter: LoraAdapter) -> PreparedAdapter:
        if adapter.binding is not None:
            if self.checkpoint is not None:
                kt_manifest.check(adapter.binding, self.checkpoint, adapter.path)
            else:
                log.warning("adapter %s: this runner does not know its checkpoint's files, so %s's binding to %s "
                            "is not checked", adapter.path, kt_manifest.FILE, adapter.binding.model_name_or_path)
        bind(adapter, self.targets())
        prepared = PreparedAdapter()
        for name, update in adapter.linears.items():
            weight = self.model.get_submodule(name).weight
            a, b = (t.to(weight.device, weight.dtype).contiguous() for t in (update.a, update.b))
            prepared.linears[name] = (a, b, update.scale)
            prepared.nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
        for layer, updates in adapter.experts.items():
            module = self._experts_base(layer)
            if isinstance(module, CPUExperts):  # experts in kt-kernel: engines/lora/cpu_experts.py
                prepared.experts[layer] = CPUExpertsLora.prepare(module, updates)
                sft = module.sft_kernel()
                prepared.expert_lora = (f"kt-kernel {sft[0].__name__}" if sft is not None else
                                        "torch (the LoRA'd rows, base experts in bf16)")
            else:
                prepared.expert_lora = "torch (transformers' experts)"
                device, dtype = module.gate_up_proj.device, module.gate_up_proj.dtype
                prepared.experts[layer] = {p: (u.a.to(device, dtype), u.b.to(device, dtype), u.scale)
                                           for p, u in updates.items()}
            prepared.nbytes += sum(u.a.numel() * u.a.element_size() + u.b.numel() * u.b.element_size()
                                   for u in updates.values())
        return prepared

    # --------------------------------------------------------------------------- engine thread
    def install(self, name: str, prepared: PreparedAdapter) -> None:
        self.installs[name] = next(self._install_count)
        for module_name, update in prepared.linears.items():
            self._wrapper(module_name).updates[name] = update
        for layer, update in prepared.experts.items():
            module = self._experts_base(layer)
            if isinstance(module, CPUExperts):
                if module.lora is None:
                    module.lora = CPUExpertsLora(module, self.context)
                module.lora.install(name, update)
            else:
                self._wrapper(f"model.layers.{layer}.mlp.experts").updates[name] = update

    def remove(self, name: str) -> None:
        for wrapper in self._wrapped.values():
            wrapper.updates.pop(name, None)
        for module in self.model.modules():
            if isinstance(module, CPUExperts) and module.lora is not None and module.lora.remove(name):
                module.lora = None  # the layer's base copy for expert LoRA goes with its last adapter

    # --------------------------------------------------------------------------- helpers
    def _experts_base(self, layer: int) -> nn.Module:
        module = self.model.get_submodule(f"model.layers.{layer}.mlp.experts")
        return getattr(module, "lora_base", module)

    def _wrapper(self, module_name: str) -> nn.Module:
        if module_name in self._wrapped:
            return self._wrapped[module_name]
        parent_name, _, child = module_name.rpartition(".")
        parent = self.model.get_submodule(parent_name)
        base = getattr(parent, child)
        if child == "experts":
            kind = TorchExpertsLora
        elif _ROUTER.search(module_name):
            kind = RouterLora
        else:
            kind = LoraLinear
        wrapper = kind(base, self.context)
        setattr(parent, child, wrapper)
        self._wrapped[module_name] = wrapper
        return wrapper
