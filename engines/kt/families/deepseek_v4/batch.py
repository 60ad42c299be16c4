"""A DeepSeek-V4 step over the rows of every sequence in it: transformers' V4 modules, driven layer by layer.

The step's tokens (prompt chunks and decode tokens of many sequences) are one flat run of rows, [1, rows, ...]
in transformers' shapes. Everything that works row by row sees all of them at once: the embeddings, the
hyper-connections (mHC) around each block, the norms, the routers (hash routing by each row's token id), the
routed experts (so kt-kernel gets every row of the step in one call per layer), the shared expert, the final
hyper-head and norm. Only attention looks at sequences: each sequence's rows attend with its own rotary
positions, its own sliding-window mask and its own cache (sliding-window keys, compressor and indexer state),
one sequence after another.

The layer's arithmetic is `DeepseekV4DecoderLayer.forward` and the MoE block's is `DeepseekV4SparseMoeBlock`'s,
written out here so attention can be split by sequence and the CPU experts overlapped with the shared expert
(`submit`, shared expert, `wait`) without renaming any module: placement rules, the checkpoint loader and LoRA
adapters address the same module paths as in transformers' model.

LoRA: the step's `AdapterRows` cover the flat rows; inside one sequence's attention the context holds that
sequence's adapter alone (its rows are all the attention's linears see)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engines.lora.modules import AdapterRows, LoraContext


@dataclass(slots=True)
class Piece:
    """Feed positions [start, end) of `token_ids` through `cache` (extended by them), with `adapter`."""

    token_ids: list[int]
    start: int
    end: int
    cache: Any  # transformers' DynamicCache of V4 cache layers
    adapter: str | None


@dataclass(slots=True)
class _Segment:
    """One piece's rows [row, row + n) of the step and what its attention needs."""

    row: int
    n: int
    cache: Any
    positions: torch.Tensor  # [1, n]
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor | None
    rows: AdapterRows


class V4Batch:
    """Runs steps of many sequences through a placed `DeepseekV4ForCausalLM`'s layers."""

    def __init__(self, model: nn.Module, lora: LoraContext):
        self.inner = model.model
        self.config = model.config
        self.layers = list(self.inner.layers)
        self.lora = lora
        self.embed_device = self.inner.embed_tokens.weight.device

    def hidden_streams(self, pieces: list[Piece]) -> torch.Tensor:
        """The last layer's hyper-connection streams of every piece's rows, in piece order: [rows, hc, hidden]."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        ids = torch.tensor([t for p in pieces for t in p.token_ids[p.start:p.end]], device=self.embed_device)[None]
        positions = torch.cat([torch.arange(p.start, p.end) for p in pieces]).to(self.embed_device)[None]
        spans, row = [], 0
        for p in pieces:
            spans.append((p.adapter, row, p.end - p.start))
            row += p.end - p.start
        with self.lora.step(AdapterRows(spans)):
            embeds = self.inner.embed_tokens(ids)
            rope = {kind: self.inner.rotary_emb(embeds, position_ids=positions, layer_type=kind)
                    for kind in ("main", "compress")}
            segments = []
            for p, (adapter, first, n) in zip(pieces, spans):
                cut = slice(first, first + n)
                mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=embeds[:, cut],
                                                         attention_mask=None, cache=p.cache,
                                                         position_ids=positions[:, cut])
                segments.append(_Segment(row=first, n=n, cache=p.cache, positions=positions[:, cut],
                                         rope={k: (cos[:, cut], sin[:, cut]) for k, (cos, sin) in rope.items()},
                                         mask=mask, rows=AdapterRows.uniform(adapter)))
            hidden = embeds.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
            for layer in self.layers:
                hidden = self._layer(layer, hidden, ids, segments)
        return hidden[0]

    def final(self, streams: torch.Tensor) -> torch.Tensor:
        """The final hidden states (hyper-head collapse, then the norm) of [rows, hc, hidden] streams: [rows, hidden]."""
        return self.inner.norm(self.inner.hc_head(streams[None]))[0]

    def _layer(self, layer: nn.Module, hidden: torch.Tensor, ids: torch.Tensor,
               segments: list[_Segment]) -> torch.Tensor:
        post, comb, collapsed = layer.attn_hc(hidden)
        hidden = _mix(post, comb, self._attention(layer.self_attn, layer.input_layernorm(collapsed), segments),
                      hidden)
        post, comb, collapsed = layer.ffn_hc(hidden)
        return _mix(post, comb, self._moe(layer.mlp, layer.post_attention_layernorm(collapsed), ids),
                    hidden)

    def _attention(self, attention: nn.Module, x: torch.Tensor, segments: list[_Segment]) -> torch.Tensor:
        out = []
        for s in segments:
            with self.lora.step(s.rows):
                o, _ = attention(x[:, s.row:s.row + s.n], position_embeddings=s.rope, position_ids=s.positions,
                                 attention_mask=s.mask, cache=s.cache)
            out.append(o)
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)

    @staticmethod
    def _moe(mlp: nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`DeepseekV4SparseMoeBlock` on flat rows (a LoRA'd shared expert indexes its adapters' rows in dim 0);
        CPU experts are started first and waited for after the shared expert."""
        flat = x.reshape(-1, x.shape[-1])
        _, weights, indices = mlp.gate(x, ids) if mlp.is_hash else mlp.gate(x)
        experts = mlp.experts
        if not hasattr(experts, "submit"):  # experts in torch
            return (experts(flat, indices, weights) + mlp.shared_experts(flat)).view_as(x)
        experts.submit(flat, indices, weights)
        shared = mlp.shared_experts(flat)
        return (experts.wait().to(x.dtype) + shared).view_as(x)


def _mix(post: torch.Tensor, comb: torch.Tensor, block: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """A block's output spread over the hyper-connection streams plus the streams mixed by `comb` (as
    `DeepseekV4DecoderLayer` does after attention and after the MoE)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                             streams)
