"""GGUF LoRA files as llama.cpp's `convert_lora_to_gguf.py` writes them for DeepSeek (arch `deepseek2`):
tensors `blk.N.<name>.weight.lora_a` `[r, in]` and `.lora_b` `[out, r]` (3-D `[E, r, in]` / `[E, out, r]`
for the routed experts), scale `adapter.lora.alpha / r` (1 when alpha is 0, as llama.cpp applies it)."""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch

from engines.lora.adapter import AdapterFormatError, ExpertLora, LoraAdapter, LoraWeight, finite
from engines.lora.files import AdapterFiles

# llama.cpp's DeepSeek tensor names -> the transformers module under model.layers.N
MODULES = {
    "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_b": "self_attn.kv_b_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
EXPERTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
# Newer llama.cpp also writes kv_b split per head (attn_k_b transposed, attn_v_b); the same update as attn_kv_b.
DERIVED_FROM_KV_B = ("attn_k_b", "attn_v_b")
_NAME = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<name>\w+)\.weight\.lora_(?P<ab>[ab])$")


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _tensor(t) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        data = np.array(t.data)
    else:
        data = dequantize(t.data, t.tensor_type)
    return torch.from_numpy(data.astype(np.float32, copy=False).copy())


def read(path: Path, files: AdapterFiles = AdapterFiles()) -> LoraAdapter:
    real = files.open_path(path)  # a FIFO named x.gguf would block the reader for ever
    try:
        from gguf import GGUFReader
        reader = GGUFReader(str(real))
    except Exception as exc:  # gguf raises ValueError / struct errors for files that are not GGUF
        raise AdapterFormatError(f"{path} is not a readable GGUF file: {exc}") from None
    if _field(reader, "general.type") not in (None, "adapter") or _field(reader, "adapter.type") not in (None, "lora"):
        raise AdapterFormatError(f"{path} is a GGUF {_field(reader, 'general.type')} file, not a LoRA adapter")
    alpha = float(_field(reader, "adapter.lora.alpha") or 0.0)
    if not math.isfinite(alpha) or alpha < 0:
        raise AdapterFormatError(f"{path}: adapter.lora.alpha is {alpha}; it must be finite and not negative")
    parts: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    unknown = []
    for t in reader.tensors:
        match = _NAME.match(t.name)
        if match is None or match["name"] not in (*MODULES, *EXPERTS, *DERIVED_FROM_KV_B):
            unknown.append(t.name)
            continue
        parts.setdefault((int(match["layer"]), match["name"]), {})[match["ab"]] = (t.name, finite(_tensor(t), t.name))
    if unknown:
        raise AdapterFormatError(f"{path}: {len(unknown)} tensors have no counterpart in a DeepSeek model this "
                                 f"server can apply LoRA to, e.g. {', '.join(unknown[:5])}")
    adapter = LoraAdapter(path=str(path), format="gguf")
    for (layer, name), ab in sorted(parts.items()):
        if set(ab) != {"a", "b"}:
            raise AdapterFormatError(f"{path}: {next(iter(ab.values()))[0]} has no matching lora_"
                                     f"{'b' if 'a' in ab else 'a'}")
        (source, a), (_, b) = ab["a"], ab["b"]
        rank = a.shape[-2]
        scale = alpha / rank if alpha else 1.0
        if name in DERIVED_FROM_KV_B:
            if (layer, "attn_kv_b") not in parts:
                raise AdapterFormatError(f"{path}: {source} is only supported together with blk.{layer}.attn_kv_b")
            continue
        if name in EXPERTS:
            if a.dim() != 3 or b.dim() != 3:
                raise AdapterFormatError(f"{path}: {source} should be 3-D [experts, r, in], got {list(a.shape)}")
            adapter.experts.setdefault(layer, {})[EXPERTS[name]] = ExpertLora(a, b, scale, source)
        else:
            adapter.linears[f"model.layers.{layer}.{MODULES[name]}"] = LoraWeight(a, b, scale, source)
    return adapter
