"""llama.cpp's `deepseek2` architecture (DeepSeek V2, V2-Lite, V3, R1, V3.1 GGUFs) in Hugging Face terms: the
config its metadata describes and the checkpoint name each of its tensors stands for.

Tensor names follow llama.cpp's convert_hf_to_gguf.py: `blk.N.*` per layer, routed experts stacked per layer
(`ffn_{gate,up,down}_exps`, [experts, rows, cols] in the HF orientation), and MLA's `kv_b_proj` stored whole
(`attn_kv_b`), split into `attn_k_b` (its key half, transposed per head) and `attn_v_b`, or both (ik_llama.cpp's
converter keeps all three, its split halves flattened to two dimensions). The converters also differ in the
metadata: see `_head_lengths` for the attention sizes, routing.py for the routing keys."""
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


def kv_b_from_split(k_b: np.ndarray, v_b: np.ndarray, heads: int) -> np.ndarray:
    """kv_b_proj [heads * (nope + v), kv_rank] from llama.cpp's split form: k_b [heads, kv_rank, nope] (the key
    half transposed per head) and v_b [heads, v, kv_rank], or the same flattened to two dimensions, as
    ik_llama.cpp's converter writes them ([heads * kv_rank, nope] and [heads * v, kv_rank])."""
    rank = v_b.shape[-1]
    k_b, v_b = k_b.reshape(heads, rank, -1), v_b.reshape(heads, -1, rank)
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, rank)


def split_kv_b(kv_b: np.ndarray, heads: int, nope: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse, as llama.cpp's converter writes it (for the writer)."""
    per_head = kv_b.reshape(heads, -1, kv_b.shape[-1])
    return np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1)), np.ascontiguousarray(per_head[:, nope:])


def config_dict(value: Any, routing: dict[str, Any], tokens: int, source: str) -> dict[str, Any]:
    """A config.json (DeepSeek-V3's, or V2's for softmax-routed GGUFs) from the metadata of `source`;
    `value(key, default)` reads one key without the `deepseek2.` prefix; `routing`: the routing keys
    (routing.resolve); `tokens`: the vocabulary's size where the metadata gives none."""

    def need(key: str, kind: type = int) -> Any:
        found = value(key, None)
        if found is None:
            raise ValueError(f"model: {source} has no {ARCHITECTURE}.{key}, which a {ARCHITECTURE} GGUF needs; "
                             "give model_path (the original config.json) beside gguf_path")
        return kind(found)

    rope, heads = need("rope.dimension_count"), need("attention.head_count")
    key_length, v_head = _head_lengths(value, need, heads, source)
    sigmoid, groups = routing["scoring_func"] == "sigmoid", routing["n_group"]
    q_rank = value("attention.q_lora_rank", None)
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
        "vocab_size": int(value("vocab_size", 0) or tokens),
        "hidden_size": need("embedding_length"),
        "intermediate_size": need("feed_forward_length"),
        "moe_intermediate_size": need("expert_feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "first_k_dense_replace": int(value("leading_dense_block_count", 0)),
        "n_routed_experts": need("expert_count"),
        "num_experts_per_tok": need("expert_used_count"),
        "n_shared_experts": int(value("expert_shared_count", 0)),
        **routing,
        "topk_method": "noaux_tc" if sigmoid else "group_limited_greedy" if groups > 1 else "greedy",
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": None if q_rank is None else int(q_rank),
        "kv_lora_rank": need("attention.kv_lora_rank"),
        "qk_nope_head_dim": key_length - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v_head,
        "hidden_act": "silu",
        "max_position_embeddings": need("context_length"),
        "rope_theta": float(value("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(value("attention.layer_norm_rms_epsilon", 1e-6)),
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
    }
    if value("rope.scaling.type", None) == "yarn":
        # llama.cpp keeps 0.1 * mscale_all_dim; DeepSeek's configs give mscale the same value
        mscale = round(float(value("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)  # stored as float32
        config["rope_scaling"] = {
            "type": "yarn", "factor": need("rope.scaling.factor", float),
            "original_max_position_embeddings": need("rope.scaling.original_context_length"),
            "beta_fast": float(value("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(value("rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": mscale, "mscale_all_dim": mscale,
        }
    return config


def _head_lengths(value: Any, need: Any, heads: int, source: str) -> tuple[int, int]:
    """A query/key head's length (nope + rope) and a value head's. llama.cpp's converter writes MLA as one KV
    head of the latent's width (head_count_kv 1, key_length kv_rank + rope) and the per-head lengths apart
    (key_length_mla, value_length_mla); ik_llama.cpp's, and llama.cpp's before mid-2025, write one KV head per
    query head (head_count_kv = head_count) and the per-head lengths as key_length / value_length."""
    if value("attention.key_length_mla", None) is not None:
        return need("attention.key_length_mla"), need("attention.value_length_mla")
    kv_heads = value("attention.head_count_kv", heads)
    kv_heads = max(kv_heads) if isinstance(kv_heads, list) else int(kv_heads)  # llama.cpp allows one per layer
    if kv_heads == 1 and heads > 1:
        raise ValueError(f"model: {source} has {ARCHITECTURE}.attention.head_count_kv 1 (MLA written as one KV "
                         f"head) but no {ARCHITECTURE}.attention.key_length_mla, the per-head length; give "
                         "model_path (the original config.json) beside gguf_path")
    return need("attention.key_length"), need("attention.value_length")
