"""DeepSeek-V4's prefix cache: a prompt that starts with a prefix computed before starts from that prefix's cache
state and computes only the rest.

V4's caches are not paged (caches.py), so what is kept is a whole cache's state at one position, a *page boundary*:
a multiple of `PAGE` = 128 positions, the heavily compressed layers' window, itself a multiple of the compressed
sparse layers' 4. There every compressor has closed its windows (its buffers are empty), so the state is the
sliding window's last 127 keys per layer, the compressed entries (and the indexer's keys) up to there, and the
CSA layers' overlap slices: what a cold run holds at that position, nothing half-done. A state is keyed by the
chain hash of its 128-token pages (the V2/V3 pool's hashing, engines/kt/cache/block_pool.py: every page's hash
covers the tokens before it and the adapter), so a state is found only for the very tokens and adapter it holds.

Which boundaries a prompt keeps, and why not every one: each state costs its sliding windows whatever its length
(127 keys a layer and the CSA overlap slices: ~6.2 MB for V4-Flash in bf16, by budget.py's `CacheBytes`) plus its
entries (~6.9 KB a position), and states of one prompt share no memory once the sequence grows (the layers replace
their tensors), so keeping every boundary would cost a long prompt far more than its own cache. A prompt keeps
(`PrefixPlan.cuts`):
- its **last** boundary before its last token: a repeated prompt, the other choices of an `n` > 1 request, a chat's
  next turn (where its rendering starts with this prompt's tokens) start there;
- the **end of the prefix it shares with a prompt seen before**, to the page (the page hashes of recent prompts
  are remembered, `seen`): the second request with a new system prompt keeps the state at the system prompt's
  last full page, and every later one starts there.
Where a cut falls inside a prompt chunk, the runner runs the chunk as pieces split there, one step, and takes each
layer's state between its pieces (runner.py: `execute`; batch.py: `Piece.keep`): a step of its own for the tail
would read or copy nearly every expert of every layer once more (V4-Flash's shape at 4 layers, H200 machine: the
128-token tail of a 1k or 8k prompt took 0.25-0.71 s, its whole first part 0.28-0.47 s). A batch-invariant
prompt is cut there instead (`ModelRunner.prefill_end`), so the state is the one a step ended with and the same
prompt again, started from it, computes its tail in the same chunk, over the same cache, as that run did: the
same bits.

States are charged their tensors' bytes against the V4 cache budget (budget.py) and dropped least recently used
first before a sequence is refused room. A state in use costs nothing more: the borrowing sequence's cache refers
to its tensors (caches.py: `restore`) until its own steps replace them, and the sequence is charged in full.

Not borrowed from, nor kept for: prompts that ask for prompt logprobs (computed whole, the same bits every time:
engines/runtime/batch_invariance.py), and every prompt while the MTP head drafts (its own cache per sequence,
mtp.py, is not kept)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from engines.kt.cache.block_pool import extend_hashes
from engines.kt.families.deepseek_v4.budget import CacheBudget
from engines.kt.families.deepseek_v4.caches import restore, snapshot_bytes

PAGE = 128  # positions of a page: the HCA compress rate (CSA's 4 divides it)
SEEN_PAGES = 1 << 16  # page hashes of recent prompts remembered to find shared prefixes (a 16-byte hash each)


@dataclass(slots=True)
class _State:
    position: int
    layers: list
    nbytes: int


@dataclass(slots=True)
class PrefixPlan:
    """What the prefix cache does for one admitted sequence: the chain hashes of its full pages, the positions
    whose cache state it keeps once computed (`cuts`), and the position it started from."""

    hashes: list[bytes]
    cuts: list[int] = field(default_factory=list)
    borrowed: int = 0


class PrefixStore:
    """The stored cache states, by the chain hash of their last page, least recently used first."""

    def __init__(self, budget: CacheBudget, enabled: bool, seen_pages: int = SEEN_PAGES):
        self.budget = budget
        self.enabled = enabled
        self._states: OrderedDict[bytes, _State] = OrderedDict()
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._seen_pages = seen_pages
        if enabled:
            budget.reclaim = self.reclaim

    def __len__(self) -> int:
        return len(self._states)

    def plan(self, tokens: list[int], root: str) -> tuple[PrefixPlan, _State | None]:
        """The plan for a sequence of `tokens` under the prefix key `root` (the adapter's), and the stored state of
        its longest prefix (None: none), always leaving its last token to compute. Changes nothing (`admitted`
        records it once the sequence is admitted)."""
        pages = (len(tokens) - 1) // PAGE
        hashes = extend_hashes([], tokens, pages, PAGE, root)
        hit = next((i for i in range(pages, 0, -1) if hashes[i - 1] in self._states), 0)
        seen = 0
        while seen < pages and hashes[seen] in self._seen:
            seen += 1
        cuts = sorted({p * PAGE for p in (seen, pages) if p > hit})
        return PrefixPlan(hashes, cuts, hit * PAGE), self._states[hashes[hit - 1]] if hit else None

    def touch(self, plan: PrefixPlan) -> None:
        """The state `plan` borrows becomes the most recently used (the last that room for its sequence drops)."""
        key = plan.hashes[plan.borrowed // PAGE - 1] if plan.borrowed else None
        if key in self._states:
            self._states.move_to_end(key)

    def admitted(self, plan: PrefixPlan, state: _State | None, cache: Any) -> None:
        """A sequence planned by `plan` was admitted with `cache` (fresh): fill it from the `state` it borrows
        (dropped meanwhile or not: the sequence is charged for all it holds), and remember its pages as seen."""
        if state is not None:
            restore(cache, state.layers)
        for h in plan.hashes:
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > self._seen_pages:
            self._seen.popitem(last=False)

    def wants(self, plan: PrefixPlan, position: int) -> bool:
        """Whether the state at `position`, one of the plan's cuts, is still to be kept: none is stored for its
        tokens (one that is becomes the most recently used)."""
        key = plan.hashes[position // PAGE - 1]
        if key in self._states:  # another sequence kept it first (or a rerun of this step)
            self._states.move_to_end(key)
            return False
        return True

    def keep(self, plan: PrefixPlan, position: int, layers: list) -> None:
        """Keep `layers`, a cache's state at `position` (one of the plan's cuts; caches.py: `snapshot`), if the
        budget has room and no state for its tokens is stored."""
        key = plan.hashes[position // PAGE - 1]
        if key in self._states:  # two sequences of one step with the same tokens: the first one's
            return
        nbytes = snapshot_bytes(layers)
        if self.budget.hold_prefix(nbytes):
            self._states[key] = _State(position, layers, nbytes)

    def in_flight(self, plan: PrefixPlan, leaders: list[tuple[PrefixPlan, int]]) -> bool:
        """Whether one of `leaders` (the plan and computed positions of a sequence computing its prompt) is yet to
        keep a state longer than `plan` borrows that `plan`'s tokens start with."""
        for theirs, computed in leaders:
            for cut in theirs.cuts:
                page = cut // PAGE
                if (cut > plan.borrowed and computed < cut and page <= len(plan.hashes)
                        and plan.hashes[page - 1] == theirs.hashes[page - 1]
                        and theirs.hashes[page - 1] not in self._states):
                    return True
        return False

    def reclaim(self, nbytes: int) -> None:
        """Drop stored states, least recently used first, until `nbytes` are freed or none is left."""
        freed = 0
        while self._states and freed < nbytes:
            _, state = self._states.popitem(last=False)
            self.budget.drop_prefix(state.nbytes)
            freed += state.nbytes
