"""DeepSeek-V4's multi-token-prediction (MTP) layer as the draft head of speculative decoding (`speculative: mtp`).

The release ships one, `mtp.0.*`: a V4 decoder block (hyper-connections, attention, MoE with routed experts and a
shared expert, under the layers' own tensor names) plus `enorm`, `hnorm` (RMSNorms), `e_proj`, `h_proj` (hidden ->
hidden, FP8), its own `norm` and hyper-connection head `hc_head_fn` / `_base` / `_scale`; the embedding and LM
head are the main model's. Unlike V3's, it takes the main model's hidden state before the final collapse: the
hc_mult (4) residual streams H_i [4, hidden] the last layer leaves at position i. With t_{i+1} the token after i:

    x   = h_proj(hnorm(H_i)) + e_proj(enorm(embed(t_{i+1})))      per stream (the embedding term on all four)
    X   = block(x)                                                 the streams the block leaves
    logits of t_{i+2} = head(norm(hc_head(X)))

(DeepSeek's inference code, `MTPBlock`; SGLang's `DeepseekV4ModelNextN`.) A longer chain feeds X in place of H at
the next position. The block attends over a sliding window only — no compressor or indexer, as V4's config gives
the MTP layer (compress ratio 0) and SGLang runs it — over a cache of its own per sequence.

The block is built as one more decoder layer (`add_draft_block`, on the meta device), so the placement rules put
its routed experts in kt-kernel like every layer's and the loader reads `mtp.0.*` as that layer's tensors
(names.py: `draft_layer_name`); once loaded, `V4DraftHead.take` removes it from the model, whose steps never run
it."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engines.checkpoints.source import tensor_names
from engines.kt.families.deepseek_v4.caches import SequenceCache
from engines.runtime.sequence import Sequence

MARKER = "mtp.0.e_proj.weight"  # a checkpoint with this tensor ships the MTP layer


def has_mtp_layer(model_path: Path) -> bool:
    return MARKER in tensor_names(model_path)


def draft_config(config: Any) -> Any:
    """The main config, for a model of one layer that is the MTP block: sliding-window attention, top-k routing
    (hash routing is for the first layers only)."""
    draft = copy.deepcopy(config)
    draft.num_hidden_layers = 1
    draft.layer_types = ["sliding_attention"]
    draft.mlp_layer_types = ["moe"]
    return draft


def add_draft_block(model: nn.Module, config: Any) -> int:
    """Append the MTP block to `model.model.layers` (meta device, before placement); returns its index there."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4DecoderLayer, DeepseekV4HyperHead,
                                                                      DeepseekV4RMSNorm)

    hidden, eps = config.hidden_size, config.rms_norm_eps
    block = DeepseekV4DecoderLayer(draft_config(config), 0)  # layer 0 of its own cache
    block.enorm = DeepseekV4RMSNorm(hidden, eps=eps)
    block.hnorm = DeepseekV4RMSNorm(hidden, eps=eps)
    block.e_proj = nn.Linear(hidden, hidden, bias=False)
    block.h_proj = nn.Linear(hidden, hidden, bias=False)
    block.norm = DeepseekV4RMSNorm(hidden, eps=eps)
    block.hc_head = DeepseekV4HyperHead(config)
    model.model.layers.append(block)
    return len(model.model.layers) - 1


class V4DraftHead(nn.Module):
    """The draft head (engines/kt/drafting.py: DraftHead) of a V4 checkpoint; it runs one sequence at a time over
    that sequence's cache, so its batch is the list of (sequence, start, end) pieces itself (`draft_batch`)."""

    def __init__(self, block: nn.Module, model: nn.Module):
        super().__init__()
        self.block = block
        self.config = block.self_attn.config
        self.device = block.e_proj.weight.device
        inner = model.model
        # the main model's, not this module's parameters
        self._embed, self._lm_head, self._rotary = [inner.embed_tokens], [model.lm_head], [inner.rotary_emb]
        # per sequence, a cache of one sliding-window layer, marked after the last accepted positions it wrote
        self._caches: dict[str, SequenceCache] = {}

    @classmethod
    def take(cls, model: nn.Module) -> "V4DraftHead":
        """Remove the block `add_draft_block` appended (now loaded) from the model and wrap it."""
        layers = list(model.model.layers)
        block = layers[-1]
        model.model.layers = nn.ModuleList(layers[:-1])
        block.enorm.float()  # norms compute in float32, as transformers keeps V4's
        block.hnorm.float()
        return cls(block, model)

    def draft_batch(self, pieces: list[tuple[Sequence, int, int]]) -> list[tuple[Sequence, int, int]]:
        return pieces

    def forget(self, seq: Sequence) -> None:
        self._caches.pop(seq.id, None)

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, pieces: list[tuple[Sequence, int, int]]
                ) -> torch.Tensor:
        """The block's streams [T, hc_mult, hidden] at each piece's positions, from the main model's streams there
        (or the head's own from the position before) [T, hc_mult, hidden] and the token after each position [T]."""
        out, row = [], 0
        for seq, start, end in pieces:
            n = end - start
            out.append(self._run(seq, start, end, hidden[row:row + n], next_ids[row:row + n]))
            row += n
        return torch.cat(out)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        b = self.block
        head = self._lm_head[0]
        normed = b.norm(b.hc_head(states[None]))[0]
        return head(normed.to(head.weight.device)).float()

    def _run(self, seq: Sequence, start: int, end: int, streams: torch.Tensor, next_ids: torch.Tensor
             ) -> torch.Tensor:
        from transformers.masking_utils import create_sliding_window_causal_mask

        b, entry = self.block, self._cache_at(seq, start)
        embed = self._embed[0]
        ids = next_ids.to(embed.weight.device)[None]
        e = b.e_proj(b.enorm(embed(ids).to(self.device)))  # [1, n, hidden]
        x = b.h_proj(b.hnorm(streams.to(self.device)))[None] + e[:, :, None]  # [1, n, hc_mult, hidden]
        positions = torch.arange(start, end, device=self.device)[None]
        rotary = {"main": self._rotary[0](e, position_ids=positions, layer_type="main")}
        mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=e, attention_mask=None,
                                                 cache=entry.cache, position_ids=positions)
        x = b(x, input_ids=ids, position_embeddings=rotary, position_ids=positions, attention_mask=mask,
              cache=entry.cache)
        entry.commit(end)
        if end <= seq.num_computed:  # accepted positions: what the next proposal starts from
            entry.mark()
        return x[0]

    def _cache_at(self, seq: Sequence, start: int) -> SequenceCache:
        """The sequence's cache holding positions [0, start): drafted positions past the accepted ones dropped (the
        head writes them again from the main model's states once verified)."""
        from transformers.cache_utils import DynamicCache

        entry = self._caches.get(seq.id)
        if entry is not None and entry.computed != start:
            if entry.marked == start:
                entry.rollback()
            else:
                entry = None  # a step the head missed: start afresh (drafts worse for a while, outputs unchanged)
        if entry is None:
            entry = self._caches[seq.id] = SequenceCache(DynamicCache(config=self.config))
        return entry
