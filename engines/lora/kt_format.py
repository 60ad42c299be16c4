"""KTransformers' fused-expert LoRA: `fused_expert_lora.safetensors` beside the PEFT files of an adapter
fine-tuned with kt-kernel's SFT experts. Keys `layers.{i}.experts.{gate,up,down}_lora_{a,b}`, A `[E, r, in]`,
B `[E, out, r]` (BF16 as KT-SFT saves them); scale `lora_alpha / r` as kt-kernel's SFT kernels apply it, alpha from
KT-SFT's `kt_adapter_manifest.json` (`lora.alpha`) when there is one, else from `adapter_config.json`."""
from __future__ import annotations

import re
from pathlib import Path

from engines.lora.adapter import AdapterFormatError, ExpertLora, LoraAdapter, finite
from engines.lora.files import AdapterFiles
from engines.lora.peft_format import adapter_config

FILE = "fused_expert_lora.safetensors"
_KEY = re.compile(r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?:mlp\.)?experts\.(?P<proj>gate|up|down)_lora_(?P<ab>[ab])$")


def read_into(adapter: LoraAdapter, directory: Path, files: AdapterFiles = AdapterFiles()) -> None:
    """Add the fused-expert LoRA of `directory` (if it has one) to `adapter`."""
    path = directory / FILE
    if not files.has(path):
        return
    from safetensors.torch import load_file

    config = adapter_config(directory, files)
    parts: dict[tuple[int, str], dict[str, tuple[str, object]]] = {}
    unknown = []
    for key, tensor in load_file(str(files.open_path(path))).items():
        finite(tensor, f"{path}: {key}")
        match = _KEY.match(key)
        if match is None:
            unknown.append(key)
            continue
        parts.setdefault((int(match["layer"]), match["proj"]), {})[match["ab"]] = (key, tensor)
    if unknown:
        raise AdapterFormatError(f"{path}: {len(unknown)} tensors are not layers.N.experts.<proj>_lora_<a|b>, "
                                 f"e.g. {', '.join(unknown[:5])}")
    for (layer, proj), ab in sorted(parts.items()):
        if set(ab) != {"a", "b"}:
            raise AdapterFormatError(f"{path}: {next(iter(ab.values()))[0]} has no matching "
                                     f"{'b' if 'a' in ab else 'a'} tensor")
        (source, a), (_, b) = ab["a"], ab["b"]
        if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]:
            raise AdapterFormatError(f"{path}: {source} {list(a.shape)} and its B {list(b.shape)} are not "
                                     f"[E, r, in] and [E, out, r]")
        if proj in adapter.experts.get(layer, {}):
            raise AdapterFormatError(f"{path}: layer {layer} {proj}_proj experts already have a LoRA in "
                                     f"adapter_model.safetensors")
        rank = a.shape[1]
        binding = adapter.binding  # KT-SFT's manifest records the experts' rank and alpha
        if binding is not None and binding.lora_rank not in (None, rank):
            raise AdapterFormatError(f"{path}: {source} has rank {rank}; {binding.manifest} says lora.rank is "
                                     f"{binding.lora_rank}")
        alpha = binding.lora_alpha if binding is not None and binding.lora_alpha else config.get("lora_alpha", rank)
        scale = float(alpha) / rank
        adapter.experts.setdefault(layer, {})[proj] = ExpertLora(a, b, scale, source)
    adapter.format = "peft+fused-experts" if adapter.linears or adapter.pending else "fused-experts"
