"""Adapters made with peft on the demo model, the same adapters in the other formats, and their references
(transformers float32 with the adapter merged by `merge_and_unload()`)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

ATTENTION = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
KINDS = {
    "attn": dict(target_modules=ATTENTION),
    # peft >= 0.18 turns the experts' and router's names into target_parameters on DeepSeek-V3
    "all": dict(target_modules="all-linear"),
    "experts": dict(target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
}
LORA_GAIN = 0.5  # peft's random init (init_lora_weights=False) scaled so the adapters change the text, not wreck it
HIDDEN = 256  # the demo model's hidden size


def make_peft_adapter(base_model, kind: str, out_dir: Path, seed: int = 0):
    """Save a peft adapter with random non-zero A and B; return the merged float32 reference model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base_model), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                                       **KINDS[kind]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.mul_(LORA_GAIN)
    peft_model.save_pretrained(str(out_dir))
    return peft_model.merge_and_unload().eval()


def _expert_parts(peft_dir: Path, experts: int, inter: int):
    """The experts adapter's per-layer (gate, up, down) as A [E, r, in], B [E, out, r] with the scale folded in."""
    from safetensors.torch import load_file

    from engines.lora.peft_format import FusedExpertLora, Scaling, normalize_key

    config = json.loads((peft_dir / "adapter_config.json").read_text())
    scaling = Scaling(config["lora_alpha"], config.get("alpha_pattern") or {}, config.get("use_rslora", False))
    tensors = {normalize_key(k): v for k, v in load_file(str(peft_dir / "adapter_model.safetensors")).items()}
    layers: dict[int, dict] = {}
    for key in tensors:
        if not key.endswith("lora_A.weight") or ".mlp.experts" not in key:
            continue
        module = key[:-len(".lora_A.weight")]
        layer = int(module.split(".")[2])
        fused = FusedExpertLora(layer, module, tensors[key], tensors[module + ".lora_B.weight"], scaling, key)
        for proj, update in fused.resolve(experts, inter, HIDDEN).items():
            layers.setdefault(layer, {})[proj] = (update.a, update.b * update.scale)
    return layers


def write_fused_expert_lora(peft_dir: Path, out_dir: Path, experts: int, inter: int) -> Path:
    """KTransformers' fused_expert_lora.safetensors carrying the same update as the peft experts adapter."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer, parts in _expert_parts(peft_dir, experts, inter).items():
        for proj, (a, b) in parts.items():
            rank = a.shape[1]
            tensors[f"layers.{layer}.experts.{proj}_lora_a"] = a.clone()
            tensors[f"layers.{layer}.experts.{proj}_lora_b"] = (b / (16.0 / rank)).contiguous()  # alpha 16
    save_file(tensors, str(out_dir / "fused_expert_lora.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                             "target_modules": []}))
    return out_dir


def write_gguf_lora(peft_all_dir: Path, path: Path, experts: int, inter: int) -> Path:
    """A llama.cpp-style GGUF LoRA with the update of the peft all-linear adapter (attention, router, experts)."""
    import gguf
    from safetensors.torch import load_file

    from engines.lora.gguf_format import EXPERTS, MODULES
    from engines.lora.peft_format import normalize_key

    alpha = 8.0
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    by_module = {v: k for k, v in MODULES.items()}
    tensors = {normalize_key(k): v for k, v in load_file(str(peft_all_dir / "adapter_model.safetensors")).items()}
    config = json.loads((peft_all_dir / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    for key, a in tensors.items():
        if not key.endswith("lora_A.weight") or ".mlp.experts" in key:
            continue
        module = key[:-len(".lora_A.weight")]
        layer, local = int(module.split(".")[2]), ".".join(module.split(".")[3:])
        b = tensors[module + ".lora_B.weight"] * scale * a.shape[0] / alpha  # llama.cpp applies alpha / r
        writer.add_tensor(f"blk.{layer}.{by_module[local]}.weight.lora_a", a.numpy())
        writer.add_tensor(f"blk.{layer}.{by_module[local]}.weight.lora_b", b.numpy())
    for layer, parts in _expert_parts(peft_all_dir, experts, inter).items():
        for name, proj in EXPERTS.items():
            a, b = parts[proj]
            writer.add_tensor(f"blk.{layer}.{name}.weight.lora_a", a.clone().numpy())
            writer.add_tensor(f"blk.{layer}.{name}.weight.lora_b", (b * a.shape[1] / alpha).contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_value_head(directory: Path, hidden: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(1, hidden, generator=gen) * 0.1, torch.randn(1, generator=gen)
    save_file({"v_head.summary.weight": weight, "v_head.summary.bias": bias}, str(directory / "value_head.safetensors"))
    return weight, bias


def adapter_variant(root: Path, name: str, change) -> str:
    """A copy of the adapter `root / "good"` at `root / name`, changed by `change(directory)` (made once)."""
    import shutil

    target = root / name
    if not target.exists():
        shutil.copytree(root / "good", target)
        change(target)
    return str(target)
