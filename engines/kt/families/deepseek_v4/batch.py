"""A DeepSeek-V4 step over the rows of every sequence in it: transformers' V4 modules, driven layer by layer.

The step's tokens (prompt chunks and decode tokens of many sequences) are one flat run of rows, [1, rows, ...]
in transformers' shapes. Everything that works row by row sees all of them at once: the embeddings, the
hyper-connections (mHC) around each block, the norms, attention's query / key-value / output projections and
their rotary embedding (each row at its own position), the routers (hash routing by each row's token id), the
routed experts (so kt-kernel gets every row of the step in one call per layer), the shared expert, the final
hyper-head and norm. Only the part of attention that reads a cache looks at sequences: each sequence's rows
extend its own sliding-window keys, run its compressor and indexer over their state, and attend under its own
sliding-window mask, one sequence after another.

The arithmetic is transformers' (`DeepseekV4DecoderLayer`, `DeepseekV4Attention`, `DeepseekV4SparseMoeBlock`),
written out here so attention can be cut at its cache and the CPU experts overlapped with the shared expert
(`submit`, shared expert, `wait`) without renaming any module: placement rules, the checkpoint loader and LoRA
adapters address the same module paths as in transformers' model.

LoRA: the step's `AdapterRows` cover the flat rows, and the linears that see all of them get them flat
([rows, features]: a LoRA'd linear picks its adapters' rows in dim 0); inside one sequence's cached part the
context holds that sequence's adapter alone.

A decode row (a piece of one row) takes a lighter way through its cached part, for the host's sake (a step queues
every op of it from Python): no sliding-window mask (its cache holds only keys it may see), and on a CSA layer,
where the row closes no compressor window, `csa_row` in place of the compressor module. `attend` is transformers'
eager V4 attention without its copy of the shared key-value head per query head. Each gives the module's values.

A piece that verifies a draft carries a `record` (caches.py: StepRecord): its cached part notes there the keys it
appends and the compressor inputs it runs, so its cache can later be taken back to the draft's accepted length."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACompressor, apply_rotary_pos_emb

from engines.kt.families.deepseek_v4.blocks import attend_in_blocks
from engines.kt.families.deepseek_v4.caches import snapshot_layer
from engines.lora.modules import AdapterRows, LoraContext


@dataclass(slots=True)
class Piece:
    """Feed positions [start, end) of `token_ids` through `cache` (extended by them), with `adapter`."""

    token_ids: list[int]
    start: int
    end: int
    cache: Any  # transformers' DynamicCache of V4 cache layers
    adapter: str | None
    record: Any = None  # caches.py: StepRecord to note what the piece puts into the cache (a verified draft)
    paged: Any = None  # paged.py: PagedSequence, where the piece is one decode row over the paged caches
    # where the cache's state after this piece is kept (a prefix cut inside a prompt chunk: the chunk's next piece
    # goes on over the same cache in the same step): each layer's state (caches.py: snapshot_layer) by index
    keep: dict[int, Any] | None = None


class Attending(NamedTuple):
    """A layer's rows at its cached attention: the attention hyper-connection's `post` and `comb` (for the mix
    after it), the normed input `x` [1, rows, hidden], the rotated queries `q` [1, heads, rows, head_dim] and
    keys `kv` [1, 1, rows, head_dim], and the queries' low-rank residual [1, rows, q_lora_rank]."""

    post: torch.Tensor
    comb: torch.Tensor
    x: torch.Tensor
    q: torch.Tensor
    kv: torch.Tensor
    q_residual: torch.Tensor

    def first(self, n: int, kept: bool) -> "Attending":
        """The first `n` rows of what the cached part reads; copied where they are `kept` past the step (a verified
        draft's record keeps its keys and compressor inputs), since the buffers they come from get the next step's
        rows. Otherwise views: the cached part only reads them (the caches keep what they concatenate and project)."""
        if not kept:
            return Attending(self.post, self.comb, self.x[:, :n], self.q[:, :, :n], self.kv[:, :, :n],
                             self.q_residual[:, :n])
        return Attending(self.post, self.comb, self.x[:, :n].clone(), self.q[:, :, :n], self.kv[:, :, :n].clone(),
                         self.q_residual[:, :n].clone())


@dataclass(slots=True)
class _Segment:
    """One piece's rows [row, row + n) of the step and what its cached attention needs."""

    row: int
    n: int
    cache: Any
    positions: torch.Tensor  # [1, n]
    mask: torch.Tensor | None
    rows: AdapterRows
    record: Any
    keep: dict[int, Any] | None = None  # Piece.keep
    # the rows' embeddings, where the piece goes on from an earlier piece of the step over the same cache: its
    # sliding-window mask is made when it first attends, once that piece extended the cache (None: made already)
    mask_from: torch.Tensor | None = None


@dataclass(slots=True)
class Cached:
    """What a step's cached attention needs: a segment per piece over transformers' cache layers, and the decode
    rows over the paged caches (paged.py: their DecodeStep, their rows in the step and those rows' adapters)."""

    segments: list[_Segment]
    rows: int
    paged: Any = None
    paged_rows: torch.Tensor | None = None  # None: every row of the step, in order
    paged_adapters: AdapterRows | None = None


class V4Batch:
    """Runs steps of many sequences through a placed `DeepseekV4ForCausalLM`'s layers."""

    def __init__(self, model: nn.Module, lora: LoraContext):
        self.inner = model.model
        self.config = model.config
        self.layers = list(self.inner.layers)
        self.lora = lora
        self.embed_device = self.inner.embed_tokens.weight.device
        self.paged = None  # paged.py: PagedDecode, where decode rows attend over paged caches

    def hidden_streams(self, pieces: list[Piece]) -> torch.Tensor:
        """The last layer's hyper-connection streams of every piece's rows, in piece order: [rows, hc, hidden]."""
        ids, positions, spans = flat_rows(pieces)
        ids, positions = ids.to(self.embed_device), positions.to(self.embed_device)
        with self.lora.step(AdapterRows(spans)):
            embeds, rope = self.embed(ids, positions)
            segments = self.segments(pieces, spans, embeds, positions)
            hidden = self.streams(embeds)
            for layer in self.layers:
                before = self.before_attention(layer, hidden, rope)
                hidden = self.after_attention(layer, hidden, before,
                                              self.cached_attention(layer.self_attn, before, segments), rope, ids)
        return hidden[0]

    def final(self, streams: torch.Tensor) -> torch.Tensor:
        """The final hidden states (hyper-head collapse, then the norm) of [rows, hc, hidden] streams: [rows, hidden]."""
        return self.inner.norm(self.inner.hc_head(streams[None]))[0]

    # The parts of a step, in order: `embed` and `streams`, then per layer `before_attention` (every row),
    # `cached_attention` (each sequence over its cache) and `after_attention` (every row). graphs.py runs the
    # row-wise parts from CUDA graphs and the cached parts between them.
    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The embeddings of `ids` [1, rows] and the rotary (cos, sin) of both rope kinds at `positions`."""
        embeds = self.inner.embed_tokens(ids)
        return embeds, {kind: self.inner.rotary_emb(embeds, position_ids=positions, layer_type=kind)
                        for kind in ("main", "compress")}

    def streams(self, embeds: torch.Tensor) -> torch.Tensor:
        """The first layer's hyper-connection streams: each one the embeddings. [1, rows, hc, hidden]."""
        return embeds.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()

    def segments(self, pieces: list[Piece], spans: list[tuple[str | None, int, int]], embeds: torch.Tensor,
                 positions: torch.Tensor) -> Cached:
        """What each piece's cached attention needs: its rows, positions and sliding-window mask (None for one
        row: the cache keeps the window's other positions, so a decode token sees every key it holds); the
        decode rows over paged caches together."""
        segments = []
        paged = [(p, first, adapter) for p, (adapter, first, _) in zip(pieces, spans) if p.paged is not None]
        cached = Cached(segments, sum(n for _, _, n in spans))
        if paged:
            cached.paged = self.paged.step([p.paged for p, _, _ in paged], [p.start for p, _, _ in paged],
                                           embeds.device)
            rows = [first for _, first, _ in paged]
            if rows != list(range(cached.rows)):
                cached.paged_rows = torch.tensor(rows).to(embeds.device, non_blocking=True)
            cached.paged_adapters = AdapterRows([(adapter, i, 1) for i, (_, _, adapter) in enumerate(paged)])
        caches: set[int] = set()
        for p, (adapter, first, n) in zip(pieces, spans):
            if p.paged is not None:
                continue
            cut = slice(first, first + n)
            follows = id(p.cache) in caches  # the cache is not yet where this piece starts: its mask waits
            caches.add(id(p.cache))
            mask = None if n == 1 or follows else sliding_mask(self.config, embeds[:, cut], p.cache,
                                                               positions[:, cut])
            segments.append(_Segment(row=first, n=n, cache=p.cache, positions=positions[:, cut], mask=mask,
                                     rows=AdapterRows.uniform(adapter), record=p.record, keep=p.keep,
                                     mask_from=embeds[:, cut] if follows and n > 1 else None))
        return cached

    def before_attention(self, layer: nn.Module, hidden: torch.Tensor, rope: dict) -> Attending:
        """A layer's work on every row up to its cached attention: the hyper-connection, the norm and
        `DeepseekV4Attention`'s projections with their rotary embedding."""
        attn = layer.self_attn
        post, comb, collapsed = layer.attn_hc(hidden)
        x = layer.input_layernorm(collapsed)
        flat, rows = x[0], x.shape[1]
        cos, sin = rope[attn.rope_layer_type]
        q_residual = attn.q_a_norm(attn.q_a_proj(flat))
        q = attn.q_b_proj(q_residual).view(1, rows, -1, attn.head_dim).transpose(1, 2)
        q = apply_rotary_pos_emb(attn.q_b_norm(q), cos, sin)
        kv = attn.kv_norm(attn.kv_proj(flat)).view(1, rows, -1, attn.head_dim).transpose(1, 2)
        kv = apply_rotary_pos_emb(kv, cos, sin)
        return Attending(post, comb, x, q, kv, q_residual[None])

    def cached_attention(self, attn: nn.Module, a: Attending, cached: Cached) -> torch.Tensor:
        """Each sequence's rows of `a` through its cache, in order: [1, rows, heads, head_dim]. The decode rows
        over paged caches attend together, the other pieces one after another."""
        out = []
        for s in cached.segments:
            cut = slice(s.row, s.row + s.n)
            with self.lora.step(s.rows):
                out.append(self._cached(attn, a.q[:, :, cut], a.kv[:, :, cut], a.x[:, cut], a.q_residual[:, cut], s))
            if s.keep is not None:
                s.keep[attn.layer_idx] = snapshot_layer(s.cache.layers[attn.layer_idx])
        if cached.paged is None:
            return out[0] if len(out) == 1 else torch.cat(out, dim=1)
        at = cached.paged_rows
        q, kv, x, q_residual = ((a.q, a.kv, a.x, a.q_residual) if at is None else
                                (a.q.index_select(2, at), a.kv.index_select(2, at), a.x.index_select(1, at),
                                 a.q_residual.index_select(1, at)))
        with self.lora.step(cached.paged_adapters):
            paged = self.paged.attend(attn.layer_idx, cached.paged, q, kv, x, q_residual)
        if at is None:
            return paged
        whole = paged.new_empty(1, cached.rows, *paged.shape[2:])
        whole.index_copy_(1, at, paged)
        for s, part in zip(cached.segments, out):
            whole[:, s.row:s.row + s.n] = part
        return whole

    def after_attention(self, layer: nn.Module, hidden: torch.Tensor, a: Attending, attended: torch.Tensor,
                        rope: dict, ids: torch.Tensor) -> torch.Tensor:
        """A layer's work on every row after its cached attention: the output projection, the mix into the
        streams, then the MoE block between its hyper-connection and mix. The next layer's streams."""
        attn = layer.self_attn
        rows = attended.shape[1]
        cos, sin = rope[attn.rope_layer_type]
        # V carried the keys' rotation: undo it at each query's position before the grouped output projection
        attended = apply_rotary_pos_emb(attended.transpose(1, 2), cos, -sin).transpose(1, 2)
        grouped = attn.o_a_proj(attended.reshape(rows, attn.config.o_groups, -1)).flatten(1)
        hidden = _mix(a.post, a.comb, attn.o_b_proj(grouped)[None], hidden)
        post, comb, collapsed = layer.ffn_hc(hidden)
        return _mix(post, comb, self._moe(layer.mlp, layer.post_attention_layernorm(collapsed), ids), hidden)

    def _cached(self, attn: nn.Module, q: torch.Tensor, kv: torch.Tensor, x: torch.Tensor, q_residual: torch.Tensor,
                s: _Segment) -> torch.Tensor:
        """One sequence's rows through its cache: sliding-window keys, then the compressor's (and indexer's)
        entries appended with their per-query bias, then attention with the sinks (a long chunk's in blocks of
        queries: blocks.py). [1, n, heads, head_dim]."""
        if s.mask_from is not None:  # the piece before it in the step has extended this layer's cache
            s.mask, s.mask_from = sliding_mask(self.config, s.mask_from, s.cache, s.positions, attn.layer_idx), None
        if s.record is not None:
            s.record.keys[attn.layer_idx] = kv
        kv = s.cache.update(kv, kv, attn.layer_idx)[0]
        window_keys = kv.shape[2]
        bias = None
        if attn.compressor is not None:
            if s.record is not None:
                s.record.compressors[attn.layer_idx] = (attn.compressor, x, q_residual, s.positions)
            state = s.cache.layers[attn.layer_idx]
            if s.n == 1 and s.record is None and closes_no_window(attn.compressor, state):
                compressed, bias = csa_row(attn.compressor, x, q_residual, s.positions, state)
            else:
                compressed, bias = attn.compressor(x, q_residual, s.positions, s.cache, attn.layer_idx)
            kv = torch.cat([kv, compressed], dim=2)
        mask = s.mask
        if mask is None and bias is not None:  # one row: every key of the window, the indexer's picks after them
            mask = F.pad(bias, (kv.shape[2] - bias.shape[-1], 0), value=0.0)
        elif isinstance(mask, torch.Tensor) and kv.shape[2] > mask.shape[-1]:
            mask = (torch.cat([mask, bias.to(mask.dtype)], dim=-1) if bias is not None
                    else F.pad(mask, (0, kv.shape[2] - mask.shape[-1]), value=0.0))
        if s.n == 1:
            return attend(q, kv, mask, attn.scaling, attn.sinks)
        return attend_in_blocks(attend, q, kv, mask, attn.scaling, attn.sinks, window_keys,
                                self.config.sliding_window)

    @staticmethod
    def _moe(mlp: nn.Module, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`DeepseekV4SparseMoeBlock` on flat rows; CPU experts are started first and waited for after the shared
        expert."""
        flat = x.reshape(-1, x.shape[-1])
        _, weights, indices = mlp.gate(x, ids) if mlp.is_hash else mlp.gate(x)
        experts = mlp.experts
        if not hasattr(experts, "submit"):  # experts in torch
            return (experts(flat, indices, weights) + mlp.shared_experts(flat)).view_as(x)
        experts.submit(flat, indices, weights)
        shared = mlp.shared_experts(flat)
        return (experts.wait().to(x.dtype) + shared).view_as(x)


def sliding_mask(config: Any, embeds: torch.Tensor, cache: Any, positions: torch.Tensor,
                 layer: int | None = None) -> Any:
    """transformers' sliding-window causal mask of rows with `embeds` [1, n, hidden] at `positions` [1, n] over
    `cache` as it holds now (sized against its cache layer `layer`; None: its first sliding one)."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    return create_sliding_window_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, cache=cache,
                                             position_ids=positions, layer_idx=layer)


def closes_no_window(compressor: nn.Module, state: Any) -> bool:
    """Whether a CSA layer's compressor takes one more row into the cache layer `state` without closing a window
    (3 rows in 4 of a decode)."""
    if not isinstance(compressor, DeepseekV4CSACompressor):
        return False
    buffered = state.buffer_kv
    return all(t is not None and t.shape[1] + 1 < compressor.compress_rate
               for t in (buffered["compressor"], buffered["indexer"]))


def csa_row(compressor: nn.Module, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor, state: Any
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`DeepseekV4CSACompressor` on one decode row that `closes_no_window`, in a fraction of its operations: the
    row's projections join both buffers of the cache layer `state`, the compressed entries stay as they are, and the
    indexer scores them only where there are more than it keeps (otherwise it keeps them all: no bias). A row after
    every earlier position of its sequence may see every entry, so none is masked as in its future. The module's
    entries, bias values and cache state (tests/engines/kt/families/deepseek_v4/test_v4_attention.py)."""
    indexer = compressor.indexer
    state.store_compression_weights("compressor", compressor.kv_proj(x), compressor.gate_proj(x))
    state.store_compression_weights("indexer", indexer.kv_proj(x), indexer.gate_proj(x))
    entries, keys = state.compressed_kv["compressor"], state.compressed_kv["indexer"]
    if keys.shape[1] <= indexer.index_topk:
        return entries.unsqueeze(1), None
    cos, sin = indexer.rotary_emb(x, position_ids=positions, layer_type=indexer.rope_layer_type)
    q = indexer.q_b_proj(q_residual).view(1, 1, -1, indexer.head_dim).transpose(1, 2)
    q = apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)
    picked = indexer.scorer(q, keys, x).topk(indexer.index_topk, dim=-1).indices  # [1, 1, k]
    bias = entries.new_full((1, 1, 1, entries.shape[1]), float("-inf")).scatter_(-1, picked.unsqueeze(1), 0.0)
    return entries.unsqueeze(1), bias


def attend(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None, scaling: float, sinks: torch.Tensor
           ) -> torch.Tensor:
    """V4's attention over one shared key-value head with a sink per head: transformers' `eager_attention_forward`
    for V4, its products, shapes and dtypes, with the key-value head broadcast to the query heads rather than
    copied once per head. q [1, heads, n, d], kv [1, 1, keys, d], an additive mask broadcast over heads
    ([1, 1, n, keys]) or None. [1, n, heads, d]."""
    heads = q.shape[1]
    keys = kv[0, 0]
    scores = torch.matmul(q[0], keys.transpose(0, 1).expand(heads, -1, -1)) * scaling  # [heads, n, keys]
    if mask is not None:
        scores = scores + mask[0]
    logits = torch.cat([scores, sinks.view(heads, 1, 1).expand(-1, scores.shape[1], 1)], dim=-1)  # promoted as there
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(keys.dtype)
    return torch.matmul(probs, keys.expand(heads, -1, -1)).unsqueeze(0).transpose(1, 2).contiguous()


def flat_rows(pieces: list[Piece]) -> tuple[torch.Tensor, torch.Tensor, list[tuple[str | None, int, int]]]:
    """The step's rows on the host: token ids [1, rows], positions [1, rows], and each piece's
    (adapter, first row, rows)."""
    ids = torch.tensor([t for p in pieces for t in p.token_ids[p.start:p.end]])[None]
    positions = torch.cat([torch.arange(p.start, p.end) for p in pieces])[None]
    spans, row = [], 0
    for p in pieces:
        spans.append((p.adapter, row, p.end - p.start))
        row += p.end - p.start
    return ids, positions, spans


def _mix(post: torch.Tensor, comb: torch.Tensor, block: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """A block's output spread over the hyper-connection streams plus the streams mixed by `comb` (as
    `DeepseekV4DecoderLayer` does after attention and after the MoE)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                             streams)
