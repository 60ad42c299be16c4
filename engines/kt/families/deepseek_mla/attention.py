"""Multi-head latent attention (MLA) over the paged latent KV cache, and the step metadata it reads.

Prefill expands the cached latents to per-head keys and values; decode attends in the latent space
(the "absorbed" form), so the cache is never expanded to full K/V. Sequence boundaries reach attention
only through the spans of a `StepBatch` (or the fixed shapes of a `DecodeBatch`)."""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from engines.kt.families.deepseek_mla.kv_cache import LatentKVCache
from engines.kt.layers import layer_index
from engines.lora.modules import LoraLinear

# --------------------------------------------------------------------------------------- step metadata
@dataclass(slots=True)
class Span:
    """One sequence's slice of the flattened step: rows [row, row + n) are positions [start, start + n)."""

    row: int
    n: int
    start: int
    write_slots: torch.Tensor  # slots of the fed positions
    read_slots: torch.Tensor  # slots of positions [0, start + n)
    adapter: str | None = None  # the sequence's LoRA adapter
    blocks: list[int] = field(default_factory=list)  # the cache pages of positions [0, start + n)


@dataclass
class StepBatch:
    """What attention needs to know about the step, passed down explicitly (no global context)."""

    spans: list[Span]
    positions: torch.Tensor  # [T] on the CPU
    cache: LatentKVCache
    rotary: nn.Module
    flash: Any = None  # engines.kt.families.deepseek_mla.flashinfer.FlashInferMLA when FlashInfer attends; None: torch
    _on_device: dict[tuple[str, str], Any] = field(default_factory=dict)

    def on(self, device: torch.device, key: str, make: Callable[[], Any]) -> Any:
        """Per-device copies of step tensors, made once per step and shared by the layers on that device."""
        k = (str(device), key)
        if k not in self._on_device:
            self._on_device[k] = make()
        return self._on_device[k]

    def rope(self, x: torch.Tensor) -> Any:
        def make():
            positions = self.positions.to(x.device).unsqueeze(0)
            return self.rotary(x, positions)
        return self.on(x.device, "rope", make)


@dataclass
class DecodeBatch:
    """A decode-only step in fixed shapes: B sequences, one new token each, attending over up to L cached
    positions (padded; `mask` marks the real ones). Fixed shapes let the step be captured in a CUDA graph."""

    positions: torch.Tensor  # [B] on the model's device
    write_slots: torch.Tensor  # [B]
    read_slots: torch.Tensor  # [B, L]
    mask: torch.Tensor  # [B, L] bool
    cache: LatentKVCache
    rotary: nn.Module
    paged: Any = None  # a planned engines.kt.families.deepseek_mla.flashinfer.PagedMLA when FlashInfer attends; None: torch
    _rope: Any = None

    def rope(self, x: torch.Tensor) -> Any:
        if self._rope is None:
            self._rope = self.rotary(x, self.positions.unsqueeze(0))
        return self._rope


# ------------------------------------------------------------------------------------------ attention
def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the last n of L positions over all L, each query seeing its own position and those
    before it: q [h, n, d], k [h, L, d], v [h, L, dv <= d] -> [h, n, dv] in q's dtype.

    It adds up in float32, as torch's unfused math kernel does for bf16 inputs (this path is the reference
    the other backends are checked against), but shaped for the fused kernels instead of the math, which
    writes out the whole [h, n, L] score matrix: the inputs get a batch dimension (3-d ones go to the math),
    the causal rule is a lower-right CausalBias rather than an [n, L] mask, and on the CPU the values are
    zero-padded to the key width (MLA's 128 against 192), since its flash kernel wants one head width. The
    GPU's memory-efficient kernel takes them as they are, and padded it ran a third slower
    (bench/results/nvidia-h100-2026-11-25-evening/)."""
    n, length = q.shape[-2], k.shape[-2]
    return masked_sdpa(q, k, v, causal_lower_right(n, length) if n > 1 else None, scale)


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: Any, scale: float) -> torch.Tensor:
    """As causal_sdpa, but each of the n queries sees the positions `keep` [n, L] marks (which include its own;
    None: all of them)."""
    dv = v.shape[-1]
    if dv < q.shape[-1] and not q.is_cuda:
        v = F.pad(v, (0, q.shape[-1] - dv))
    out = F.scaled_dot_product_attention(q.float().unsqueeze(0), k.float().unsqueeze(0), v.float().unsqueeze(0),
                                         attn_mask=keep, scale=scale)
    return out[0, ..., :dv].to(q.dtype)


def _rope_function(hf_module: nn.Module, config: Any) -> Callable:
    """transformers' own rotary helper for this architecture, so positions are encoded exactly as there:
    V2 uses complex frequencies, V3 cos/sin (interleaved when the config says so)."""
    modeling = sys.modules[type(hf_module).__module__]
    if hasattr(modeling, "apply_rotary_emb"):
        return lambda q, k, pe: modeling.apply_rotary_emb(q, k, pe)
    fn = modeling.apply_rotary_pos_emb_interleave if getattr(config, "rope_interleave", False) \
        else modeling.apply_rotary_pos_emb
    return lambda q, k, pe: fn(q, k, pe[0], pe[1])


class MLAAttention(nn.Module):
    KWARGS = frozenset({"device", "absorb"})

    def __init__(self, hf_attention: nn.Module, config: Any, layer: int, device: str, absorb: bool):
        super().__init__()
        a = hf_attention
        self.layer = layer
        self.device_name = device
        self.absorb = absorb
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scaling = a.scaling
        for child in ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                      "kv_b_proj", "o_proj"):
            setattr(self, child, getattr(a, child, None))
        self._apply_rope = _rope_function(a, config)

    @classmethod
    def from_module(cls, module: nn.Module, name: str, config: Any, options: Any = None, device: str = "cpu",
                    absorb: bool = True, **_: Any) -> "MLAAttention":
        if hasattr(module, "indexer"):  # dense attention would silently ignore the indexer's selection
            raise ValueError("this attention has DeepSeek-V3.2's lightning indexer: replace it with "
                             "engines.kt.placement.operators.IndexedMLAAttention")
        return cls(module, config, layer_index(name), device, bool(absorb))

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        q_nope, q_pe, latent, k_pe = self._project(x, batch.rope(x))
        batch.cache.write(self.layer, self._write_slots(x, batch), latent, k_pe)
        if batch.flash is not None:
            paged = batch.on(x.device, "paged", lambda: batch.flash.plan_spans(x.device, batch.spans))
            out = self._paged(paged, q_nope, q_pe, batch)
        else:
            out = self._attend_spans(x, q_nope, q_pe, batch)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.v_dim))

    def decode(self, x: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """One new token for each of B sequences, attending in the latent space over fixed-shape gathers."""
        q_nope, q_pe, latent, k_pe = self._project(x, batch.rope(x))
        batch.cache.write(self.layer, batch.write_slots, latent, k_pe)
        return self._decode_attend(x, q_nope, q_pe, batch, batch.mask)

    def _project(self, x: torch.Tensor, rope: Any, q_low: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """[t, hidden] -> q_nope [t, h, nope], q_pe [t, h, rope] (rotated), latent [t, kv_lora_rank] (normed),
        k_pe [t, rope] (rotated). `q_low`: the normed low-rank query, when the caller computed it already."""
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)) if q_low is None else q_low)
        q_nope, q_pe = q.view(t, self.num_heads, self.nope + self.rope_dim).split([self.nope, self.rope_dim], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe, k_pe = self._apply_rope(q_pe.transpose(0, 1).unsqueeze(0), k_pe.view(1, 1, t, self.rope_dim), rope)
        return q_nope, q_pe[0].transpose(0, 1), self.kv_a_layernorm(latent), k_pe.view(t, self.rope_dim)

    @staticmethod
    def _write_slots(x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        return batch.on(x.device, "write", lambda: torch.cat([s.write_slots for s in batch.spans]).to(x.device))

    def _attend_spans(self, x: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: StepBatch,
                      select: Callable[[Span, slice, torch.Tensor], torch.Tensor | None] | None = None
                      ) -> torch.Tensor:
        """Each span's queries over its cached positions: [t, h, v]. `select(span, rows, read_slots)` may
        return which of the span's positions [0, start + n) each query attends to ([n, start + n] bool,
        causality included); None, or no `select`: every earlier position."""
        out = torch.empty(x.shape[0], self.num_heads, self.v_dim, dtype=x.dtype, device=x.device)
        for i, span in enumerate(batch.spans):
            read = batch.on(x.device, f"read{i}", lambda s=span: s.read_slots.to(x.device))
            cached_latent, cached_pe = batch.cache.read(self.layer, read)
            rows = slice(span.row, span.row + span.n)
            keep = None if select is None else select(span, rows, read)
            attend = self._absorbed if self.absorb and span.n == 1 else self._expanded
            out[rows] = attend(q_nope[rows], q_pe[rows], cached_latent.to(x.dtype), cached_pe.to(x.dtype), span,
                               keep)
        return out

    def _decode_attend(self, x: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: DecodeBatch,
                       mask: torch.Tensor) -> torch.Tensor:
        """The decode step's attention in the latent space over the positions `mask` [B, L] marks."""
        b = x.shape[0]
        q_latent = self._absorb_query(q_nope)
        if batch.paged is not None:
            out_latent = batch.paged.run(q_latent, q_pe, batch.cache, self.layer)
        else:
            rows = batch.cache.layers[self.layer][batch.read_slots].to(x.dtype)  # [B, L, latent + rope]
            cached_latent, cached_pe = rows.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            scores = (torch.bmm(q_latent, cached_latent.transpose(1, 2))
                      + torch.bmm(q_pe, cached_pe.transpose(1, 2))) * self.scaling
            scores = scores.float().masked_fill(~mask.unsqueeze(1), float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(x.dtype)
            out_latent = torch.bmm(probs, cached_latent)  # [B, H, latent]
        return self.o_proj(self._expand_output(out_latent).reshape(b, self.num_heads * self.v_dim))

    def _kv_b_update(self, adapter: str | None):
        """The adapter's LoRA on kv_b_proj, (A, B, scale) with B per head [h, nope + v, r], or None."""
        if adapter is None or not isinstance(self.kv_b_proj, LoraLinear):
            return None
        update = self.kv_b_proj.updates.get(adapter)
        if update is None:
            return None
        a, b, scale = update
        return a, b.view(self.num_heads, self.nope + self.v_dim, -1), scale

    def _absorb_query(self, q_nope: torch.Tensor, adapter: str | None = None) -> torch.Tensor:
        """[n, h, nope] -> [n, h, latent]: the query times kv_b's key half (with the adapter's LoRA on kv_b,
        kept factored), so it scores cached latents directly."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        q_latent = torch.einsum("nhd,hdr->nhr", q_nope, w[:, :self.nope])
        update = self._kv_b_update(adapter)
        if update is not None:
            a, b, scale = update
            q_latent = q_latent + scale * torch.einsum("nhk,kr->nhr", torch.einsum("nhd,hdk->nhk", q_nope,
                                                                                     b[:, :self.nope]), a)
        return q_latent

    def _expand_output(self, out_latent: torch.Tensor, adapter: str | None = None) -> torch.Tensor:
        """[n, h, latent] -> [n, h, v]: an attention output in the latent space times kv_b's value half."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        out = torch.einsum("nhr,hvr->nhv", out_latent, w[:, self.nope:])
        update = self._kv_b_update(adapter)
        if update is not None:
            a, b, scale = update
            out = out + scale * torch.einsum("nhk,hvk->nhv", torch.einsum("nhr,kr->nhk", out_latent, a),
                                             b[:, self.nope:])
        return out

    def _paged(self, paged: Any, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Every span at once through FlashInfer's paged MLA kernel; LoRA on kv_b applied per span around it."""
        q_latent = self._absorb_query(q_nope)
        adapted = [s for s in batch.spans if self._kv_b_update(s.adapter) is not None]
        for span in adapted:
            rows = slice(span.row, span.row + span.n)
            q_latent[rows] = self._absorb_query(q_nope[rows], span.adapter)
        out_latent = paged.run(q_latent, q_pe, batch.cache, self.layer)
        out = self._expand_output(out_latent)
        for span in adapted:
            rows = slice(span.row, span.row + span.n)
            out[rows] = self._expand_output(out_latent[rows], span.adapter)
        return out

    def _expanded(self, q_nope, q_pe, latent, k_pe, span: Span, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Expand the cached latents to per-head keys and values (prefill: many queries share them); `keep`
        [n, L]: the positions each query sees, when not all earlier ones."""
        length = latent.shape[0]
        # the cached rows are this span's, whatever the step's other rows are
        kv = self.kv_b_proj(latent, adapter=span.adapter) if isinstance(self.kv_b_proj, LoraLinear) \
            else self.kv_b_proj(latent)
        kv = kv.view(length, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        out = causal_sdpa(q, k, v, self.scaling) if keep is None else masked_sdpa(q, k, v, keep, self.scaling)
        return out.transpose(0, 1)

    def _absorbed(self, q_nope, q_pe, latent, k_pe, span: Span, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Attend in the latent space: fold kv_b's key half into the query and its value half into the
        output, so a decode step reads kv_lora_rank + rope numbers per cached token and expands nothing."""
        q_latent = self._absorb_query(q_nope, span.adapter)
        scores = (torch.einsum("nhr,lr->hnl", q_latent, latent)
                  + torch.einsum("nhd,ld->hnl", q_pe, k_pe)) * self.scaling
        if keep is not None:
            scores = scores.float().masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(latent.dtype)
        out_latent = torch.einsum("hnl,lr->nhr", probs, latent)
        return self._expand_output(out_latent, span.adapter)
