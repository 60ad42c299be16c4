"""The MLA latent KV cache: per token, only the compressed latent (kv_lora_rank) and the shared rotary key
(qk_rope_head_dim) are stored — 576 numbers a layer for DeepSeek-V2/V3 instead of 2 x heads x head_dim.

Storage is paged: each layer owns one [num_blocks * block_size, latent + rope] tensor on that layer's device,
and each sequence a `BlockTable` of block ids. Which block belongs to whom, and which full pages are kept for
reuse by later requests with the same prefix, is the `BlockPool`'s business (attention/block_pool.py)."""
from __future__ import annotations

import torch

from engines.kt.cache.block_pool import BlockPool, BlockTable, extend_hashes

__all__ = ["BlockTable", "LatentKVCache", "PAGE_TOKENS"]

PAGE_TOKENS = 64  # positions a page (block) holds


class LatentKVCache:
    def __init__(self, *, layer_devices: list[torch.device], num_tokens: int, latent_dim: int, rope_dim: int,
                 dtype: torch.dtype, block_size: int = PAGE_TOKENS, prefix_cache: bool = True):
        self.block_size = block_size
        self.num_blocks = max(1, -(-num_tokens // block_size))
        self.latent_dim, self.rope_dim = latent_dim, rope_dim
        self.prefix_cache = prefix_cache
        slots = self.num_blocks * block_size
        self.layers = [torch.zeros(slots, latent_dim + rope_dim, dtype=dtype, device=d) for d in layer_devices]
        self.pool = BlockPool(self.num_blocks, block_size)
        # pages admission leaves free for the running sequences to grow into (vLLM's 1% watermark): fewer
        # preemptions right after a request starts
        self.growth_margin = max(1, self.num_blocks // 100)

    # --------------------------------------------------------------------------- accounting
    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def used_tokens(self) -> int:
        """Positions in blocks some sequence holds; cached prefix pages nobody holds are reclaimable."""
        return self.pool.in_use * self.block_size

    @property
    def cached_tokens(self) -> int:
        return self.pool.cached_blocks * self.block_size

    def admit(self, table: BlockTable, tokens: list[int], root: str, reuse: bool = True, margin: int = 0
              ) -> int | None:
        """Give a sequence of `tokens` the pages its positions fill, if `margin` pages stay free after that.
        With `reuse`, borrow the cached pages of its longest known prefix under the prefix key `root` (the
        adapter's), always leaving the last token to compute. Returns the number of positions found cached,
        or None when there is no room now."""
        lookup: list[bytes] = []
        if self.prefix_cache and reuse:
            pages = (len(tokens) - 1) // self.block_size
            lookup = extend_hashes(table.hashes, tokens, pages, self.block_size, root)[:pages]
        hits = self.pool.admit(table, len(tokens), lookup, margin)
        return None if hits is None else hits * self.block_size

    def in_flight(self, table: BlockTable, tokens: list[int], root: str,
                  leaders: list[tuple[BlockTable, list[int], int]]) -> bool:
        """Whether a leader (the table, prompt and computed positions of a sequence still computing its
        prompt, under the same prefix key `root`) has yet to compute the next page of `tokens`' prefix that
        the cache lacks. The hashes chain, so sharing that page means sharing every page before it."""
        if not self.prefix_cache:
            return False
        pages = (len(tokens) - 1) // self.block_size
        mine = extend_hashes(table.hashes, tokens, pages, self.block_size, root)[:pages]
        held = len(self.pool.match(mine))
        if held == len(mine):
            return False
        for leader, prompt, computed in leaders:
            if computed >= (held + 1) * self.block_size:
                continue  # it computed that page already and the cache does not have it: it kept it private
            theirs = extend_hashes(leader.hashes, prompt, len(prompt) // self.block_size, self.block_size, root)
            if len(theirs) > held and theirs[held] == mine[held]:
                return True
        return False

    def grow(self, table: BlockTable, num_positions: int) -> bool:
        """Take pages so that positions [0, num_positions) have slots; False when the cache is full."""
        return self.pool.grow(table, num_positions)

    def ensure(self, table: BlockTable, num_positions: int) -> None:
        """Take pages so that positions [0, num_positions) have slots; RuntimeError when the cache is full."""
        self.pool.take(table, num_positions)

    def offer(self, table: BlockTable, tokens: list[int], computed: int, root: str) -> None:
        """Positions [0, computed) of `tokens` are in the cache: index the full pages among them."""
        if self.prefix_cache:
            self.pool.offer(table, extend_hashes(table.hashes, tokens, computed // self.block_size,
                                                 self.block_size, root))

    def release(self, table: BlockTable) -> None:
        self.pool.release(table)

    def blocks_for(self, num_positions: int) -> int:
        return self.pool.blocks_for(num_positions)

    def slot(self, table: BlockTable, position: int) -> int:
        """The flat slot index of one position (a decode step's: no tensors made for one number)."""
        return table.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, table: BlockTable, start: int, end: int) -> torch.Tensor:
        """Flat slot indices of positions [start, end), on the CPU."""
        return self._slots(table.blocks, start, end)

    def _slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        paged = torch.tensor(blocks, dtype=torch.long)[positions // self.block_size]
        return paged * self.block_size + positions % self.block_size

    def context_slots(self, pages: list[list[int]], lengths: list[int], rows: int, width: int, pad_slot: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, width] slots of each sequence's positions [0, length) held in `pages`, padded with
        `pad_slot`, and the mask of the real ones. Rows past the sequences attend to `pad_slot` alone (a
        row with nothing to attend to would make a NaN softmax)."""
        read = torch.full((rows, width), pad_slot, dtype=torch.long)
        mask = torch.zeros(rows, width, dtype=torch.bool)
        mask[len(pages):, 0] = True
        for i, (blocks, length) in enumerate(zip(pages, lengths)):
            read[i, :length] = self._slots(blocks, 0, length)
            mask[i, :length] = True
        return read, mask

    # --------------------------------------------------------------------------- data
    def write(self, layer: int, slots: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> None:
        cache = self.layers[layer]
        cache[slots] = torch.cat([latent, rope], dim=-1).to(cache.dtype)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.layers[layer][slots]
        return rows[:, :self.latent_dim], rows[:, self.latent_dim:]

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's cache as [num_blocks, block_size, latent] and [.., rope] views (no copy)."""
        paged = self.layers[layer].view(self.num_blocks, self.block_size, self.latent_dim + self.rope_dim)
        return paged[..., :self.latent_dim], paged[..., self.latent_dim:]
