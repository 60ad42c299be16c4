"""The MLA latent KV cache: per token, only the compressed latent (kv_lora_rank) and the shared rotary key
(qk_rope_head_dim) are stored — 576 numbers a layer for DeepSeek-V2/V3 instead of 2 x heads x head_dim.

Storage is paged: each layer owns one [num_blocks * block_size, latent + rope] tensor on that layer's device,
and each sequence a list of block ids. Admission reserves a sequence's worst case (prompt + max_tokens) so a
running request never runs out; blocks themselves are taken only as positions are written."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class BlockTable:
    blocks: list[int] = field(default_factory=list)
    reserved_blocks: int = 0


class LatentKVCache:
    def __init__(self, *, layer_devices: list[torch.device], num_tokens: int, latent_dim: int, rope_dim: int,
                 dtype: torch.dtype, block_size: int = 64):
        self.block_size = block_size
        self.num_blocks = max(1, -(-num_tokens // block_size))
        self.latent_dim, self.rope_dim = latent_dim, rope_dim
        slots = self.num_blocks * block_size
        self.layers = [torch.zeros(slots, latent_dim + rope_dim, dtype=dtype, device=d) for d in layer_devices]
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._reserved = 0  # blocks promised to admitted sequences, taken or not

    # --------------------------------------------------------------------------- accounting
    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def used_tokens(self) -> int:
        return (self.num_blocks - len(self._free)) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reserve(self, table: BlockTable, max_positions: int) -> bool:
        need = self.blocks_for(max_positions)
        extra = need - table.reserved_blocks
        if extra <= 0:
            return True
        if self._reserved + extra > self.num_blocks:
            return False
        self._reserved += extra
        table.reserved_blocks = need
        return True

    def release(self, table: BlockTable) -> None:
        self._free.extend(reversed(table.blocks))
        self._reserved -= table.reserved_blocks
        table.blocks.clear()
        table.reserved_blocks = 0

    def ensure(self, table: BlockTable, num_positions: int) -> None:
        """Take blocks so that positions [0, num_positions) have slots."""
        need = self.blocks_for(num_positions)
        if need > table.reserved_blocks:
            raise RuntimeError(f"sequence grew past its reservation ({need} > {table.reserved_blocks} blocks)")
        while len(table.blocks) < need:
            table.blocks.append(self._free.pop())

    def slots(self, table: BlockTable, start: int, end: int) -> torch.Tensor:
        """Flat slot indices of positions [start, end), on the CPU."""
        positions = torch.arange(start, end)
        blocks = torch.tensor(table.blocks, dtype=torch.long)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    # --------------------------------------------------------------------------- data
    def write(self, layer: int, slots: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> None:
        cache = self.layers[layer]
        cache[slots] = torch.cat([latent, rope], dim=-1).to(cache.dtype)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.layers[layer][slots]
        return rows[:, :self.latent_dim], rows[:, self.latent_dim:]
