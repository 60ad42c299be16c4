"""llama.cpp's `deepseek2` architecture (DeepSeek V2, V2-Lite, V3, R1, V3.1 GGUFs) in Hugging Face terms: the
config its metadata describes and the checkpoint name each of its tensors stands for.

Tensor names follow llama.cpp's convert_hf_to_gguf.py: `blk.N.*` per layer, routed experts stacked per layer
(`ffn_{gate,up,down}_exps`, [experts, rows, cols] in the HF orientation), and MLA's `kv_b_proj` stored whole
(`attn_kv_b`), split into `attn_k_b` (its key half, transposed per head) and `attn_v_b`, or both."""
from __future__ import annotations

import re
from typing import Any

import numpy as np

ARCHITECTURE = "deepseek2"
EXPERT_TENSORS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
SPLIT_KV_B = ("attn_k_b", "attn_v_b")


def hf_name(name: str) -> str | None:
    """The checkpoint name a GGUF tensor stands for; None for the ones handled apart (experts, k_b / v_b)."""
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{kind}"
    match = _LAYER_NAME.match(name)
    if match is None:
        return None
    layer, part, kind = match.groups()
    if part == "exp_probs_b":  # the router's score-correction bias (V3)
        return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    if part in _LAYER:
        return f"model.layers.{layer}.{_LAYER[part]}.{kind}"
    return None


def gguf_name(name: str) -> str | None:
    """The inverse of `hf_name` (for the writer); None for routed experts and kv_b, which are written apart."""
    base, _, kind = name.rpartition(".")
    for gguf_base, hf_base in _GLOBAL.items():
        if base == hf_base:
            return f"{gguf_base}.{kind}"
    layer, _, rest = name.removeprefix("model.layers.").partition(".")
    if rest == "mlp.gate.e_score_correction_bias":
        return f"blk.{layer}.exp_probs_b.bias"
    part = next((g for g, h in _LAYER.items() if rest == f"{h}.{kind}"), None)
    return None if part is None or part == "attn_kv_b" else f"blk.{layer}.{part}.{kind}"


def layer_part(name: str) -> tuple[int, str] | None:
    match = _LAYER_NAME.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


def kv_b_from_split(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """kv_b_proj [heads * (nope + v), kv_rank] from llama.cpp's split form: k_b [heads, kv_rank, nope] (the key
    half transposed per head) and v_b [heads, v, kv_rank]."""
    heads, rank, _ = k_b.shape
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, rank)


def split_kv_b(kv_b: np.ndarray, heads: int, nope: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse, as llama.cpp's converter writes it (for the writer)."""
    per_head = kv_b.reshape(heads, -1, kv_b.shape[-1])
    return np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1)), np.ascontiguousarray(per_head[:, nope:])


def config_dict(value: Any, has_router_bias: bool, tokens: int) -> dict[str, Any]:
    """A config.json (DeepSeek-V3's, or V2's for softmax-routed GGUFs) from the metadata; `value(key, default)`
    reads one key without the `deepseek2.` prefix; `tokens`: the vocabulary's size where the metadata gives none."""
    rope = int(value("rope.dimension_count"))
    key_length = int(value("attention.key_length_mla", 0) or value("attention.key_length"))
    v_head = int(value("attention.value_length_mla", 0) or value("attention.value_length"))
    sigmoid = int(value("expert_gating_func", 0) or 0) == 2 or has_router_bias
    groups, used_groups = int(value("expert_group_count", 1) or 1), int(value("expert_group_used_count", 1) or 1)
    q_rank = value("attention.q_lora_rank", None)
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
        "vocab_size": int(value("vocab_size", 0) or tokens),
        "hidden_size": int(value("embedding_length")),
        "intermediate_size": int(value("feed_forward_length")),
        "moe_intermediate_size": int(value("expert_feed_forward_length")),
        "num_hidden_layers": int(value("block_count")),
        "first_k_dense_replace": int(value("leading_dense_block_count", 0)),
        "n_routed_experts": int(value("expert_count")),
        "num_experts_per_tok": int(value("expert_used_count")),
        "n_shared_experts": int(value("expert_shared_count", 0)),
        "n_group": groups,
        "topk_group": used_groups,
        "norm_topk_prob": bool(value("expert_weights_norm", False)),
        "routed_scaling_factor": float(value("expert_weights_scale", 1.0)),
        "num_attention_heads": int(value("attention.head_count")),
        "num_key_value_heads": int(value("attention.head_count")),
        "q_lora_rank": None if q_rank is None else int(q_rank),
        "kv_lora_rank": int(value("attention.kv_lora_rank")),
        "qk_nope_head_dim": key_length - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v_head,
        "hidden_act": "silu",
        "max_position_embeddings": int(value("context_length")),
        "rope_theta": float(value("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(value("attention.layer_norm_rms_epsilon", 1e-6)),
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
    }
    if sigmoid:
        config.update(scoring_func="sigmoid", topk_method="noaux_tc")
    else:
        config.update(scoring_func="softmax", topk_method="group_limited_greedy" if groups > 1 else "greedy")
    if value("rope.scaling.type", None) == "yarn":
        # llama.cpp keeps 0.1 * mscale_all_dim; DeepSeek's configs give mscale the same value
        mscale = round(float(value("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)  # stored as float32
        config["rope_scaling"] = {
            "type": "yarn", "factor": float(value("rope.scaling.factor")),
            "original_max_position_embeddings": int(value("rope.scaling.original_context_length")),
            "beta_fast": float(value("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(value("rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": mscale, "mscale_all_dim": mscale,
        }
    return config
