"""A tiny random DeepSeek-V3.2 in the layout DeepSeek released it (`ktserve make-demo-model --arch deepseek_v32`).

What makes it V3.2's release rather than the V3 demo with two more keys:
- config.json says `model_type: deepseek_v32` with the indexer's sizes (`index_n_heads`, `index_head_dim`,
  `index_topk`) and the FP8 `quantization_config` (e4m3, 128x128 blocks, `scale_fmt: ue8m0`);
- every linear of attention and the MLPs (the indexer's `wq_b` and `wk` too) is float8_e4m3fn with a float32
  `weight_scale_inv` per 128x128 block, a power of two as in the V3.1/V3.2 releases; embeddings, LM head,
  norms, routers, the indexer's `k_norm` and `weights_proj` stay bf16 (the routing bias float32);
- the indexer's tensors sit under `model.layers.N.self_attn.indexer.*`;
- one multi-token-prediction layer follows the decoder layers (`model.layers.<num_hidden_layers>.*`: a whole
  decoder layer plus `enorm`, `hnorm`, `eh_proj`, its own `embed_tokens` and `shared_head`), which serving skips.

The widths keep the release's relation to the 128 blocks: the hidden size, the ranks, the experts' widths and
the indexer's head are whole blocks; the latent projection's output (kv_lora_rank + rope) ends in a part block,
as 576 does in the real model. `index_topk` is 64, so prompts past 64 tokens exercise the selection."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from engines.checkpoints.fp8 import quantize_blocks, ue8m0_to_float
from engines.demo_model import DEMO_SEED, _ones, decoder_layer_weights, demo_config, drawers, write_model_dir

INDEX_TOPK = 64
# projections DeepSeek ships in FP8 (the last name component before `.weight`)
_FP8_LINEARS = frozenset({"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                          "up_proj", "down_proj", "wq_b", "wk", "eh_proj"})


def v32_config(**overrides) -> dict:
    config = demo_config(
        architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", kv_lora_rank=128,
        index_n_heads=8, index_head_dim=128, index_topk=INDEX_TOPK, num_nextn_predict_layers=1,
        quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                             "scale_fmt": "ue8m0", "weight_block_size": [128, 128]})
    config.update(overrides)
    return config


def make_demo_model(out_dir: str | Path, seed: int = DEMO_SEED, **overrides) -> Path:
    """Write the V3.2 demo into `out_dir` and return it; the same seed gives the same bytes."""
    config = v32_config(**overrides)
    return write_model_dir(out_dir, config, released(random_bf16_weights(config, seed)))


def random_bf16_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor under its released name, before FP8 quantization: the V3 demo's draws for the decoder,
    then the indexers and the MTP layer from a second stream (so the V3 part matches the V3 demo's)."""
    from engines.demo_model import _random_weights

    weights = _random_weights(config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    normal, linear = drawers(gen)
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    mtp = range(layers, layers + config["num_nextn_predict_layers"])
    for i in mtp:
        weights.update(decoder_layer_weights(config, i, linear, normal, gen))
    for i in [*range(layers), *mtp]:
        weights.update(indexer_weights(config, f"model.layers.{i}.self_attn.indexer", linear, normal))
    for i in mtp:
        prefix = f"model.layers.{i}"
        weights[f"{prefix}.enorm.weight"] = _ones(hidden)
        weights[f"{prefix}.hnorm.weight"] = _ones(hidden)
        weights[f"{prefix}.eh_proj.weight"] = linear(hidden, 2 * hidden)
        weights[f"{prefix}.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
        weights[f"{prefix}.shared_head.norm.weight"] = _ones(hidden)
        weights[f"{prefix}.shared_head.head.weight"] = weights["lm_head.weight"].clone()
    return weights


def indexer_weights(config: dict, prefix: str, linear, normal) -> dict[str, torch.Tensor]:
    heads, dim, hidden = config["index_n_heads"], config["index_head_dim"], config["hidden_size"]
    return {
        f"{prefix}.wq_b.weight": linear(heads * dim, config["q_lora_rank"]),
        f"{prefix}.wk.weight": linear(dim, hidden),
        # not the identity, so a key norm applied wrongly shows
        f"{prefix}.k_norm.weight": (1.0 + normal(dim, std=0.1).float()).to(torch.bfloat16),
        f"{prefix}.k_norm.bias": normal(dim, std=0.1),
        f"{prefix}.weights_proj.weight": normal(heads, hidden, std=1.0 / math.sqrt(hidden)),
    }


def released(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The FP8 projections as DeepSeek ships them: e4m3 weight, then its power-of-two `weight_scale_inv`."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.rpartition(".")[0].rpartition(".")[2] in _FP8_LINEARS and name.endswith(".weight"):
            quantized, exponents = quantize_blocks(tensor, ue8m0=True)
            out[name] = quantized
            out[name + "_scale_inv"] = ue8m0_to_float(exponents)
        else:
            out[name] = tensor
    return out
