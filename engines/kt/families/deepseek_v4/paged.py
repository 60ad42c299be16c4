"""DeepSeek-V4 decode rows over paged caches: every decoding sequence of a step attends in one batch per layer.

A sequence prefills through transformers' cache layers (caches.py, batch.py: prompt chunks need the modules'
own windowed masks and compressors over many rows). At its first decode step its cache moves here (`adopt`), and
from then on its decode rows write and read these pools, all sequences of the step together, in a fixed number of
tensor operations per layer whatever the number of sequences:

- **slots** (one per decoding sequence, the same index in every layer): the sliding window as a ring of
  `sliding_window` keys (position p at p % W: the W positions a decode row sees, p - W + 1 .. p), and each
  compressor's last rows as a ring (HCA: the `rate` rows of the window being filled; CSA: two windows, 2 x rate
  rows, since an entry pools the previous window's first half (Ca) with its own second half (Cb)). Ring rows hold
  the compressor's key projection in the model's dtype and its gate projection plus the position bias in float32,
  as transformers' compressors compute them before their softmax.
- **pages** of PAGE compressed entries: per layer, the compressor's entries (and on CSA layers the lightning
  indexer's keys, sharing the page ids), allocated in the same order for every layer of one compression rate, so
  a sequence has one page table per rate. A row at position p may see the entries [0, (p + 1) // rate).

The pools take their dtype and devices from the first cache that moves in, and their size from the cache budget
the runner gives (a slot per sequence it admits, every rate's pages for all its positions): sized once, they do not
grow while serving. Without a budget they grow by half as sequences come (each growth makes new tensors).

A decode row at position p (`attend`): its key goes into the window ring; its compressor and indexer projections
into their rings; where p closes a window ((p + 1) % rate == 0, known on the host) the window's entry is computed
from the ring exactly as transformers' compressor computes it (the same modules: the softmax over the window's
rows in float32, the norm, the rotary embedding at the window's first position) and written into its page. On a
CSA layer the indexer scores the row's queries against its keys, and the row attends over the window and the
`index_topk` best entries (all valid entries where there are no more); on an HCA layer over the window and every
entry. Attention is V4's eager attention with its sinks (batch.py: `attend`), over a mask of the valid keys.

Nothing here is read before it was written for the sequence: a ring row of an earlier position of another
sequence that held the slot is never valid (the window's valid rows are the sequence's own positions, a closing
window's rows were all written since it opened), and entries past a sequence's count are masked. A decode step run
again (after a failure) writes the same places with the same values, so going back one step needs nothing.

A step comes in two forms (`DecodeStep`). As it is: its own rows, page tables as wide as its longest sequence's,
and only the rows that close a window pool one. Padded (`PagedDecode.padded_step`, what a captured CUDA graph
replays: graphs.py): rows up to a bucket, page tables up to a power of two of pages, and every row pools its
window, those closing none into a scratch entry, so the step's shapes and operations depend on its bucket and
widths alone, never on its positions. Pad rows write into the scratch slot and see no key, which makes their
attention exactly zero. Slot 0 and page 0 of every rate are never a sequence's: slot 0 is the scratch slot, page
0's entry 0 the scratch entry, and its entry 1, never written, is what the unused places of a page table read.

Checked against transformers 5.24's V4 modules position by position (tests/engines/kt/families/deepseek_v4/
test_v4_paged.py): the same bits for the compressed entries, the keys' order within attention aside."""
from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACompressor, apply_rotary_pos_emb

PAGE = 64  # compressed entries a page holds (CSA: 256 positions; HCA: 8,192)
_GROWTH = 1.5  # a pool that runs out grows to this many times its size (or to what is asked, if more)
SCRATCH_SLOT = 0  # pad rows of a padded step write here; never a sequence's
SCRATCH_ENTRY = 0  # flat entry index (page 0) a padded step's rows that close no window write
BLANK_ENTRY = 1  # flat entry index (page 0) never written: what a page table's unused places point at


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(slots=True)
class PagedSequence:
    """One decoding sequence's place in the pools: its slot and, per compression rate, its pages."""

    slot: int
    pages: dict[int, list[int]] = field(default_factory=dict)


class _Compressor:
    """One compressor of one layer (the CSA/HCA compressor, or a CSA layer's indexer): its ring and its entries."""

    def __init__(self, module: nn.Module, rate: int, overlap: bool):
        self.module = module
        self.rate = rate
        self.overlap = overlap
        self.dim = module.head_dim  # the entries' width
        self.width = module.kv_proj.out_features  # a row's projection: 2 x dim with CSA's overlapping windows
        self.ring = 2 * rate if overlap else rate
        self.kv: torch.Tensor | None = None  # [slots, ring, width], the model's dtype
        self.gate: torch.Tensor | None = None  # [slots, ring, width] float32, the position bias added
        self.entries: torch.Tensor | None = None  # [pages, PAGE, dim]

    def grow_slots(self, slots: int, dtype: torch.dtype, device: torch.device) -> None:
        have = 0 if self.kv is None else self.kv.shape[0]
        kv = torch.zeros(slots - have, self.ring, self.width, dtype=dtype, device=device)
        gate = torch.full((slots - have, self.ring, self.width), float("-inf"), dtype=torch.float32, device=device)
        self.kv = kv if self.kv is None else torch.cat([self.kv, kv])
        self.gate = gate if self.gate is None else torch.cat([self.gate, gate])

    def grow_pages(self, pages: int, dtype: torch.dtype, device: torch.device) -> None:
        have = 0 if self.entries is None else self.entries.shape[0]
        new = torch.zeros(pages - have, PAGE, self.dim, dtype=dtype, device=device)
        self.entries = new if self.entries is None else torch.cat([self.entries, new])

    def bias(self, positions: torch.Tensor) -> torch.Tensor:
        """The position bias of rows at `positions` within their windows: [rows, width] float32."""
        return self.module.position_bias[positions % self.rate]

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Entries of windows whose rows are `kv` [n, rows, dim] and `gate` (bias added) [n, rows, dim], each
        window's first position in `first` [n]: transformers' compressor arithmetic, one window per entry."""
        m = self.module
        compressed = m.kv_norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))[:, None]
        cos, sin = m.rotary_emb(compressed, position_ids=first[:, None], layer_type=m.rope_layer_type)
        return apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin)[:, 0, 0]


class _Layer:
    """One attention layer's pools: the window ring, and its compressor (and indexer) where it compresses."""

    def __init__(self, attn: nn.Module, window: int):
        self.attn = attn
        self.index = attn.layer_idx
        self.window = window
        self.keys: torch.Tensor | None = None  # [slots, window, head_dim]
        self.device: torch.device | None = None
        comp = attn.compressor
        self.rate = 0 if comp is None else comp.compress_rate
        self.csa = isinstance(comp, DeepseekV4CSACompressor)
        self.compressors: dict[str, _Compressor] = {}
        if comp is not None:
            self.compressors["compressor"] = _Compressor(comp, self.rate, self.csa)
            if self.csa:
                self.compressors["indexer"] = _Compressor(comp.indexer, self.rate, True)


class DecodeStep:
    """The host's part of one step's paged decode rows, made once for all layers: slots, positions and, per
    compression rate, where every row's entries lie and which rows pool a window into which entry.

    As it is (`rows` None): the step's own rows, tables as wide as its longest sequence's, `closing` the rows that
    close a window (None: none). Padded to `rows` with page tables of `pages[rate]` pages: every row pools (no
    `closing`), those closing none into SCRATCH_ENTRY; pad rows in SCRATCH_SLOT at position 0 see no key."""

    def __init__(self, pools: "PagedDecode", sequences: list[PagedSequence], positions: list[int],
                 device: torch.device, rows: int | None = None, pages: dict[int, int] | None = None):
        padded = rows is not None
        n = len(sequences)
        self.rows = rows = n if rows is None else rows
        at = torch.tensor(positions + [0] * (rows - n), dtype=torch.long)
        self.slots = torch.tensor([s.slot for s in sequences] + [SCRATCH_SLOT] * (rows - n), dtype=torch.long)
        self.positions = at
        self.window_valid = torch.arange(pools.window)[None] <= at[:, None]
        self.window_valid[n:] = False
        self.by_rate: dict[int, dict[str, Any]] = {}
        for rate in pools.rates:
            width = (pages[rate] if padded else max(len(s.pages[rate]) for s in sequences)) * PAGE
            table = torch.full((rows, width), BLANK_ENTRY, dtype=torch.long)
            for b, s in enumerate(sequences):
                owned = torch.tensor(s.pages[rate], dtype=torch.long)
                flat = (owned[:, None] * PAGE + torch.arange(PAGE)[None]).flatten()
                table[b, :flat.numel()] = flat
            counts = at[:n].add(1).div(rate, rounding_mode="floor")
            valid = torch.zeros(rows, width, dtype=torch.bool)
            valid[:n] = torch.arange(width)[None] < counts[:, None]
            closes = (at + 1) % rate == 0
            closes[n:] = False
            pooled = torch.arange(rows) if padded else closes.nonzero()[:, 0]
            window = at[pooled] // rate
            into = table[pooled, window]
            ring = torch.arange(rate)[None]
            self.by_rate[rate] = {
                "entries": table,  # flat pool index of each entry
                "valid": valid,
                "first": window * rate,
                "into": into.masked_fill(~closes[pooled], SCRATCH_ENTRY) if padded else into,
                # CSA's overlapping windows: the ring rows [n, rate] of each pooled window's previous half and of
                # its own (the ring holds two windows), and each pooled row's number
                "prev": ((window + 1) % 2 * rate)[:, None] + ring,
                "own": (window % 2 * rate)[:, None] + ring,
                "order": torch.arange(len(pooled))[:, None],
            }
            if not padded:
                self.by_rate[rate]["closing"] = pooled if len(pooled) else None
        # a padded step's shapes and operations are those of every step of its key
        self.key = (rows, tuple(sorted(pages.items()))) if padded else None
        if device.type != "cpu":
            self._apply(lambda t: t.to(device, non_blocking=True))

    def _tensors(self) -> list[tuple[dict, str]]:
        places: list[tuple[dict, str]] = [(self.__dict__, name) for name in ("slots", "positions", "window_valid")]
        for at in self.by_rate.values():
            places += [(at, name) for name, t in at.items() if t is not None]
        return places

    def _apply(self, move) -> None:
        for owner, name in self._tensors():
            owner[name] = move(owner[name])

    def to(self, device: torch.device) -> "DecodeStep":
        """This step with its tensors on `device` (a new one; this one is left as it is)."""
        return self._moved(lambda t: t.to(device, non_blocking=True))

    def pinned(self) -> "DecodeStep":
        """This step with its tensors in pinned host memory (a new one): a copy from it to the GPU waits for
        nothing on the host (one from pageable memory may wait for the stream)."""
        return self._moved(torch.Tensor.pin_memory)

    def _moved(self, move) -> "DecodeStep":
        moved = copy.copy(self)
        moved.by_rate = {rate: dict(at) for rate, at in self.by_rate.items()}
        moved._apply(move)
        return moved

    def copy_(self, other: "DecodeStep") -> None:
        """Take `other`'s values (a padded step of the same key) into this step's tensors, as a replayed graph
        reads them."""
        assert other.key == self.key and self.key is not None
        for (mine, name), (theirs, _) in zip(self._tensors(), other._tensors()):
            mine[name].copy_(theirs[name], non_blocking=True)


@dataclass(slots=True)
class Forecast:
    """A padded step made ahead of its turn (`PagedDecode.next_step`), and what it was made from."""

    step: DecodeStep
    sequences: list[PagedSequence]
    positions: list[int]
    holding: list[tuple[int, tuple[int, ...]]]  # each sequence's slot and page counts when it was made
    generation: int
    staged: Any = None  # what its tensors were already copied into (graphs.py: a captured step's inputs)

    def holds(self, sequences: list[PagedSequence], positions: list[int], generation: int) -> bool:
        """Whether this is the padded step of `sequences` at `positions` now: the same sequences (their slots and
        pages unchanged: a sequence's pages only grow, and a released one has slot -1) over the same pools."""
        return (generation == self.generation and positions == self.positions
                and len(sequences) == len(self.sequences) and all(a is b for a, b in zip(sequences, self.sequences))
                and _holding(sequences) == self.holding)


def _holding(sequences: list[PagedSequence]) -> list[tuple[int, tuple[int, ...]]]:
    return [(s.slot, tuple(len(pages) for _, pages in sorted(s.pages.items()))) for s in sequences]


class PagedDecode:
    """The paged caches of a V4 model's decoding sequences (see the module docstring)."""

    def __init__(self, model: nn.Module, sequences: int | None = None, positions: int | None = None):
        """`sequences` and `positions`: what the cache budget holds (budget.py's CacheBudget), which the pools are
        sized to when the first sequence moves in, so that they never grow while serving (a growth makes new
        tensors, which drops the captured whole decode steps: graphs.py). None: they grow as sequences come."""
        config = model.config
        self.sized_for = (sequences, positions) if sequences and positions else None
        self.window = config.sliding_window
        self.layers = [_Layer(layer.self_attn, self.window) for layer in model.model.layers]
        self.rates = sorted({layer.rate for layer in self.layers if layer.rate})
        self.slots = 0
        self.free_slots: list[int] = []
        self.pages = {rate: 0 for rate in self.rates}
        self.free_pages: dict[int, list[int]] = {rate: [] for rate in self.rates}
        self.dtype: torch.dtype | None = None
        self.generation = 0  # counts the pools' growths: a captured graph reads the tensors of one generation

    # ------------------------------------------------------------------------------ slots and pages
    def _slot(self) -> int:
        if not self.free_slots:
            self._grow_slots(max(self.slots + 1, int(self.slots * _GROWTH) + 1))
        return self.free_slots.pop()

    def _page(self, rate: int) -> int:
        if not self.free_pages[rate]:
            have = self.pages[rate]
            self._grow_pages(rate, max(have + 1, int(have * _GROWTH) + 1))
        return self.free_pages[rate].pop()

    def _grow_slots(self, grown: int) -> None:
        grown = max(grown, SCRATCH_SLOT + 2)
        for layer in self.layers:
            device = layer.device
            keys = torch.zeros(grown - self.slots, self.window, layer.attn.head_dim, dtype=self.dtype, device=device)
            layer.keys = keys if layer.keys is None else torch.cat([layer.keys, keys])
            for c in layer.compressors.values():
                c.grow_slots(grown, self.dtype, device)
        self.free_slots = list(range(grown - 1, max(self.slots, SCRATCH_SLOT + 1) - 1, -1)) + self.free_slots
        self.slots = grown
        self.generation += 1

    def _grow_pages(self, rate: int, grown: int) -> None:
        have, grown = self.pages[rate], max(grown, 2)
        for layer in self.layers:
            if layer.rate == rate:
                for c in layer.compressors.values():
                    c.grow_pages(grown, self.dtype, layer.device)
        # page 0: the scratch and blank entries
        self.free_pages[rate] = list(range(grown - 1, max(have, 1) - 1, -1)) + self.free_pages[rate]
        self.pages[rate] = grown
        self.generation += 1

    def _size_to_budget(self) -> None:
        """Every sequence's slot, and for each rate the pages of all positions however the sequences share them
        (each sequence's last page partly filled), beside the scratch slot and page."""
        sequences, positions = self.sized_for
        self._grow_slots(sequences + 1)
        for rate in self.rates:
            self._grow_pages(rate, positions // rate // PAGE + sequences + 1)

    def reserve(self, seq: PagedSequence, position: int) -> None:
        """Pages for the entries a row at `position` may write (its window's, (position // rate))."""
        for rate in self.rates:
            pages = seq.pages.setdefault(rate, [])
            while len(pages) * PAGE <= position // rate:
                pages.append(self._page(rate))

    def release(self, seq: PagedSequence) -> None:
        if seq.slot < 0:
            return
        self.free_slots.append(seq.slot)
        for rate, pages in seq.pages.items():
            self.free_pages[rate].extend(pages)
        seq.slot, seq.pages = -1, {}

    def prepare(self, dtype: torch.dtype, devices: list[torch.device] | None = None) -> None:
        """The pools' dtype and each layer's device (default: its attention's), sized to the budget if there is
        one: at the first sequence that moves in, or before (graphs.py captures steps over them at load)."""
        self.dtype = dtype
        for layer, device in zip(self.layers, devices or [next(l.attn.parameters()).device for l in self.layers]):
            layer.device = device
        if self.sized_for is not None:
            self._size_to_budget()

    def usage(self) -> tuple[int, int]:
        """(slots in use, pages in use over every rate): sequences', not the scratch slot and page."""
        return (max(self.slots - len(self.free_slots) - 1, 0),
                sum(max(self.pages[r] - len(self.free_pages[r]) - 1, 0) for r in self.rates))

    # ------------------------------------------------------------------------------ a prefilled cache moves in
    def adopt(self, cache: Any, computed: int) -> PagedSequence:
        """A slot and pages holding what transformers' V4 `cache` holds after `computed` positions."""
        if self.dtype is None:  # the pools take the dtype and devices of the first cache that moves in
            self.prepare(_dtype_of(cache), [state.keys.device for state in cache.layers])
        seq = PagedSequence(self._slot())
        for rate in self.rates:
            seq.pages[rate] = [self._page(rate) for _ in range((computed // rate) // PAGE + 1)]
        slot = seq.slot
        for layer, state in zip(self.layers, cache.layers):
            keys = state.keys[0, 0]  # the last (up to) W - 1 positions
            at = torch.arange(computed - keys.shape[0], computed, device=keys.device) % self.window
            layer.keys[slot, at] = keys.to(layer.keys.dtype)
            for name, c in layer.compressors.items():
                entries = state.compressed_kv[name]
                count = 0 if entries is None else entries.shape[1]
                if count != computed // c.rate:
                    raise RuntimeError(f"V4 layer {layer.index}'s {name} holds {count} entries at {computed} "
                                       f"positions, not {computed // c.rate}")
                if count:
                    flat = self._flat(seq.pages[c.rate], count, entries.device)
                    c.entries.view(-1, c.dim)[flat] = entries[0].to(c.entries.dtype)
                c.kv[slot] = 0
                c.gate[slot] = float("-inf")
                buffered = state.buffer_kv[name]
                first = count * c.rate
                if buffered is not None and buffered.shape[1]:
                    rows = torch.arange(first, first + buffered.shape[1], device=buffered.device)
                    c.kv[slot, rows % c.ring] = buffered[0].to(c.kv.dtype)
                    c.gate[slot, rows % c.ring] = state.buffer_gate[name][0] + c.bias(rows)
                if c.overlap and count:  # the last closed window's first half, which the next entry pools
                    rows = torch.arange(first - c.rate, first, device=entries.device) % c.ring
                    c.kv[slot, rows, :c.dim] = state.overlap_kv[name][0].to(c.kv.dtype)
                    c.gate[slot, rows, :c.dim] = state.overlap_gate[name][0].float()
        return seq

    @staticmethod
    def _flat(pages: list[int], count: int, device: torch.device) -> torch.Tensor:
        at = torch.arange(count)
        return (torch.tensor(pages, dtype=torch.long)[at // PAGE] * PAGE + at % PAGE).to(device)

    # ------------------------------------------------------------------------------ a step's decode rows
    def step(self, sequences: list[PagedSequence], positions: list[int], device: torch.device) -> DecodeStep:
        for seq, position in zip(sequences, positions):
            self.reserve(seq, position)
        return DecodeStep(self, sequences, positions, device)

    def padded_step(self, sequences: list[PagedSequence], positions: list[int], rows: int,
                    device: torch.device) -> DecodeStep:
        """The step padded to `rows` rows and page tables of a power of two of pages (module docstring)."""
        for seq, position in zip(sequences, positions):
            self.reserve(seq, position)
        return DecodeStep(self, sequences, positions, device, rows=rows, pages=self._widths(sequences))

    def next_step(self, sequences: list[PagedSequence], positions: list[int], rows: int) -> "Forecast | None":
        """On the host, the padded step of `sequences` one position past `positions` (each row's next decode row),
        made ahead of it (graphs.py makes it while the GPU runs the step at `positions`); None when a row would
        need a page it does not hold yet, since taking one belongs to the step itself (`reserve`, which may grow the
        pools)."""
        if any((position + 1) // rate >= len(seq.pages.get(rate, ())) * PAGE
               for seq, position in zip(sequences, positions) for rate in self.rates):
            return None
        after = [p + 1 for p in positions]
        step = DecodeStep(self, sequences, after, torch.device("cpu"), rows=rows, pages=self._widths(sequences))
        return Forecast(step, list(sequences), after, _holding(sequences), self.generation)

    def _widths(self, sequences: list[PagedSequence]) -> dict[int, int]:
        return {rate: _pow2(max(len(s.pages[rate]) for s in sequences)) for rate in self.rates}

    def blank_step(self, rows: int, pages: dict[int, int] | None = None) -> DecodeStep:
        """A padded step of `rows` pad rows and page tables of `pages` pages per rate (default one each: the key
        of short sequences' steps): what a graph of that key is captured over before any sequence decodes (its
        writes go to the scratch places)."""
        return DecodeStep(self, [], [], torch.device("cpu"), rows=rows,
                          pages=pages or {rate: 1 for rate in self.rates})

    def widths_up_to(self, positions: int) -> list[dict[int, int]]:
        """The page widths (`padded_step`'s, per rate) one sequence's decode steps take on its way to `positions`
        positions, in the order it meets them."""
        widths: list[dict[int, int]] = []
        # a rate's page count changes only where a position reaches a multiple of rate x PAGE
        for position in range(0, max(positions, 1), min(self.rates, default=1) * PAGE):
            width = {rate: _pow2(position // rate // PAGE + 1) for rate in self.rates}
            if not widths or widths[-1] != width:
                widths.append(width)
        return widths

    def attend(self, layer_index: int, step: DecodeStep, q: torch.Tensor, kv: torch.Tensor, x: torch.Tensor,
               q_residual: torch.Tensor) -> torch.Tensor:
        """Layer `layer_index`'s cached attention of the step's decode rows: q [1, heads, B, d], kv [1, 1, B, d],
        x [1, B, hidden], q_residual [1, B, q_lora_rank] in the step's row order. [1, B, heads, d]."""
        layer = self.layers[layer_index]
        slots = step.slots
        layer.keys[slots, step.positions % self.window] = kv[0, 0]
        keys, valid = [layer.keys[slots]], [step.window_valid]
        for name, c in layer.compressors.items():
            self._compress(c, step, x[0], slots)
        if layer.rate:
            at = step.by_rate[layer.rate]
            main = layer.compressors["compressor"]
            pool = main.entries.view(-1, main.dim)
            if not layer.csa:  # HCA: every entry
                keys.append(pool[at["entries"]])
                valid.append(at["valid"])
            else:
                picked, ok = self._index(layer, step, x, q_residual)
                keys.append(pool[picked])
                valid.append(ok)
        attn = layer.attn
        return _attend(q[0].transpose(0, 1).unsqueeze(2), torch.cat(keys, dim=1), torch.cat(valid, dim=1),
                       attn.scaling, attn.sinks)

    def _compress(self, c: _Compressor, step: DecodeStep, x: torch.Tensor, slots: torch.Tensor) -> None:
        """The rows' projections into the ring; the entries of the windows they close into their pages."""
        module = c.module
        rows = step.positions % c.ring
        c.kv[slots, rows] = module.kv_proj(x)
        c.gate[slots, rows] = module.gate_proj(x) + c.bias(step.positions)
        at = step.by_rate[c.rate]
        if "closing" not in at:  # padded: every row pools, those that close no window into the scratch entry
            owners = slots
        elif at["closing"] is None:
            return
        else:
            owners = slots[at["closing"]]
        kv, gate = c.kv[owners], c.gate[owners]  # [n, ring, width]
        if c.overlap:  # the previous window's first half (Ca), then this window's second half (Cb)
            d, n, prev, own = c.dim, at["order"], at["prev"], at["own"]
            kv = torch.cat([kv[n, prev, :d], kv[n, own, d:]], dim=1)
            gate = torch.cat([gate[n, prev, :d], gate[n, own, d:]], dim=1)
        c.entries.view(-1, c.dim)[at["into"]] = c.pool(kv, gate, at["first"]).to(c.entries.dtype)

    def _index(self, layer: _Layer, step: DecodeStep, x: torch.Tensor, q_residual: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The lightning indexer's picks for each row: flat pool indices [B, k] of the entries it attends and
        which of them are valid [B, k]; every valid entry where a row has at most index_topk of them."""
        at = step.by_rate[layer.rate]
        entries, valid = at["entries"], at["valid"]
        indexer = layer.compressors["indexer"]
        m = indexer.module
        if entries.shape[1] <= m.index_topk:
            return entries, valid
        rows = x.shape[1]
        positions = step.positions[:, None]
        cos, sin = m.rotary_emb(x, position_ids=positions, layer_type=m.rope_layer_type)
        q = m.q_b_proj(q_residual[0]).view(rows, 1, -1, m.head_dim).transpose(1, 2)
        q = apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)  # [B, 1, heads, dim]
        keys = indexer.entries.view(-1, indexer.dim)[entries]  # [B, E, dim]
        scores = m.scorer(q, keys, x[0][:, None])[:, 0].masked_fill(~valid, float("-inf"))  # [B, E]
        top = scores.topk(m.index_topk, dim=-1)
        return entries.gather(1, top.indices), top.values > float("-inf")

    def describe(self) -> str:
        slots, pages = self.usage()
        return f"paged decode: {slots} sequences, {pages} pages of {PAGE} entries"


def _attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float, sinks: torch.Tensor
            ) -> torch.Tensor:
    """V4's attention with a sink per head for B decode rows: q [B, heads, 1, d] over their own keys [B, K, d]
    (shared key-value head), `valid` [B, K]; batch.py's `attend` row by row. [1, B, heads, d]."""
    rows, heads = q.shape[0], q.shape[1]
    scores = torch.matmul(q, keys.transpose(1, 2).unsqueeze(1)) * scaling  # [B, heads, 1, K]
    scores = scores.masked_fill(~valid[:, None, None], float("-inf"))
    logits = torch.cat([scores, sinks.view(1, heads, 1, 1).expand(rows, -1, 1, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(keys.dtype)
    return torch.matmul(probs, keys.unsqueeze(1))[:, :, 0].unsqueeze(0)  # [1, B, heads, d]


def _dtype_of(cache: Any) -> torch.dtype:
    return next(layer.keys.dtype for layer in cache.layers if getattr(layer, "keys", None) is not None)


def keep_until_collected(owner: Any, pools: PagedDecode, seq: PagedSequence) -> None:
    """Give `seq`'s slot and pages back when `owner` (its SequenceCache) is collected, if it was not released."""
    weakref.finalize(owner, pools.release, seq)
