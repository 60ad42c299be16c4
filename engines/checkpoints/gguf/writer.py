"""Write a DeepSeek checkpoint (the demo model's safetensors folder) as a llama.cpp `deepseek2` GGUF, as
llama.cpp's convert_hf_to_gguf.py lays it out: experts stacked per layer, kv_b split into k_b / v_b (or kept
whole), the tokenizer and chat template in the metadata. Each group of tensors gets its own type; a type
whose block does not divide a tensor's rows falls back to Q8_0 (then F32), and norms, the router and its bias
stay F32, as llama.cpp's quantizer keeps them. For tests, benchmarks and side-by-side runs with llama.cpp."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from engines.checkpoints.gguf import deepseek2
from engines.checkpoints.gguf.quants import quantize
from engines.checkpoints.gguf.tokenizer import CONTROL, NORMAL, USER_DEFINED

GROUPS = ("experts", "attention", "other")
WRITABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
_KEPT_F32 = ("_norm.", "ffn_gate_inp.", "exp_probs_b.")


def write_gguf(hf_dir: str | Path, out: str | Path, types: dict[str, str] | None = None, *, split: bool = False,
               kv_b: str = "split") -> list[Path]:
    """Write the checkpoint in `hf_dir` to `out` (a .gguf path; with `split`, two files named
    `<stem>-00001-of-00002.gguf` and `-00002-of-00002`). `types`: {"experts" | "attention" | "other": type},
    default Q8_0 each. `kv_b`: "split" (attn_k_b + attn_v_b, as current llama.cpp writes), "whole"
    (attn_kv_b, as older GGUFs have it) or "both". Returns the files written."""
    import gguf

    types = {group: "Q8_0" for group in GROUPS} | (types or {})
    for group, name in types.items():
        if group not in GROUPS or name not in WRITABLE_TYPES:
            raise ValueError(f"gguf types: {group}={name} is not one of {GROUPS} x {', '.join(WRITABLE_TYPES)}")
    hf_dir, out = Path(hf_dir), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = list(_gguf_tensors(hf_dir, config, kv_b))
    writer = gguf.GGUFWriter(out, deepseek2.ARCHITECTURE, split_max_tensors=math.ceil(len(tensors) / 2) if split else 0)
    _write_metadata(writer, config)
    _write_tokenizer(writer, hf_dir, config)
    for name, group, values in tensors:
        stored, kind = _stored(name, values, types[group])
        writer.add_tensor(name, stored, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(out)


def _stored(name: str, values: np.ndarray, wanted: str) -> tuple[np.ndarray, str]:
    import gguf

    kind = "F32" if values.ndim == 1 or any(k in name for k in _KEPT_F32) else wanted
    for candidate in (kind, "Q8_0", "F32"):
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[candidate]][0]
        if values.shape[-1] % block == 0:
            return quantize(values, candidate), candidate
    raise AssertionError("F32 divides every row")


def _gguf_tensors(hf_dir: Path, config: dict, kv_b: str) -> Iterator[tuple[str, str, np.ndarray]]:
    """(GGUF name, type group, float32 values) in llama.cpp's order: globals, then each layer."""
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            weights.update({k: f.get_tensor(k) for k in f.keys()})

    def values(name: str) -> np.ndarray:
        return weights.pop(name).float().numpy()

    for hf in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        yield deepseek2.gguf_name(hf), "other", values(hf)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        experts = f"{prefix}mlp.experts."
        if f"{experts}0.gate_proj.weight" in weights:
            for proj, part in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                               ("down_proj", "ffn_down_exps")):
                stacked = np.stack([values(f"{experts}{e}.{proj}.weight") for e in range(config["n_routed_experts"])])
                yield f"blk.{layer}.{part}.weight", "experts", stacked
        kv_name = f"{prefix}self_attn.kv_b_proj.weight"
        whole = values(kv_name)
        if kv_b in ("whole", "both"):
            yield f"blk.{layer}.attn_kv_b.weight", "attention", whole
        if kv_b in ("split", "both"):
            k_b, v_b = deepseek2.split_kv_b(whole, config["num_attention_heads"], config["qk_nope_head_dim"])
            yield f"blk.{layer}.attn_k_b.weight", "attention", k_b
            yield f"blk.{layer}.attn_v_b.weight", "attention", v_b
        for hf in sorted(n for n in weights if n.startswith(prefix)):
            name = deepseek2.gguf_name(hf)
            if name is None:
                raise ValueError(f"gguf writer: {hf} has no deepseek2 name")
            yield name, "attention" if ".attn_" in name else "other", values(hf)
    if weights:
        raise ValueError(f"gguf writer: {len(weights)} tensors left unwritten, e.g. {next(iter(weights))}")


def _write_metadata(writer, config: dict) -> None:
    arch = deepseek2.ARCHITECTURE
    ints = {"block_count": "num_hidden_layers", "context_length": "max_position_embeddings",
            "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
            "attention.head_count": "num_attention_heads", "expert_used_count": "num_experts_per_tok",
            "leading_dense_block_count": "first_k_dense_replace", "vocab_size": "vocab_size",
            "attention.kv_lora_rank": "kv_lora_rank", "rope.dimension_count": "qk_rope_head_dim",
            "expert_feed_forward_length": "moe_intermediate_size", "expert_count": "n_routed_experts",
            "expert_shared_count": "n_shared_experts", "expert_group_count": "n_group",
            "expert_group_used_count": "topk_group"}
    for key, field in ints.items():
        writer.add_uint32(f"{arch}.{key}", int(config[field]))
    if config.get("q_lora_rank"):
        writer.add_uint32(f"{arch}.attention.q_lora_rank", int(config["q_lora_rank"]))
    # MLA as current llama.cpp writes it: one KV head of the latent's width, the per-head sizes apart
    rope, rank = config["qk_rope_head_dim"], config["kv_lora_rank"]
    writer.add_uint32(f"{arch}.attention.head_count_kv", 1)
    writer.add_uint32(f"{arch}.attention.key_length", rank + rope)
    writer.add_uint32(f"{arch}.attention.value_length", rank)
    writer.add_uint32(f"{arch}.attention.key_length_mla", config["qk_nope_head_dim"] + rope)
    writer.add_uint32(f"{arch}.attention.value_length_mla", config["v_head_dim"])
    writer.add_float32(f"{arch}.rope.freq_base", float(config["rope_theta"]))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(config["rms_norm_eps"]))
    writer.add_float32(f"{arch}.expert_weights_scale", float(config["routed_scaling_factor"]))
    writer.add_bool(f"{arch}.expert_weights_norm", bool(config["norm_topk_prob"]))
    writer.add_uint32(f"{arch}.expert_gating_func", 2 if config.get("scoring_func") == "sigmoid" else 1)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("type", scaling.get("rope_type")) == "yarn":
        writer.add_string(f"{arch}.rope.scaling.type", "yarn")
        writer.add_float32(f"{arch}.rope.scaling.factor", float(scaling["factor"]))
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length",
                          int(scaling["original_max_position_embeddings"]))
        writer.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", 0.1 * float(scaling["mscale_all_dim"]))
        writer.add_float32(f"{arch}.rope.scaling.yarn_beta_fast", float(scaling.get("beta_fast", 32)))
        writer.add_float32(f"{arch}.rope.scaling.yarn_beta_slow", float(scaling.get("beta_slow", 1)))


def _write_tokenizer(writer, hf_dir: Path, config: dict) -> None:
    """The folder's byte-level BPE as llama.cpp's converter writes it: every id's token (added tokens as their
    text), its type, the merges, the split name and the special ids."""
    spec = json.loads((hf_dir / "tokenizer.json").read_text("utf-8"))
    settings = json.loads((hf_dir / "tokenizer_config.json").read_text("utf-8"))
    size = config["vocab_size"]
    tokens, kinds = [f"[PAD{i}]" for i in range(size)], [5] * size  # 5: unused
    for token, index in spec["model"]["vocab"].items():
        if index < size:
            tokens[index], kinds[index] = token, NORMAL
    for added in spec["added_tokens"]:
        if added["id"] < size:
            tokens[added["id"]], kinds[added["id"]] = added["content"], CONTROL if added["special"] else USER_DEFINED
    # a vocabulary cut to the model's size (V2-Lite's 102,400 of the tokenizer's 128k) keeps only the merges
    # whose parts and result it still holds: a merge naming a dropped token makes the file unreadable
    kept = {token for token, index in spec["model"]["vocab"].items() if index < size}
    pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in spec["model"]["merges"]]
    merges = [f"{a} {b}" for a, b in pairs if a in kept and b in kept and a + b in kept]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("deepseek-v3")
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    writer.add_token_merges(merges)
    ids = {t: i for i, t in enumerate(tokens)}

    def special(key: str) -> int | None:
        value = settings.get(key)
        return ids.get(value["content"] if isinstance(value, dict) else value)

    writer.add_bos_token_id(special("bos_token"))
    writer.add_eos_token_id(special("eos_token"))
    if special("pad_token") is not None:
        writer.add_pad_token_id(special("pad_token"))
    writer.add_add_bos_token(bool(settings.get("add_bos_token", True)))
    writer.add_add_eos_token(bool(settings.get("add_eos_token", False)))
    if settings.get("chat_template"):
        writer.add_chat_template(settings["chat_template"])
