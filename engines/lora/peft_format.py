"""PEFT adapter directories (see the package docstring for the key layouts accepted)."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engines.lora.adapter import AdapterFormatError, ExpertLora, LoraAdapter, LoraWeight, finite
from engines.lora.files import AdapterFiles

_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.mlp\.experts)(?:\.base_layer)*$")
_PER_EXPERT = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<expert>\d+)\."
                         r"(?P<proj>gate|up|down)_proj$")
_UNSUPPORTED_OPTIONS = {"use_dora": "DoRA", "lora_bias": "LoRA bias", "fan_in_fan_out": "fan_in_fan_out"}


def normalize_key(key: str) -> str:
    """PEFT's saved key -> `<module path of the transformers model>.lora_{A,B}.weight`."""
    while key.startswith("base_model.model."):
        key = key[len("base_model.model."):]
    key = key.replace(".orig_module", "")
    return re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1.weight", key)


@dataclass(slots=True)
class Scaling:
    alpha: float
    alpha_pattern: dict[str, float]
    rslora: bool

    def scale(self, key: str, rank: int) -> float:
        alpha = self.alpha
        for pattern, value in self.alpha_pattern.items():
            if re.match(rf"(.*\.)?({pattern})$", key):
                alpha = value
                break
        return alpha / math.sqrt(rank) if self.rslora else alpha / rank


@dataclass(slots=True)
class FusedExpertLora:
    """A PEFT `target_parameters` LoRA on a fused expert parameter; which one (gate_up_proj or down_proj)
    and the rank follow from the shapes once the model's expert count and sizes are known."""

    layer: int
    prefix: str
    a: torch.Tensor  # [E * r, in]
    b: torch.Tensor  # [out, r * E]
    scaling: Scaling
    source: str

    def resolve(self, experts: int, intermediate: int, hidden: int) -> dict[str, ExpertLora]:
        rows, cols = self.a.shape
        if rows % experts or self.b.shape[1] != rows:
            raise AdapterFormatError(f"{self.source}: a fused-expert LoRA of shapes A {list(self.a.shape)}, "
                                     f"B {list(self.b.shape)} does not fit {experts} experts")
        rank = rows // experts
        a = self.a.reshape(experts, rank, cols)
        b = self.b.reshape(self.b.shape[0], rank, experts).permute(2, 0, 1).contiguous()
        if cols == hidden and b.shape[1] == 2 * intermediate:
            scale = self.scaling.scale(f"{self.prefix}.gate_up_proj", rank)
            return {"gate": ExpertLora(a, b[:, :intermediate].contiguous(), scale, self.source),
                    "up": ExpertLora(a, b[:, intermediate:].contiguous(), scale, self.source)}
        if cols == intermediate and b.shape[1] == hidden:
            return {"down": ExpertLora(a, b, self.scaling.scale(f"{self.prefix}.down_proj", rank), self.source)}
        raise AdapterFormatError(
            f"{self.source}: LoRA A {list(self.a.shape)} / B {list(self.b.shape)} fits neither experts.gate_up_proj "
            f"[{experts}, {2 * intermediate}, {hidden}] nor experts.down_proj [{experts}, {hidden}, {intermediate}] "
            f"of the base model")


@dataclass(slots=True)
class PerExpertLora:
    """transformers-4 style LoRA on `mlp.experts.{j}.{gate,up,down}_proj`, stacked once E is known."""

    layer: int
    proj: str
    weights: dict[int, LoraWeight]

    def resolve(self, experts: int, intermediate: int, hidden: int) -> dict[str, ExpertLora]:
        beyond = [j for j in self.weights if j >= experts]
        if beyond:
            raise AdapterFormatError(f"{self.weights[beyond[0]].source}: expert {beyond[0]} does not exist; the "
                                     f"base model has {experts} routed experts per layer")
        ranks = {w.a.shape[0] for w in self.weights.values()}
        rank, any_w = max(ranks), next(iter(self.weights.values()))
        a = torch.zeros(experts, rank, any_w.a.shape[1], dtype=any_w.a.dtype)
        b = torch.zeros(experts, any_w.b.shape[0], rank, dtype=any_w.b.dtype)
        for j, w in self.weights.items():  # scales folded into B: experts may differ in rank and alpha
            r = w.a.shape[0]
            a[j, :r], b[j, :, :r] = w.a, w.b * w.scale
        return {self.proj: ExpertLora(a, b, 1.0, any_w.source)}


def adapter_config(directory: Path, files: AdapterFiles = AdapterFiles()) -> dict:
    """`adapter_config.json`, its values checked: a rank or alpha that is not a positive finite number, or
    a flag that is not a boolean, is refused naming the field."""
    path = directory / "adapter_config.json"
    try:
        config = json.loads(files.open_path(path).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterFormatError(f"{path} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterFormatError(f"{path} is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterFormatError(f"{directory}: PEFT type {peft_type} is not supported; only LoRA adapters are")
    for option, name in _UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise AdapterFormatError(f"{directory}: {name} adapters ({option}: true) are not supported")
    if "r" in config and not _positive(config["r"], integer=True):
        raise AdapterFormatError(f"{path}: 'r' is {config['r']!r}; it must be a positive integer")
    alphas = {"lora_alpha": config.get("lora_alpha", 1),
              **{f"alpha_pattern.{k}": v for k, v in (config.get("alpha_pattern") or {}).items()}}
    for field, value in alphas.items():
        if not _positive(value):
            raise AdapterFormatError(f"{path}: '{field}' is {value!r}; it must be a positive finite number")
    if not isinstance(config.get("use_rslora", False), bool):
        raise AdapterFormatError(f"{path}: 'use_rslora' is {config['use_rslora']!r}; it must be true or false")
    return config


def _positive(value: object, integer: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return False
    return math.isfinite(value) and value > 0


def _tensors(directory: Path, files: AdapterFiles) -> dict[str, torch.Tensor]:
    safe, binary = directory / "adapter_model.safetensors", directory / "adapter_model.bin"
    if files.has(safe):
        from safetensors.torch import load_file
        return load_file(str(files.open_path(safe)))
    if files.has(binary):
        return torch.load(files.open_path(binary), map_location="cpu", weights_only=True)
    if files.has(directory / "fused_expert_lora.safetensors"):
        return {}
    raise AdapterFormatError(f"{directory} has adapter_config.json but no adapter_model.safetensors or "
                             f"adapter_model.bin")


def read(directory: Path, files: AdapterFiles = AdapterFiles()) -> LoraAdapter:
    config = adapter_config(directory, files)
    scaling = Scaling(float(config.get("lora_alpha", config.get("r", 8))),
                      {k: float(v) for k, v in (config.get("alpha_pattern") or {}).items()},
                      config.get("use_rslora", False))
    pairs: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    unknown: list[str] = []
    for key, tensor in _tensors(directory, files).items():
        if key.startswith("v_head."):
            continue  # a value head saved with the adapter; value_head.read looks for its own file
        finite(tensor, f"{directory}: {key}")
        match = _LORA_KEY.match(normalize_key(key))
        if match is None:
            unknown.append(key)
            continue
        pairs.setdefault(match["module"], {})[match["ab"]] = (key, tensor)
    if unknown:
        raise AdapterFormatError(f"{directory}: {len(unknown)} tensors are not LoRA A/B weights, e.g. "
                                 f"{', '.join(unknown[:5])}")
    adapter = LoraAdapter(path=str(directory), format="peft")
    per_expert: dict[tuple[int, str], PerExpertLora] = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterFormatError(f"{directory}: {next(iter(ab.values()))[0]} has no matching "
                                     f"lora_{'B' if 'A' in ab else 'A'} tensor")
        (key_a, a), (key_b, b) = ab["A"], ab["B"]
        source = key_a.replace("lora_A", "lora_{A,B}") if key_b == key_a.replace("lora_A", "lora_B") else key_a
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterFormatError(f"{source}: LoRA A {list(a.shape)} and B {list(b.shape)} do not chain")
        if fused := _FUSED_EXPERTS.match(module):
            adapter.pending.append(FusedExpertLora(int(fused["layer"]), fused["prefix"], a, b, scaling, source))
        elif single := _PER_EXPERT.match(module):
            weight = LoraWeight(a, b, scaling.scale(module, a.shape[0]), source)
            entry = per_expert.setdefault((int(single["layer"]), single["proj"]),
                                          PerExpertLora(int(single["layer"]), single["proj"], {}))
            entry.weights[int(single["expert"])] = weight
        else:
            adapter.linears[module] = LoraWeight(a, b, scaling.scale(module, a.shape[0]), source)
    adapter.pending.extend(per_expert.values())
    return adapter
