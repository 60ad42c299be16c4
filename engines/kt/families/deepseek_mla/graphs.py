"""CUDA graphs of the decode step (kt_use_cuda_graph): the whole step — every layer's GPU work, the copies
to and from the CPU experts' pinned buffers and the stream callbacks that start and await kt-kernel — is
captured once per (batch size, context length) bucket and replayed, so a decode step costs one launch
instead of thousands of Python-issued kernels.

A step is padded up to its buckets: extra rows decode a dummy token into a scratch cache slot, extra
context positions are masked out. With FlashInfer attention the context is not gathered at all: each batch
bucket has its own FlashInfer wrapper with fixed-address index buffers, planned for the step's real pages
and lengths before the replay, so one context bucket serves every length."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

log = logging.getLogger("ktserve.engine.kt")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CONTEXT_BUCKETS = (1024, 4096)


class DecodeGraphs:
    def __init__(self, forward: Callable[..., torch.Tensor], *, device: torch.device, max_batch: int,
                 max_len: int, scratch_slot: int, cache: Any, attention: Any = None):
        # (ids, positions, write_slots, read_slots, mask, paged) -> (logits [B, vocab], final hidden states [B, H])
        self.forward = forward
        self.device = device
        self.cache = cache
        self.attention = attention  # engines.kt.families.deepseek_mla.flashinfer.FlashInferMLA, or None: torch gathers
        self.batch_sizes = sorted({b for b in BATCH_BUCKETS if b < max_batch} | {max_batch})
        self.context_sizes = [1] if attention else sorted({c for c in CONTEXT_BUCKETS if c < max_len} | {max_len})
        self.max_pages = cache.blocks_for(max_len)
        self.scratch_slot = scratch_slot
        self.scratch_block = scratch_slot // cache.block_size
        b, c = self.batch_sizes[-1], self.context_sizes[-1]
        self.ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.write = torch.full((b,), scratch_slot, dtype=torch.long, device=device)
        self.read = torch.full((b, c), scratch_slot, dtype=torch.long, device=device)
        self.mask = torch.zeros(b, c, dtype=torch.bool, device=device)
        self.mask[:, 0] = True  # a padded row must attend to something, or its softmax is NaN
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor], Any]] = {}
        self.pool = None

    def capture(self) -> None:
        started = time.perf_counter()
        for batch in reversed(self.batch_sizes):  # largest first, so smaller graphs reuse its memory
            for context in reversed(self.context_sizes):
                self.graphs[(batch, context)] = self._capture(batch, context)
        log.info("captured %d decode CUDA graphs (batch %s x context %s) in %.1fs", len(self.graphs),
                 self.batch_sizes, self.context_sizes, time.perf_counter() - started)

    def _inputs(self, batch: int, context: int):
        return (self.ids[:batch], self.positions[:batch], self.write[:batch], self.read[:batch, :context],
                self.mask[:batch, :context])

    def _plan(self, paged: Any, batch: int, lengths: list[int], pages: list[list[int]]) -> None:
        """Plan a bucket's FlashInfer wrapper; padded rows attend to the scratch slot alone."""
        pad = batch - len(lengths)
        paged.plan([1] * batch, lengths + [1] * pad, pages + [[self.scratch_block]] * pad, causal=False)

    def _capture(self, batch: int, context: int) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor], Any]:
        paged = None
        if self.attention is not None:
            paged = self.attention.for_graph(self.device, batch, self.max_pages)
            self._plan(paged, batch, [], [])
        inputs = self._inputs(batch, context) + ({self.device: paged} if paged else None,)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisation must not happen during capture
                self.forward(*inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(*inputs)
        return graph, out, paged

    def fits(self, batch: int, context: int) -> bool:
        return batch <= self.batch_sizes[-1] and (self.attention is not None or context <= self.context_sizes[-1])

    def run(self, ids: list[int], positions: list[int], write: list[int], lengths: list[int],
            pages: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the smallest graph that fits sequences of `lengths` positions held in `pages`; logits of
        the real rows, float32 on the graph's device, and their final hidden states."""
        n = len(ids)
        batch = next(b for b in self.batch_sizes if b >= n)
        context = 1 if self.attention else next(c for c in self.context_sizes if c >= max(lengths))
        graph, (out, hidden), paged = self.graphs[(batch, context)]
        if paged is not None:
            self._plan(paged, batch, lengths, pages)
        else:
            read_rows, mask_rows = self.cache.context_slots(pages, lengths, batch, context, self.scratch_slot)
            self.read[:batch, :context].copy_(read_rows, non_blocking=True)
            self.mask[:batch, :context].copy_(mask_rows, non_blocking=True)
        pad = batch - n
        self.ids[:batch].copy_(torch.tensor(ids + [0] * pad), non_blocking=True)
        self.positions[:batch].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        self.write[:batch].copy_(torch.tensor(write + [self.scratch_slot] * pad), non_blocking=True)
        graph.replay()
        # float32 on the GPU, in a tensor of its own (the next replay overwrites `out`): the sampler reduces
        # greedy rows there and copies the others to the host itself
        return out[:n].to(torch.float32, copy=True), hidden[:n].clone()
