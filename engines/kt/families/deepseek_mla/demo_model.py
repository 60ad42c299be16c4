"""The built-in demo model (engines/demo_model.py: `ensure_demo_model`): a tiny DeepSeek-V3 with seeded random
weights and the real DeepSeek tokenizer.

It is written as an ordinary Hugging Face model directory (config.json, sharded safetensors with an index,
tokenizer files, generation_config.json) using the tensor names of a real DeepSeek-V3 checkpoint, so every
loader in ktserve reads it through the same code path as the real thing. Its text is meaningless; its shape,
routing and numerics are real enough to compare two implementations token by token.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from engines.checkpoints.model_dir import FP8_QUANTIZATION, fp8_release, write_model_dir
from engines.demo_model import DEMO_SEED

# Bump the suffix whenever the files this module writes change, so stale caches are never reused.
DEMO_MODEL_NAME = "demo-model-v3"


# Logits have a standard deviation of about this many units (the final norm makes the hidden state RMS 1);
# the median top-1/top-2 margin over random prompts is then about 1.2 logits.
_LOGIT_STD = 8.0
# Router logits of about one unit keep the sigmoid scores unsaturated: different tokens pick different
# experts (nearly all 420 expert sets the group limit allows turn up in a few thousand tokens).
_ROUTER_LOGIT_STD = 1.0
# Each sublayer adds a fraction of the residual stream, as in trained models, rather than a copy of its
# size. A greedy comparison with float32 transformers breaks wherever rounding tips a near-tie (a routing
# choice or the top-1 token), so the routed experts, the part kt-kernel computes in bf16 or int8, write the
# smallest share. kt-kernel on the CPU, 1016 teacher-forced positions of random prompts, six greedy 32-token
# completions: v1 (all gains 1.0) flipped routing and tokens everywhere; v2 (0.5 / 0.2, experts 1.0, router
# 2.0) agreed on top-1 97.3% (BF16) / 88.6% (INT8), 2/6 and 0/6 completions identical; v3 (experts 0.15,
# router 1.0) 99.6% / 98.7%, 6/6 and 5/6. A real expert bug still shows: gate/up halves swapped changes 33%
# of greedy tokens, an ignored routing bias 12%.
_ATTN_GAIN = 0.5
_MLP_GAIN = 0.2
_ROUTED_EXPERT_GAIN = 0.15


def demo_config(**overrides) -> dict:
    """The demo model's config.json contents (DeepSeek-V3 key names and format); `overrides` replace keys."""
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "torch_dtype": "bfloat16",
        "vocab_size": 129280,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 128,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        # Real V3 checkpoints write the legacy `rope_scaling` with "type"; transformers 5 converts it
        # to `rope_parameters` on load.
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        # The demo model has no multi-token-prediction layer (V3's is layer 61 in the real checkpoint).
        "num_nextn_predict_layers": 0,
        "use_cache": True,
    }
    config.update(overrides)
    return config


FORMATS = ("bf16", "fp8")
# What `make_demo_model(mtp=...)` writes as the multi-token-prediction layer (mtp_layer_tensors).
MTP_KINDS = ("random", "last-layer")


def make_demo_model(out_dir: str | Path, seed: int = DEMO_SEED, fmt: str = "bf16", mtp: str | None = None,
                    **overrides) -> Path:
    """Write the demo model into `out_dir` (created if missing) and return it; the same seed gives the same bytes.
    `overrides` change config keys, e.g. `kv_lora_rank=512, qk_rope_head_dim=64` for the latent width vLLM's
    CPU MLA kernel needs. `mtp` adds a multi-token-prediction layer (MTP_KINDS; `mtp_layer_tensors`).
    `fmt="fp8"` writes it as DeepSeek ships its FP8 releases: every projection in float8_e4m3fn with a float32
    `weight_scale_inv` per 128x128 block, config.json's `quantization_config`, and one multi-token-prediction
    layer `model.layers.<num_hidden_layers>` (random unless `mtp` says otherwise)."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if mtp is not None and mtp not in MTP_KINDS:
        raise ValueError(f"mtp: {mtp!r} is not one of {', '.join(MTP_KINDS)}")
    if fmt == "fp8":
        mtp = mtp or "random"
    config = demo_config(**({"num_nextn_predict_layers": 1} if mtp else {}), **overrides)
    weights = _random_weights(config, seed)
    if mtp is not None:
        weights.update(mtp_layer_tensors(config, weights, seed + 1, copy_last_layer=mtp == "last-layer"))
    if fmt == "fp8":
        config.update(quantization_config=FP8_QUANTIZATION)
        weights = fp8_release(weights)
    return write_model_dir(out_dir, config, weights)


def default_demo_model_dir(mtp: str | None = None) -> Path:
    """Where the shared demo model lives: $KTSERVE_CACHE_DIR (or ~/.cache/ktserve) / demo-model-vN, and the one
    with an MTP layer of kind `mtp` beside it (demo-model-vN-mtp-<kind>)."""
    cache = os.environ.get("KTSERVE_CACHE_DIR") or Path.home() / ".cache" / "ktserve"
    return Path(cache) / (DEMO_MODEL_NAME if mtp is None else f"{DEMO_MODEL_NAME}-mtp-{mtp}")


def ensure_demo_model(mtp: str | None = None) -> Path:
    """Return the default demo model directory (with an MTP layer of kind `mtp`: `make_demo_model`), building it
    first if it does not exist yet.

    The model is built in a temporary directory beside the final one and renamed into place, so a
    directory under the final name is always complete; when two processes race, the loser's copy is
    discarded and both return the winner's.
    """
    final = default_demo_model_dir(mtp)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        make_demo_model(tmp, mtp=mtp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared (a docker volume, CI)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _random_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint under its real DeepSeek-V3 name, drawn in a fixed order from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    normal, linear = _draws(gen)
    weights = {"model.embed_tokens.weight": normal(vocab, hidden, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        weights.update(_layer_weights(config, i, normal, linear, gen))
    weights["model.norm.weight"] = _ones(hidden)
    weights["lm_head.weight"] = normal(vocab, hidden, std=_LOGIT_STD / math.sqrt(hidden))
    return weights


def _draws(gen: torch.Generator):
    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
        # 1/sqrt(fan_in) keeps every projection's output at the scale of its input.
        return normal(out_features, in_features, std=gain / math.sqrt(in_features))
    return normal, linear


def _layer_weights(config: dict, i: int, normal, linear, gen: torch.Generator) -> dict[str, torch.Tensor]:
    hidden, prefix = config["hidden_size"], f"model.layers.{i}"
    weights = {f"{prefix}.input_layernorm.weight": _ones(hidden)}
    weights.update(_attention_weights(config, f"{prefix}.self_attn", linear))
    weights[f"{prefix}.post_attention_layernorm.weight"] = _ones(hidden)
    if i < config["first_k_dense_replace"]:
        weights.update(_mlp_weights(f"{prefix}.mlp", hidden, config["intermediate_size"], linear))
    else:
        weights.update(_moe_weights(config, f"{prefix}.mlp", linear, normal, gen))
    return weights


def mtp_layer_tensors(config: dict, weights: dict[str, torch.Tensor], seed: int = DEMO_SEED + 1,
                      copy_last_layer: bool = False) -> dict[str, torch.Tensor]:
    """A multi-token-prediction layer as DeepSeek-V3 ships it, under `model.layers.<num_hidden_layers>.`: a decoder
    layer, `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, and copies of the main model's embedding and LM head
    (`weights`: the main model's tensors). The decoder layer and eh_proj are drawn from `seed`; with
    `copy_last_layer` the decoder layer is a copy of the model's last one and eh_proj passes the embedding of the
    next token through, so the draft follows the model's own path closely and is accepted far more often than a
    random one (engines/kt/families/deepseek_mla/mtp.py says how the layer computes)."""
    gen = torch.Generator().manual_seed(seed)
    normal, linear = _draws(gen)
    hidden, index = config["hidden_size"], config["num_hidden_layers"]
    prefix, last = f"model.layers.{index}", f"model.layers.{index - 1}."
    if copy_last_layer:
        layer = {prefix + name[len(last) - 1:]: t.clone() for name, t in weights.items() if name.startswith(last)}
        eh_proj = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1).to(torch.bfloat16)
    else:
        layer = _layer_weights(config, index, normal, linear, gen)
        eh_proj = linear(hidden, 2 * hidden)
    return {**layer, f"{prefix}.enorm.weight": _ones(hidden), f"{prefix}.hnorm.weight": _ones(hidden),
            f"{prefix}.eh_proj.weight": eh_proj, f"{prefix}.shared_head.norm.weight": _ones(hidden),
            f"{prefix}.embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
            f"{prefix}.shared_head.head.weight": weights["lm_head.weight"].clone()}


def _attention_weights(config: dict, prefix: str, linear) -> dict[str, torch.Tensor]:
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    q_rank, kv_rank, rope = config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    nope, v_dim = config["qk_nope_head_dim"], config["v_head_dim"]
    return {
        f"{prefix}.q_a_proj.weight": linear(q_rank, hidden),
        f"{prefix}.q_a_layernorm.weight": _ones(q_rank),
        f"{prefix}.q_b_proj.weight": linear(heads * (nope + rope), q_rank),
        f"{prefix}.kv_a_proj_with_mqa.weight": linear(kv_rank + rope, hidden),
        f"{prefix}.kv_a_layernorm.weight": _ones(kv_rank),
        f"{prefix}.kv_b_proj.weight": linear(heads * (nope + v_dim), kv_rank),
        f"{prefix}.o_proj.weight": linear(hidden, heads * v_dim, _ATTN_GAIN),
    }


def _mlp_weights(prefix: str, hidden: int, intermediate: int, linear,
                 gain: float = _MLP_GAIN) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.gate_proj.weight": linear(intermediate, hidden),
        f"{prefix}.up_proj.weight": linear(intermediate, hidden),
        f"{prefix}.down_proj.weight": linear(hidden, intermediate, gain),
    }


def _moe_weights(config: dict, prefix: str, linear, normal, gen: torch.Generator) -> dict[str, torch.Tensor]:
    hidden, experts = config["hidden_size"], config["n_routed_experts"]
    moe_inter = config["moe_intermediate_size"]
    weights = {
        f"{prefix}.gate.weight": normal(experts, hidden, std=_ROUTER_LOGIT_STD / math.sqrt(hidden)),
        # Real V3 checkpoints keep the routing bias in float32; a small nonzero bias makes it matter.
        f"{prefix}.gate.e_score_correction_bias": (torch.rand(experts, generator=gen) - 0.5) * 0.1,
    }
    for j in range(experts):
        weights.update(_mlp_weights(f"{prefix}.experts.{j}", hidden, moe_inter, linear, _ROUTED_EXPERT_GAIN))
    shared = moe_inter * config["n_shared_experts"]
    weights.update(_mlp_weights(f"{prefix}.shared_experts", hidden, shared, linear))
    return weights


def _ones(size: int) -> torch.Tensor:
    return torch.ones(size, dtype=torch.bfloat16)


