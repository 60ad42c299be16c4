"""A tiny random DeepSeek-V4 in the layout DeepSeek releases V4-Flash / V4-Pro in (`ktserve make-demo-model
--arch deepseek_v4`): the original tensor names (`embed.weight`, `layers.N.attn.wq_a.weight`,
`layers.N.ffn.experts.E.w1.weight`, `head.weight`, `hc_head_fn`, `mtp.0.*`), config.json with
`quantization_config` fp8 / e4m3 / 128x128 / ue8m0, FP8 non-expert projections with a UE8M0 `.scale` per
128x128 block, MXFP4 routed experts (packed E2M1 pairs `[n, k/2]` + a UE8M0 scale per 32 weights), the
hash-routing tables of the first MoE layers, fp32 hyper-connection, norm, sink and compressor parameters,
one multi-token-prediction layer (random, or with `mtp="last-layer"` a copy of the last layer that drafts what
the model itself would say more often), and the DeepSeek tokenizer.

Its dimensions are small but keep the formats' block sizes: hidden and projection widths are multiples of
128 where FP8 blocks are (one projection, `wo_a`, has a partial last block as real ones may), expert widths
multiples of 32 for MXFP4. Its layers cover each attention kind V4 has (sliding window only, compressed
sparse with the indexer, heavily compressed)."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from engines.checkpoints import mxfp4
from engines.checkpoints.fp8 import quantize_blocks
from engines.checkpoints.model_dir import write_model_dir
from engines.demo_model import DEMO_SEED
from engines.kt.families.deepseek_v4.names import draft_layer_name

# Gains as in the V3 demo (engines/demo_model.py explains them): sublayers add a fraction of the stream.
_ATTN_GAIN = 0.5
_MLP_GAIN = 0.2
_ROUTED_EXPERT_GAIN = 0.15
_LOGIT_STD = 8.0


def demo_config_v4(**overrides) -> dict:
    """config.json of the tiny V4, in the released file's key names (`compress_ratios`, `num_hash_layers`,
    `qk_rope_head_dim`, `rope_scaling`, `quantization_config`)."""
    config = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "vocab_size": 129280,
        "hidden_size": 256,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "qk_rope_head_dim": 32,
        "q_lora_rank": 128,
        "o_groups": 2,
        "o_lora_rank": 96,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "num_hash_layers": 2,
        # one layer of each attention kind: sliding window only (0), compressed sparse with the indexer (4),
        # heavily compressed (128)
        "compress_ratios": [0, 4, 128, 4],
        "sliding_window": 16,
        "index_n_heads": 8,
        "index_head_dim": 64,
        "index_topk": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "max_position_embeddings": 1048576,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "num_nextn_predict_layers": 1,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                "scale_fmt": "ue8m0", "activation_scheme": "dynamic"},
    }
    config.update(overrides)
    return config


def make_demo_model_v4(out_dir: str | Path, seed: int = DEMO_SEED, mtp: str | None = "random", **overrides) -> Path:
    """Write the tiny V4 into `out_dir` and return it; the same seed gives the same bytes (the main model's whatever
    `mtp` is). `mtp`: the multi-token-prediction layer, "random", "last-layer" (`copy_last_layer_as_mtp`) or None
    (a checkpoint without one)."""
    if mtp not in ("random", "last-layer", None):
        raise ValueError(f"mtp: {mtp!r} is not random, last-layer or None")
    config = demo_config_v4(**overrides)
    weights = V4Weights(config, seed).all()
    if mtp == "last-layer":
        weights.update(copy_last_layer_as_mtp(config, weights))
    elif mtp is None:
        weights = {name: t for name, t in weights.items() if not name.startswith("mtp.")}
    return write_model_dir(out_dir, config, weights)


def copy_last_layer_as_mtp(config: dict, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An MTP layer (`mtp.0.*`) whose block is the model's last layer (its compressor aside: the MTP block attends
    over a sliding window only), `e_proj` passing the next token's (normed) embedding through and `h_proj` zero, the
    model's own final norm and hyper-connection head: its draft follows the model's path closely, so it is
    accepted far more often than a random layer's (the mechanism's ceiling with random weights). `weights`: the
    checkpoint's tensors under their released names."""
    hidden, last = config["hidden_size"], f"layers.{config['num_hidden_layers'] - 1}."
    out = {f"mtp.0.{name[len(last):]}": t.clone() for name, t in weights.items() if name.startswith(last)}
    out = {name: t for name, t in out.items() if draft_layer_name(name, 0) is not None}  # no compressor
    for name, matrix in (("e_proj", torch.eye(hidden)), ("h_proj", torch.zeros(hidden, hidden))):
        weight, scale = quantize_blocks(matrix, ue8m0=True)
        out[f"mtp.0.{name}.weight"], out[f"mtp.0.{name}.scale"] = weight, scale.view(torch.float8_e8m0fnu)
    out["mtp.0.enorm.weight"], out["mtp.0.hnorm.weight"] = torch.ones(hidden), torch.ones(hidden)
    out["mtp.0.norm.weight"] = weights["norm.weight"].clone()
    for part in ("fn", "base", "scale"):
        out[f"mtp.0.hc_head_{part}"] = weights[f"hc_head_{part}"].clone()
    return out


class V4Weights:
    """Every tensor of the checkpoint under its released name, drawn in a fixed order from the seed."""

    def __init__(self, config: dict, seed: int):
        self.c = config
        self.gen = torch.Generator().manual_seed(seed)
        self.out: dict[str, torch.Tensor] = {}

    def normal(self, *shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * std

    def fp8(self, name: str, rows: int, cols: int, gain: float = 1.0) -> None:
        weight, scale = quantize_blocks(self.normal(rows, cols, std=gain / math.sqrt(cols)), ue8m0=True)
        self.out[f"{name}.weight"] = weight
        self.out[f"{name}.scale"] = scale.view(torch.float8_e8m0fnu)

    def plain(self, name: str, tensor: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        self.out[name] = tensor.to(dtype)

    def all(self) -> dict[str, torch.Tensor]:
        c = self.c
        hidden, vocab = c["hidden_size"], c["vocab_size"]
        self.plain("embed.weight", self.normal(vocab, hidden, std=1.0), torch.bfloat16)
        for i in range(c["num_hidden_layers"]):
            self.block(f"layers.{i}", i)
        self.plain("norm.weight", torch.ones(hidden))
        self.hyper_head("hc_head")
        self.plain("head.weight", self.normal(vocab, hidden, std=_LOGIT_STD / math.sqrt(hidden)), torch.bfloat16)
        self.mtp("mtp.0")
        return self.out

    def block(self, p: str, layer: int | None) -> None:
        """Decoder layer `layer`'s tensors under `p`; None: the MTP layer's block (sliding-window attention, top-k
        routing)."""
        hidden = self.c["hidden_size"]
        self.plain(f"{p}.attn_norm.weight", torch.ones(hidden))
        self.plain(f"{p}.ffn_norm.weight", torch.ones(hidden))
        for kind in ("attn", "ffn"):
            self.hyper_connection(f"{p}.hc_{kind}")
        self.attention(f"{p}.attn", 0 if layer is None else self.c["compress_ratios"][layer])
        self.moe(f"{p}.ffn", hashed=layer is not None and layer < self.c["num_hash_layers"])

    def hyper_connection(self, p: str) -> None:
        hc, hidden = self.c["hc_mult"], self.c["hidden_size"]
        mix = (2 + hc) * hc
        self.plain(f"{p}_fn", self.normal(mix, hc * hidden, std=0.02))
        self.plain(f"{p}_base", self.normal(mix, std=0.1))
        self.plain(f"{p}_scale", torch.ones(3))

    def hyper_head(self, p: str) -> None:
        hc, hidden = self.c["hc_mult"], self.c["hidden_size"]
        self.plain(f"{p}_fn", self.normal(hc, hc * hidden, std=0.02))
        self.plain(f"{p}_base", self.normal(hc, std=0.1))
        self.plain(f"{p}_scale", torch.ones(1))

    def attention(self, p: str, ratio: int) -> None:
        c = self.c
        hidden, heads, head_dim, q_rank = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
        groups, o_rank = c["o_groups"], c["o_lora_rank"]
        self.plain(f"{p}.attn_sink", self.normal(heads, std=0.5))
        self.fp8(f"{p}.wq_a", q_rank, hidden)
        self.plain(f"{p}.q_norm.weight", torch.ones(q_rank))
        self.fp8(f"{p}.wq_b", heads * head_dim, q_rank)
        self.fp8(f"{p}.wkv", head_dim, hidden)
        self.plain(f"{p}.kv_norm.weight", torch.ones(head_dim))
        self.fp8(f"{p}.wo_a", groups * o_rank, heads * head_dim // groups)
        self.fp8(f"{p}.wo_b", hidden, groups * o_rank, _ATTN_GAIN)
        if ratio:
            self.compressor(f"{p}.compressor", ratio, head_dim)
        if ratio == 4:
            index_heads, index_dim = c["index_n_heads"], c["index_head_dim"]
            self.fp8(f"{p}.indexer.wq_b", index_heads * index_dim, q_rank)
            self.plain(f"{p}.indexer.weights_proj.weight", self.normal(index_heads, hidden, std=hidden ** -0.5),
                       torch.bfloat16)
            self.compressor(f"{p}.indexer.compressor", ratio, index_dim)

    def compressor(self, p: str, ratio: int, head_dim: int) -> None:
        """Compressors compute in float32 and are stored so; the overlapping one (ratio 4) is twice as wide."""
        hidden, width = self.c["hidden_size"], (2 if ratio == 4 else 1) * head_dim
        self.plain(f"{p}.ape", self.normal(ratio, width, std=0.1))
        self.plain(f"{p}.wkv.weight", self.normal(width, hidden, std=hidden ** -0.5))
        self.plain(f"{p}.wgate.weight", self.normal(width, hidden, std=hidden ** -0.5))
        self.plain(f"{p}.norm.weight", torch.ones(head_dim))

    def moe(self, p: str, hashed: bool) -> None:
        c = self.c
        hidden, inter, experts = c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"]
        self.plain(f"{p}.gate.weight", self.normal(experts, hidden, std=hidden ** -0.5), torch.bfloat16)
        if hashed:  # a fixed token -> experts table: top-k distinct experts per token
            order = torch.rand(c["vocab_size"], experts, generator=self.gen).argsort(-1)
            self.plain(f"{p}.gate.tid2eid", order[:, :c["num_experts_per_tok"]], torch.int32)
        else:
            self.plain(f"{p}.gate.bias", (torch.rand(experts, generator=self.gen) - 0.5) * 0.1)
        for e in range(experts):
            for proj, (rows, cols, gain) in (("w1", (inter, hidden, 1.0)), ("w3", (inter, hidden, 1.0)),
                                            ("w2", (hidden, inter, _ROUTED_EXPERT_GAIN))):
                packed, scale = mxfp4.quantize(self.normal(rows, cols, std=gain / math.sqrt(cols)))
                self.out[f"{p}.experts.{e}.{proj}.weight"] = packed.view(torch.int8)
                self.out[f"{p}.experts.{e}.{proj}.scale"] = scale.view(torch.float8_e8m0fnu)
        self.fp8(f"{p}.shared_experts.w1", inter, hidden)
        self.fp8(f"{p}.shared_experts.w3", inter, hidden)
        self.fp8(f"{p}.shared_experts.w2", hidden, inter, _MLP_GAIN)

    def mtp(self, p: str) -> None:
        """The multi-token-prediction layer: the embedding and hidden-state norms and projections, one block
        attending over its sliding window only (compress ratio 0, as V4's config gives the MTP layer), and its own
        hyper-connection head and norm."""
        hidden = self.c["hidden_size"]
        self.plain(f"{p}.enorm.weight", torch.ones(hidden))
        self.plain(f"{p}.hnorm.weight", torch.ones(hidden))
        self.fp8(f"{p}.e_proj", hidden, hidden)
        self.fp8(f"{p}.h_proj", hidden, hidden)
        self.block(p, None)
        self.plain(f"{p}.norm.weight", torch.ones(hidden))
        self.hyper_head(f"{p}.hc_head")
