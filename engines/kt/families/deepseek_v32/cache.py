"""V3.2's cache: MLA's latent cache plus the lightning indexer's keys (index_head_dim numbers a token and layer).

The indexer keys live in the same slots as the latents: one block table per sequence addresses both, so
admission, chunked prefill, prefix sharing and release need nothing beyond what the latent cache does
(engines/kt/families/deepseek_mla/kv_cache.py), and a reused prefix page brings its indexer keys with it (both are functions of
the same tokens)."""
from __future__ import annotations

import torch

from engines.kt.families.deepseek_mla.kv_cache import LatentKVCache


class IndexedLatentKVCache(LatentKVCache):
    def __init__(self, *, index_dim: int, **kwargs):
        super().__init__(**kwargs)
        self.index_dim = index_dim
        slots = self.num_blocks * self.block_size
        self.index_keys = [torch.zeros(slots, index_dim, dtype=layer.dtype, device=layer.device)
                           for layer in self.layers]

    def write_index(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        cache = self.index_keys[layer]
        cache[slots] = keys.to(cache.dtype)

    def read_index(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The indexer keys at `slots` (any shape of slot indices): [..., index_dim]."""
        return self.index_keys[layer][slots]
