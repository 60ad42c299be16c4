"""CUDA graphs of the decode step (kt_use_cuda_graph): the whole step — every layer's GPU work, the copies
to and from the CPU experts' pinned buffers and the stream callbacks that start and await kt-kernel — is
captured once per (batch size, context length) bucket and replayed, so a decode step costs one launch
instead of thousands of Python-issued kernels.

A step is padded up to its buckets: extra rows decode a dummy token into a scratch cache slot, extra
context positions are masked out."""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

log = logging.getLogger("ktserve.engine.kt")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CONTEXT_BUCKETS = (1024, 4096)


class DecodeGraphs:
    def __init__(self, forward: Callable[..., torch.Tensor], *, device: torch.device, max_batch: int,
                 max_len: int, scratch_slot: int):
        self.forward = forward  # (ids, positions, write_slots, read_slots, mask) -> logits [B, vocab]
        self.device = device
        self.batch_sizes = sorted({b for b in BATCH_BUCKETS if b < max_batch} | {max_batch})
        self.context_sizes = sorted({c for c in CONTEXT_BUCKETS if c < max_len} | {max_len})
        self.scratch_slot = scratch_slot
        b, c = self.batch_sizes[-1], self.context_sizes[-1]
        self.ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.write = torch.full((b,), scratch_slot, dtype=torch.long, device=device)
        self.read = torch.full((b, c), scratch_slot, dtype=torch.long, device=device)
        self.mask = torch.zeros(b, c, dtype=torch.bool, device=device)
        self.mask[:, 0] = True  # a padded row must attend to something, or its softmax is NaN
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
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

    def _capture(self, batch: int, context: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        inputs = self._inputs(batch, context)
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
        return graph, out

    def fits(self, batch: int, context: int) -> bool:
        return batch <= self.batch_sizes[-1] and context <= self.context_sizes[-1]

    def run(self, ids: list[int], positions: list[int], write: list[int], read: list[torch.Tensor]
            ) -> torch.Tensor:
        """Replay the smallest graph that fits; logits of the real rows, float32 on the CPU."""
        n, longest = len(ids), max(len(r) for r in read)
        batch = next(b for b in self.batch_sizes if b >= n)
        context = next(c for c in self.context_sizes if c >= longest)
        read_rows = torch.full((batch, context), self.scratch_slot, dtype=torch.long)
        mask_rows = torch.zeros(batch, context, dtype=torch.bool)
        mask_rows[:, 0] = True
        for i, slots in enumerate(read):
            read_rows[i, :len(slots)] = slots
            mask_rows[i, :len(slots)] = True
        pad = batch - n
        self.ids[:batch].copy_(torch.tensor(ids + [0] * pad), non_blocking=True)
        self.positions[:batch].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        self.write[:batch].copy_(torch.tensor(write + [self.scratch_slot] * pad), non_blocking=True)
        self.read[:batch, :context].copy_(read_rows, non_blocking=True)
        self.mask[:batch, :context].copy_(mask_rows, non_blocking=True)
        graph, out = self.graphs[(batch, context)]
        graph.replay()
        return out[:n].float().cpu()
