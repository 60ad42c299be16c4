"""A tiny random DeepSeek-V3.2 in the layout DeepSeek released it (`ktserve make-demo-model --arch deepseek_v32`).

What makes it V3.2's release rather than the V3 demo with two more keys:
- config.json says `model_type: deepseek_v32` with the indexer's sizes (`index_n_heads`, `index_head_dim`,
  `index_topk`) and the FP8 `quantization_config` (e4m3, 128x128 blocks, `scale_fmt: ue8m0`);
- every linear of attention and the MLPs (the indexer's `wq_b` and `wk` too) is float8_e4m3fn with a float32
  `weight_scale_inv` per 128x128 block, a power of two as in the V3.1/V3.2 releases; embeddings, LM head,
  norms, routers, the indexer's `k_norm` and `weights_proj` stay bf16 (the routing bias float32);
- the indexer's tensors sit under `model.layers.N.self_attn.indexer.*`;
- no jinja chat template: the conversation format is V3.2's own (chat.py);
- one multi-token-prediction layer follows the decoder layers (`model.layers.<num_hidden_layers>.*`: a whole
  decoder layer with its own indexer, plus `enorm`, `hnorm`, `eh_proj`, its own `embed_tokens` and
  `shared_head`), which serving skips.
The V3 demo's writers draw the decoder and the MTP layer (engines/demo_model.py) and quantize the release.

The widths keep the release's relation to the 128 blocks: the hidden size, the ranks, the experts' widths and
the indexer's head are whole blocks; the latent projection's output (kv_lora_rank + rope) ends in a part block,
as 576 does in the real model. `index_topk` is 64, so prompts past 64 tokens exercise the selection."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from engines.checkpoints.model_dir import fp8_release, write_model_dir
from engines.demo_model import DEMO_SEED
from engines.kt.families.deepseek_mla.demo_model import (_draws, _layer_weights, _random_weights, demo_config,
                                                         mtp_layer_tensors)

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


def make_demo_model_v32(out_dir: str | Path, seed: int = DEMO_SEED, mtp: str = "random", **overrides) -> Path:
    """Write the V3.2 demo into `out_dir` and return it; the same seed gives the same bytes. `mtp`: the MTP layer
    drawn at random, or "last-layer": a copy of the model's last layer, indexer included, whose drafts are
    often accepted (engines/demo_model.py: mtp_layer_tensors)."""
    if mtp not in ("random", "last-layer"):
        raise ValueError(f"mtp: {mtp!r} is not one of random, last-layer")
    config = v32_config(**overrides)
    # no jinja chat template, as the final release (its format is V3.2's own, encoded in Python: chat.py)
    return write_model_dir(out_dir, config, fp8_release(random_bf16_weights(config, seed, mtp == "last-layer"), is_fp8, ue8m0=True),
                           chat_template=False)


def is_fp8(name: str) -> bool:
    return name.endswith(".weight") and name.rpartition(".")[0].rpartition(".")[2] in _FP8_LINEARS


def random_bf16_weights(config: dict, seed: int, copy_last_layer: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor under its released name, before FP8 quantization: the V3 demo's decoder and MTP layer, then
    every layer's indexer, drawn on from the MTP layer's decoder layer (seed + 1). The test figures
    (docs/models/deepseek-v32.md, tests/engines/kt/families/deepseek_v32/test_kt_deepseek_v32.py) were measured on these
    bytes: past index_topk a near tie in the indexer's scores decides which positions attend, so other draws give other
    figures."""
    weights = _random_weights(config, seed)
    weights.update(mtp_layer_tensors(config, weights, seed + 1, copy_last_layer))
    gen = torch.Generator().manual_seed(seed + 1)
    normal, linear = _draws(gen)
    _layer_weights(config, config["num_hidden_layers"], normal, linear, gen)  # the MTP decoder layer's draws
    for i in range(config["num_hidden_layers"] + config["num_nextn_predict_layers"]):
        weights.update(indexer_weights(config, f"model.layers.{i}.self_attn.indexer", linear, normal))
    if copy_last_layer:  # drawn all the same, so the main layers' bytes do not change
        last, mtp = (f"model.layers.{i}.self_attn.indexer." for i in (config["num_hidden_layers"] - 1,
                                                                       config["num_hidden_layers"]))
        weights.update({mtp + name[len(last):]: t.clone() for name, t in list(weights.items())
                        if name.startswith(last)})
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
