"""The config a deepseek2 GGUF's metadata makes where converters leave keys out (engines/checkpoints/gguf/
routing.py, deepseek2.py): routing keys a file lacks come from the DeepSeek release its shape identifies, a file
of no known shape without group keys is reported as routing that may differ, and metadata that cannot make a
config is refused naming the key and the file. Metadata-only files, as ik_llama.cpp's and older llama.cpp
converters write them for DeepSeek's real shapes."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from engines.checkpoints.gguf import GGUFCheckpoint
from engines.checkpoints.gguf.deepseek2 import kv_b_from_split, split_kv_b

# DeepSeek-V3's metadata as ik_llama.cpp's converter writes it: one KV head per query head, the per-head
# lengths as key_length / value_length, no expert group keys
V3_AS_IK_WRITES_IT = {
    "block_count": 61, "context_length": 163840, "embedding_length": 7168, "feed_forward_length": 18432,
    "attention.head_count": 128, "attention.head_count_kv": 128, "attention.key_length": 192,
    "attention.value_length": 128, "rope.dimension_count": 64, "attention.kv_lora_rank": 512,
    "attention.q_lora_rank": 1536, "expert_feed_forward_length": 2048, "expert_count": 256,
    "expert_used_count": 8, "expert_shared_count": 1, "leading_dense_block_count": 3, "vocab_size": 129280,
    "expert_weights_scale": 2.5, "expert_weights_norm": True, "expert_gating_func": 2,
}
# DeepSeek-V2's as llama.cpp's converter wrote it before January 2025: no gating function, no weights norm
V2_FROM_2024 = {
    "block_count": 60, "context_length": 163840, "embedding_length": 5120, "feed_forward_length": 12288,
    "attention.head_count": 128, "attention.head_count_kv": 128, "attention.key_length": 192,
    "attention.value_length": 128, "rope.dimension_count": 64, "attention.kv_lora_rank": 512,
    "attention.q_lora_rank": 1536, "expert_feed_forward_length": 1536, "expert_count": 160,
    "expert_used_count": 6, "expert_shared_count": 2, "leading_dense_block_count": 1, "vocab_size": 102400,
    "expert_weights_scale": 16.0,
}
V2_LITE_FROM_2024 = V2_FROM_2024 | {
    "block_count": 27, "embedding_length": 2048, "feed_forward_length": 10944, "attention.head_count": 16,
    "expert_feed_forward_length": 1408, "expert_count": 64, "expert_weights_scale": 1.0}
V2_LITE_FROM_2024.pop("attention.q_lora_rank")


def metadata_gguf(path, keys: dict, router_bias: bool) -> GGUFCheckpoint:
    """A deepseek2 file with `keys` (without the prefix) and, with `router_bias`, V3's score-correction bias."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "deepseek2")
    for key, value in keys.items():
        name = f"deepseek2.{key}"
        if isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        else:
            writer.add_uint32(name, value)
    if router_bias:
        writer.add_tensor("blk.3.exp_probs_b.bias", np.zeros(keys["expert_count"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFCheckpoint(path)


def routing_of(config) -> tuple:
    return (config.n_group, config.topk_group, config.routed_scaling_factor, config.norm_topk_prob,
            config.scoring_func, config.topk_method)


def test_a_v3_shaped_file_without_group_keys_routes_with_v3_s_released_groups_and_says_so(tmp_path, caplog):
    checkpoint = metadata_gguf(tmp_path / "r1-ik.gguf", V3_AS_IK_WRITES_IT, router_bias=True)
    with caplog.at_level(logging.INFO, "ktserve.checkpoints.gguf"):
        config = checkpoint.config()
    assert routing_of(config) == (8, 4, 2.5, True, "sigmoid", "noaux_tc")
    assert checkpoint.routing_note == (
        "n_group 8, topk_group 4 (absent from r1-ik.gguf) taken from DeepSeek-V3 / R1 / V3.1's released config.json "
        "(identified by block_count 61, embedding_length 7168, expert_count 256, expert_used_count 8, "
        "attention.head_count 128, leading_dense_block_count 3)")
    assert caplog.records[-1].levelno == logging.INFO and checkpoint.routing_note in caplog.records[-1].getMessage()


def test_one_kv_head_per_query_head_gives_the_per_head_lengths(tmp_path):
    config = metadata_gguf(tmp_path / "r1-ik.gguf", V3_AS_IK_WRITES_IT, router_bias=True).config()
    assert (config.num_key_value_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == \
        (128, 128, 64, 128)


def test_a_v2_file_from_before_the_gating_keys_routes_as_v2_s_released_config(tmp_path):
    checkpoint = metadata_gguf(tmp_path / "v2.gguf", V2_FROM_2024, router_bias=False)
    assert routing_of(checkpoint.config()) == (8, 3, 16.0, False, "softmax", "group_limited_greedy")
    assert checkpoint.routing_note.startswith("n_group 8, topk_group 3 (absent from v2.gguf) taken from "
                                              "DeepSeek-V2 / V2.5 / Coder-V2's released config.json")


def test_a_v2_lite_file_without_group_keys_routes_greedily_with_nothing_to_report(tmp_path):
    checkpoint = metadata_gguf(tmp_path / "v2-lite.gguf", V2_LITE_FROM_2024, router_bias=False)
    assert routing_of(checkpoint.config()) == (1, 1, 1.0, False, "softmax", "greedy")
    assert checkpoint.routing_note is None


def test_a_kimi_k2_file_without_group_keys_routes_in_one_group_with_nothing_to_report(tmp_path):
    keys = V3_AS_IK_WRITES_IT | {"expert_count": 384, "attention.head_count": 64, "attention.head_count_kv": 64,
                                 "leading_dense_block_count": 1, "expert_weights_scale": 2.827}
    checkpoint = metadata_gguf(tmp_path / "kimi-k2.gguf", keys, router_bias=True)
    assert routing_of(checkpoint.config())[:2] == (1, 1) and checkpoint.routing_note is None


def test_routing_keys_the_file_has_win_over_the_release_s(tmp_path):
    keys = V3_AS_IK_WRITES_IT | {"expert_group_count": 1, "expert_group_used_count": 1}
    checkpoint = metadata_gguf(tmp_path / "v3-ungrouped.gguf", keys, router_bias=True)
    assert routing_of(checkpoint.config())[:2] == (1, 1) and checkpoint.routing_note is None


def test_a_file_of_no_known_shape_without_group_keys_warns_that_routing_may_differ(tmp_path, caplog):
    keys = V3_AS_IK_WRITES_IT | {"block_count": 30}  # a V3-like model of DeepSeek's that never shipped
    checkpoint = metadata_gguf(tmp_path / "custom.gguf", keys, router_bias=True)
    with caplog.at_level(logging.INFO, "ktserve.checkpoints.gguf"):
        assert routing_of(checkpoint.config())[:2] == (1, 1)
    assert checkpoint.routing_note.startswith(
        "custom.gguf has no deepseek2.expert_group_count / deepseek2.expert_group_used_count and its shape is no "
        "known release's: experts are routed without a group limit")
    assert "give model_path" in checkpoint.routing_note
    assert caplog.records[-1].levelno == logging.WARNING


def test_a_sigmoid_routed_file_of_v2_lite_s_shape_is_not_taken_for_v2_lite(tmp_path):
    # Moonlight-16B-A3B has V2-Lite's shape, routed by sigmoid scores with V3's score-correction bias
    checkpoint = metadata_gguf(tmp_path / "moonlight.gguf", V2_LITE_FROM_2024, router_bias=True)
    assert checkpoint.config().scoring_func == "sigmoid"
    assert "its shape is no known release's" in checkpoint.routing_note


def test_a_missing_required_key_is_named_with_the_file(tmp_path):
    keys = dict(V3_AS_IK_WRITES_IT)
    del keys["attention.kv_lora_rank"]
    with pytest.raises(ValueError, match="model: broken.gguf has no deepseek2.attention.kv_lora_rank"):
        metadata_gguf(tmp_path / "broken.gguf", keys, router_bias=True).config()


def test_mla_as_one_kv_head_without_the_per_head_length_is_refused_naming_the_keys(tmp_path):
    keys = V3_AS_IK_WRITES_IT | {"attention.head_count_kv": 1, "attention.key_length": 576}
    with pytest.raises(ValueError, match="head_count_kv 1 .* but no deepseek2.attention.key_length_mla"):
        metadata_gguf(tmp_path / "half-new.gguf", keys, router_bias=True).config()


def test_a_group_count_that_does_not_divide_the_experts_is_refused_naming_the_key(tmp_path):
    keys = V3_AS_IK_WRITES_IT | {"expert_group_count": 7, "expert_group_used_count": 4}
    with pytest.raises(ValueError, match="odd-groups.gguf has deepseek2.expert_group_count 7; it must be at least 1 "
                                         "and divide deepseek2.expert_count"):
        metadata_gguf(tmp_path / "odd-groups.gguf", keys, router_bias=True).config()


def test_an_unknown_gating_function_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match="has deepseek2.expert_gating_func 3"):
        metadata_gguf(tmp_path / "gating.gguf", V3_AS_IK_WRITES_IT | {"expert_gating_func": 3}, True).config()


def test_kv_b_is_rebuilt_from_split_halves_flattened_as_ik_llama_cpp_writes_them():
    heads, nope, v, rank = 4, 32, 16, 64
    kv_b = np.random.default_rng(0).normal(size=(heads * (nope + v), rank)).astype(np.float32)
    k_b, v_b = split_kv_b(kv_b, heads, nope)  # [heads, rank, nope], [heads, v, rank]: llama.cpp's
    assert np.array_equal(kv_b_from_split(k_b, v_b, heads), kv_b)
    flat = k_b.reshape(heads * rank, nope), v_b.reshape(heads * v, rank)  # ik_llama.cpp's
    assert np.array_equal(kv_b_from_split(*flat, heads), kv_b)


def test_the_demo_model_s_entry_among_the_releases_is_its_config():
    from engines.checkpoints.gguf.routing import RELEASES, ROUTING_KEYS
    from engines.kt.families.deepseek_mla.demo_model import demo_config

    [demo] = [r for r in RELEASES if r.name == "ktserve's demo model"]
    config = demo_config()
    assert demo.shape == {
        "block_count": config["num_hidden_layers"], "embedding_length": config["hidden_size"],
        "expert_count": config["n_routed_experts"], "expert_used_count": config["num_experts_per_tok"],
        "attention.head_count": config["num_attention_heads"],
        "leading_dense_block_count": config["first_k_dense_replace"]}
    assert demo.routing == {key: config[key] for key in ROUTING_KEYS.values()}
    assert demo.sigmoid == (config["scoring_func"] == "sigmoid")
