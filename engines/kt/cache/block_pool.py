"""Who owns which page of the latent KV cache, and which pages hold a known token prefix (prefix caching).

A page (block) holds `block_size` consecutive positions of one sequence. Every full page a sequence has
computed is offered to the prefix index under a chain hash of its tokens, everything before them and the
adapter key, since a LoRA anywhere in the model changes the latents. A later sequence whose prompt starts
with the same pages borrows them (reference-counted) and prefills only the rest.

Pages are in one of three states: in use (referenced by at least one sequence, never evicted), cached (no
reference, still indexed, evicted least recently used first when a free page is needed) or free.

Pages are given by use, not reserved: a sequence is admitted with the pages its tokens fill now (if a small
margin stays free after them), and takes one more each time it grows past a page. When `grow` finds no free
page the scheduler preempts a sequence to make room (engines/runtime/scheduler.py). Cached pages count as
free room, and borrowing a cached page moves it to in use."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockTable:
    """One sequence's pages, in position order, and its bookkeeping in the pool."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of its full pages, computed lazily
    offered: int = 0  # leading pages already offered to the prefix index
    admitted: bool = False


def extend_hashes(hashes: list[bytes], tokens: list[int], pages: int, block_size: int, root: str) -> list[bytes]:
    """Grow `hashes` in place to the chain hashes of the first `pages` full pages of `tokens`."""
    while len(hashes) < pages:
        i = len(hashes)
        parent = hashes[-1] if hashes else hashlib.blake2b(root.encode(), digest_size=16).digest()
        page = array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes()
        hashes.append(hashlib.blake2b(parent + page, digest_size=16).digest())
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced but indexed, oldest first
        self._index: dict[bytes, int] = {}  # page hash -> block
        self._hash_of: dict[int, bytes] = {}
        self.in_use = 0

    # ------------------------------------------------------------------------------ accounting
    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def match(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest indexed prefix of `hashes`."""
        found = []
        for h in hashes:
            block = self._index.get(h)
            if block is None:
                break
            found.append(block)
        return found

    @property
    def free_blocks(self) -> int:
        """Pages no sequence holds: free ones and cached ones (reclaimable)."""
        return self.num_blocks - self.in_use

    def admit(self, table: BlockTable, num_positions: int, lookup: list[bytes], margin: int = 0) -> int | None:
        """Give the table pages for positions [0, num_positions), borrowing the indexed pages of `lookup` (the
        sequence's leading page hashes), if `margin` pages stay free after that (room for the running sequences
        to grow). Returns how many pages were borrowed, or None when there is no room now (nothing changes)."""
        if table.admitted:
            raise RuntimeError("a block table is admitted once")
        hits = self.match(lookup)
        reclaimed = sum(1 for b in hits if self._refs[b] == 0)
        new = max(0, self.blocks_for(num_positions) - len(hits))
        if self.in_use + reclaimed + new + margin > self.num_blocks:
            return None
        for block in hits:
            self._ref(block)
        table.blocks = list(hits)
        table.offered = len(hits)
        table.admitted = True
        self.take(table, num_positions)
        return len(hits)

    def grow(self, table: BlockTable, num_positions: int) -> bool:
        """Give the table pages so that positions [0, num_positions) have slots; False (nothing taken) when
        the pool has too few pages no sequence holds."""
        if self.blocks_for(num_positions) - len(table.blocks) > self.free_blocks:
            return False
        self.take(table, num_positions)
        return True

    def take(self, table: BlockTable, num_positions: int) -> None:
        """Give the table pages so that positions [0, num_positions) have slots; RuntimeError when the pool
        runs out (callers check `grow` first)."""
        need = self.blocks_for(num_positions)
        if need - len(table.blocks) > self.free_blocks:
            raise RuntimeError(f"the KV cache is full: a sequence needs {need - len(table.blocks)} more pages, "
                               f"{self.free_blocks} are free")
        while len(table.blocks) < need:
            if self._free:
                block = self._free.pop()
            else:  # free_blocks counted the cached pages: reclaim the least recently used
                block, _ = self._cached.popitem(last=False)
                del self._index[self._hash_of.pop(block)]
            self._refs[block] = 1
            self.in_use += 1
            table.blocks.append(block)

    def offer(self, table: BlockTable, hashes: list[bytes]) -> None:
        """Index the table's computed full pages under `hashes` (one per leading page). A page whose hash is
        already indexed (another sequence computed the same prefix at the same time) stays private."""
        for i in range(table.offered, min(len(hashes), len(table.blocks))):
            block, h = table.blocks[i], hashes[i]
            if h not in self._index and block not in self._hash_of:
                self._index[h] = block
                self._hash_of[block] = h
        table.offered = max(table.offered, min(len(hashes), len(table.blocks)))

    def release(self, table: BlockTable) -> None:
        """Drop the table's references. Its last pages become the first evicted, so shared prefixes outlive
        the tails that follow them."""
        for block in reversed(table.blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self.in_use -= 1
                if block in self._hash_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)
        table.blocks.clear()
        table.offered = 0
        table.admitted = False

    def _ref(self, block: int) -> None:
        if self._refs[block] == 0:
            self._cached.pop(block, None)
            self.in_use += 1
        self._refs[block] += 1
