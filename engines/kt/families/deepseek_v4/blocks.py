"""Long prompt chunks in bounded memory: V4's cached attention and its lightning indexer's scores in blocks of queries.

A chunk of n prompt rows over a context of T compressed entries makes two tensors that grow with n x T:

* the indexer's scores before their sum over its heads (`DeepseekV4IndexerScorer`: [n, index_heads, T] float32,
  68 GB for an 8,192-token chunk at 128k tokens of context, V4-Flash's 64 heads);
* attention's logits ([heads, n, window + n + T] float32 beside the scores they come from).

Both are computed here a block of queries at a time, with the same operations on each block as on the whole, so the
chunk length is set by what amortizes the routed experts' copies (engines/kt/experts/streaming.py), not by these.
Where a chunk's tensors fit within `BLOCK_BYTES`, the whole chunk goes at once, as transformers computes it. A block
of attention also reads only the window's keys its queries may see (the compressed entries are every query's), so a
long chunk does not attend, masked, over all of its own rows."""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

# Largest float32 intermediate of one block (scores, or logits), in bytes; each has a few siblings of its size.
BLOCK_BYTES = 1 << 30


def block_rows(rows: int, per_row_bytes: int) -> int:
    """Rows in a block whose intermediate takes `per_row_bytes` a row: all of them where they fit, else the largest
    power of two within BLOCK_BYTES (at least 16)."""
    if rows * per_row_bytes <= BLOCK_BYTES:
        return rows
    fit = max(BLOCK_BYTES // max(per_row_bytes, 1), 16)
    return 1 << (fit.bit_length() - 1)


def blocked_scores(scorer: nn.Module, q: torch.Tensor, compressed_kv: torch.Tensor, hidden_states: torch.Tensor
                   ) -> torch.Tensor:
    """`DeepseekV4IndexerScorer.forward` a block of queries at a time: `∑_h w_{t,h} · ReLU(q_{t,h} · K_s)` for
    q [B, S, H, D], compressed keys [B, T, D], hidden states [B, S, hidden]; [B, S, T] float32."""
    batch, rows, heads, _ = q.shape
    keys = compressed_kv.transpose(-1, -2).float().unsqueeze(1)  # [B, 1, D, T]
    step = block_rows(rows, heads * keys.shape[-1] * 4)
    weights = scorer.weights_proj(hidden_states).float() * scorer.weights_scaling  # [B, S, H]
    if step == rows:
        scores = F.relu(torch.matmul(q.float(), keys)) * scorer.softmax_scale
        return (scores * weights.unsqueeze(-1)).sum(dim=2)
    out = q.new_empty(batch, rows, keys.shape[-1], dtype=torch.float32)
    for first in range(0, rows, step):
        cut = slice(first, first + step)
        scores = F.relu(torch.matmul(q[:, cut].float(), keys)) * scorer.softmax_scale
        out[:, cut] = (scores * weights[:, cut].unsqueeze(-1)).sum(dim=2)
    return out


def install_blocked_scorers(model: nn.Module) -> int:
    """Give every lightning indexer's scorer of `model` the blocked forward; how many there are."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

    scorers = [m for m in model.modules() if isinstance(m, DeepseekV4IndexerScorer)]
    for scorer in scorers:
        scorer.forward = types.MethodType(blocked_scores, scorer)
    return len(scorers)


def attend_in_blocks(attend, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, scaling: float,
                     sinks: torch.Tensor, window_keys: int, sliding_window: int) -> torch.Tensor:
    """`attend` (batch.py) over n > 1 rows of one sequence, a block of queries at a time. kv [1, 1, keys, d] holds
    the sliding-window keys (`window_keys` of them: the window kept before the rows, then the rows' own) and then
    the compressed entries; `mask` [1, 1, n, keys] is additive. A block's queries see at most `sliding_window` of
    the window keys before each of them, so a block attends over those and the compressed entries only (the
    other keys' mask is -inf for its queries: each query's softmax and sum are over the same keys as the whole
    chunk's, less ones that add exactly zero). [1, n, heads, d]."""
    heads, rows, keys = q.shape[1], q.shape[2], kv.shape[2]
    if mask is None or rows * heads * keys * 4 <= BLOCK_BYTES:
        return attend(q, kv, mask, scaling, sinks)
    before, compressed = window_keys - rows, keys - window_keys  # the window's keys kept from earlier rows
    step = 1 << (rows.bit_length() - 1)
    while step > 16 and step * heads * (step + sliding_window + compressed) * 4 > BLOCK_BYTES:
        step //= 2
    tail = torch.arange(window_keys, keys, device=kv.device)
    out = []
    for first in range(0, rows, step):
        last = min(first + step, rows)
        cols = torch.cat([torch.arange(max(0, before + first - sliding_window), before + last, device=kv.device),
                          tail])
        out.append(attend(q[:, :, first:last], kv.index_select(2, cols),
                          mask[:, :, first:last].index_select(3, cols), scaling, sinks))
    return torch.cat(out, dim=1)
