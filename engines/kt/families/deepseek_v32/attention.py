"""DeepSeek Sparse Attention (DSA): V3's MLA where each query attends only to the `index_topk` earlier positions
the lightning indexer scores highest.

The indexer has its own small projections: queries from MLA's low-rank query (`wq_b`, index_n_heads heads of
index_head_dim), one key per token from the hidden state (`wk`, then a LayerNorm), and per-head weights from the
hidden state (`weights_proj`, float32). A position's score for a query is sum_h w_h * relu(q_h . k) / sqrt(d);
the first qk_rope_head_dim numbers of queries and keys carry rotary positions, *not* interleaved (MLA's are).
DeepSeek's kernels score in FP8 after a Hadamard rotation; the rotation preserves dot products, so this scores
in float32 as transformers' reference does. Keys are cached per sequence beside the latents
(cache.IndexedLatentKVCache). Where a sequence has at most `index_topk` positions the selection is all of them,
and the layer computes exactly V3's attention."""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from engines.kt.families.deepseek_mla.attention import DecodeBatch, MLAAttention, Span, StepBatch
from engines.kt.layers import layer_index


class IndexedMLAAttention(MLAAttention):
    KWARGS = MLAAttention.KWARGS

    def __init__(self, hf_attention: nn.Module, config: Any, layer: int, device: str, absorb: bool):
        super().__init__(hf_attention, config, layer, device, absorb)
        modeling = sys.modules[type(hf_attention).__module__]
        self._apply_rope = lambda q, k, pe: modeling.apply_rotary_pos_emb_interleave(q, k, pe[0], pe[1])
        self._index_rope = modeling.apply_rotary_pos_emb
        self.indexer = hf_attention.indexer
        self.index_topk = config.index_topk
        self.index_heads, self.index_dim = config.index_n_heads, config.index_head_dim

    @classmethod
    def from_module(cls, module: nn.Module, name: str, config: Any, options: Any = None, device: str = "cpu",
                    absorb: bool = True, **_: Any) -> "IndexedMLAAttention":
        if not hasattr(module, "indexer"):
            raise ValueError("the module has no lightning indexer (IndexedMLAAttention is for DeepSeek-V3.2)")
        return cls(module, config, layer_index(name), device, bool(absorb))

    # ------------------------------------------------------------------------------------ the steps
    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        rope = batch.rope(x)
        q_low = self.q_a_layernorm(self.q_a_proj(x))
        q_nope, q_pe, latent, k_pe = self._project(x, rope, q_low)
        write = self._write_slots(x, batch)
        batch.cache.write(self.layer, write, latent, k_pe)
        queries, weights, keys = self._index_inputs(x, q_low, rope)
        batch.cache.write_index(self.layer, write, keys)

        def select(span: Span, rows: slice, read: torch.Tensor) -> torch.Tensor | None:
            length = span.start + span.n
            if length <= self.index_topk:
                return None  # every earlier position is selected
            scores = index_scores(queries[rows], weights[rows], batch.cache.read_index(self.layer, read))
            positions = torch.arange(length, device=x.device)
            causal = positions[None, :] <= positions[span.start:, None]
            return top_positions(scores, causal, self.index_topk)

        out = self._attend_spans(x, q_nope, q_pe, batch, select)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.v_dim))

    def decode(self, x: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """One token for each of B sequences over fixed-shape gathers (capturable: the selection is a fixed-k
        top-k over the padded row, the padding masked out)."""
        rope = batch.rope(x)
        q_low = self.q_a_layernorm(self.q_a_proj(x))
        q_nope, q_pe, latent, k_pe = self._project(x, rope, q_low)
        batch.cache.write(self.layer, batch.write_slots, latent, k_pe)
        queries, weights, keys = self._index_inputs(x, q_low, rope)
        batch.cache.write_index(self.layer, batch.write_slots, keys)
        mask = batch.mask
        if mask.shape[1] > self.index_topk:
            scores = index_scores(queries.unsqueeze(1), weights.unsqueeze(1),
                                  batch.cache.read_index(self.layer, batch.read_slots))  # [B, 1, L]
            mask = top_positions(scores[:, 0], mask, self.index_topk)
        return self._decode_attend(x, q_nope, q_pe, batch, mask)

    # ------------------------------------------------------------------------------------ the indexer
    def _index_inputs(self, x: torch.Tensor, q_low: torch.Tensor, rope: Any
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The indexer's queries [t, H, D] and head weights [t, H] (float32), and the tokens' keys [t, D]."""
        t, ix = x.shape[0], self.indexer
        q = ix.wq_b(q_low).view(1, t, self.index_heads, self.index_dim)
        k = ix.k_norm(ix.wk(x)).view(1, t, 1, self.index_dim)
        rot = self.rope_dim
        q_rot, k_rot = self._index_rope(q[..., :rot], k[..., :rot], rope[0], rope[1], unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., rot:]], dim=-1)[0]
        k = torch.cat([k_rot, k[..., rot:]], dim=-1)[0, :, 0]
        weights = ix.weights_proj(x.to(ix.weights_proj.weight.dtype)).float() * self.index_heads ** -0.5
        return q, weights, k


def index_scores(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """queries [..., n, H, D], weights [..., n, H], keys [..., L, D] -> scores [..., n, L] (float32):
    sum over heads of w_h * relu(q_h . k / sqrt(D)), in the reference's order of operations."""
    dim = queries.shape[-1]
    dots = torch.matmul(queries.float(), keys.float().transpose(-1, -2).unsqueeze(-3)) * dim ** -0.5
    return torch.matmul(weights.unsqueeze(-2), torch.relu(dots)).squeeze(-2)


def top_positions(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """[n, L] bool: per row, the `k` allowed positions of highest score (all allowed ones where fewer)."""
    scores = scores.masked_fill(~allowed, float("-inf"))
    picked = scores.topk(min(k, scores.shape[-1]), dim=-1).indices
    return torch.zeros_like(allowed).scatter(-1, picked, True) & allowed
