"""DeepSeek-V3's multi-token-prediction (MTP) layer, served as the KT engine's draft head (V3, R1, V3.1 and V3.2
ship one, V3.2's a decoder layer with its own lightning indexer; engines/kt/drafting.py runs it,
engines/runtime/speculative.py verifies what it proposes).

Released checkpoints store it as decoder layer `model.layers.<num_hidden_layers>` (attention and MoE like any
other layer) plus `enorm` and `hnorm` (RMSNorms of a token's embedding and of the main model's final hidden
state), `eh_proj` (2 x hidden -> hidden) and `shared_head.norm`; its `embed_tokens` and `shared_head.head` are
copies of the main model's embedding and LM head, which serve in their place. At position i, with h_i the main
model's final (normed) hidden state and t_{i+1} the token that follows it:

    x = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))
    x = x + self_attn(input_layernorm(x))          (attending over the layer's own KV cache)
    x = x + mlp(post_attention_layernorm(x))
    logits of t_{i+2} = lm_head(shared_head.norm(x))

as in the DeepSeek-V3 technical report (section 2.2) and transformers' `MtpLayer`; a longer chain feeds x back
in place of h at the next position, as vLLM does with a single layer.

The layer is built and placed as one more decoder layer (`add_layer`: the placement rules and the loader see
`model.layers.N` as they see the others, so its experts go to kt-kernel and its attention is our MLA over
layer N of the latent cache) and taken out of the model once loaded (`MTPHead.take`), so the main model's
steps, CUDA graphs, expert deferral and LoRA never see it."""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engines.kt.families.deepseek_mla.attention import MLAAttention, StepBatch
from engines.checkpoints.source import tensor_names

# the MTP layer's copies of the main model's embedding and LM head: the main model's own serve instead
SHARED_COPIES = re.compile(r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$")


def mtp_layer_index(model_path: Path, config: Any) -> int | None:
    """The index of the checkpoint's MTP layer (config.num_hidden_layers), or None when it ships none."""
    n = config.num_hidden_layers
    return n if f"model.layers.{n}.eh_proj.weight" in tensor_names(model_path) else None


def add_layer(model: nn.Module, config: Any) -> None:
    """Append the MTP layer to `model.model.layers` as a decoder layer with its four extra parts (call on the
    meta device, before placement)."""
    inner = model.model
    index = len(inner.layers)
    types = getattr(config, "mlp_layer_types", None)
    if types is not None and len(types) <= index:  # V3.2's config lists the decoder layers' MLPs; the MTP layer's
        config = copy.copy(config)                  # is a MoE, as in V3's release
        config.mlp_layer_types = [*types, "sparse"]
    block = type(inner.layers[-1])(config, index)
    norm = type(inner.norm)
    block.enorm = norm(config.hidden_size, eps=config.rms_norm_eps)
    block.hnorm = norm(config.hidden_size, eps=config.rms_norm_eps)
    block.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    block.shared_head = nn.Module()
    block.shared_head.norm = norm(config.hidden_size, eps=config.rms_norm_eps)
    inner.layers.append(block)


class MTPHead(nn.Module):
    """The draft head (engines/kt/drafting.py: DraftHead) of a V3-architecture checkpoint."""

    def __init__(self, block: nn.Module, embed: nn.Module, lm_head: nn.Module, scope: Any):
        super().__init__()
        self.block = block
        self.device = block.self_attn.o_proj.weight.device
        self.layer = block.self_attn.layer  # its layer of the latent KV cache
        self._embed, self._lm_head = [embed], [lm_head]  # the main model's, not this module's parameters
        self._scope = scope  # device -> context making it current (several GPUs)

    @classmethod
    def take(cls, model: nn.Module, scope: Any) -> "MTPHead":
        """Remove the MTP layer `add_layer` appended (now loaded) from the model and wrap it."""
        layers = list(model.model.layers)
        block = layers[-1]
        if not isinstance(block.self_attn, MLAAttention):
            raise ValueError(f"placement rules: the multi-token-prediction layer's attention, model.layers."
                             f"{len(layers) - 1}.self_attn, must be replaced by "
                             f"engines.kt.placement.operators.MLAAttention like the other layers' (found "
                             f"{type(block.self_attn).__name__})")
        model.model.layers = nn.ModuleList(layers[:-1])
        return cls(block, model.model.embed_tokens, model.lm_head, scope)

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """The layer's output x at the batch's positions, from the main model's final hidden states there (or a
        previous draft step's x) and the token after each position; writes the layer's KV cache."""
        b, device = self.block, self.device
        embedded = self._embed[0](next_ids.to(self._embed[0].weight.device)).to(device)
        with self._scope(device):
            x = b.eh_proj(torch.cat([b.enorm(embedded), b.hnorm(hidden.to(device))], dim=-1))
            x = x + b.self_attn(b.input_layernorm(x), batch)
            return x + b.mlp(b.post_attention_layernorm(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        head = self._lm_head[0]
        with self._scope(self.device):
            normed = self.block.shared_head.norm(x)
        return head(normed.to(head.weight.device))
