"""CUDA graphs of DeepSeek-V4 steps (kt_use_cuda_graph), piecewise: the row-wise work of a step is captured,
each sequence's cached attention runs eagerly between the graphs.

A step's rows (batch.py) go through segments: segment 0 is the embeddings, the rotary tables of both rope kinds
and layer 0's work before its cached attention (`V4Batch.before_attention`); segment i is layer i-1's work after
its cached attention (`after_attention`: output projection, mix, the MoE block with the CPU experts submitted on
the stream, the shared expert, the wait) and layer i's before it; the last segment ends with the last layer's
streams. Between segments each sequence's rows extend its cache and attend over it (`cached_attention`), as an
eager step does, and the result goes into a fixed buffer the next segment reads.

Segments are bucketed by the step's total rows (1, 2, 4, ... up to the rows a step may feed), whatever sequences
the rows belong to: decode steps of many sequences, drafted chunks and small prompt chunks alike. A step is padded
to its bucket with token 0 at position 0; pad rows never reach a cache (the cached part sees the real rows only)
and their attention output is zeros. Each segment of each bucket is captured once at load (largest bucket first,
one memory pool, warmed up on a side stream), with the CPU experts' stream-ordered path: their copies and
kt-kernel's submit and wait are stream callbacks, captured like the rest (engines/kt/experts/cpu.py).

A step whose rows are all decode rows over the paged caches (paged.py) is captured whole instead, its cached
attention included: the paged step padded to its bucket and to a power of two of pages per compression rate
(`PagedDecode.padded_step`) has the same shapes and operations for every step of that key, so one graph per key
replays the step from the embeddings to the last layer's streams with no Python between layers. Each key's graph is
captured at its first step (a warm-up run of that step first, whose cache writes the replay makes again), at most
WHOLE_GRAPHS of them kept, the least recently used dropped; a growth of the paged pools (new tensors) drops them all.
While the GPU runs a whole step, the host makes the next one of the same sequences (`_forecast`: their page tables
one position on, ~0.5 ms of Python and small tensors at one row) and queues its copy into the graph's inputs
behind the replay, so the next step, if it is that one, only copies its token ids and replays.

Steps with a LoRA adapter, and steps of more rows than the largest bucket, run eagerly (batch.py). Without a GPU
the same segments (and whole decode steps) run eagerly over the padded buffers, their outputs kept in the same
tensors every step as a replayed graph's are (not captured): tests check them against the eager step."""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, NamedTuple

import torch

from engines.kt.experts.protocol import RoutedExperts
from engines.kt.families.deepseek_v4.batch import Piece, V4Batch, flat_rows
from engines.kt.families.deepseek_v4.paged import Forecast
from engines.kt.layers import device_scope
from engines.lora.modules import AdapterRows

log = logging.getLogger("ktserve.engine.kt")

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
WHOLE_GRAPHS = 32  # captured whole decode steps kept (keys: rows bucket and page widths)


class _WholeStep(NamedTuple):
    """A captured whole decode step: its graph, the padded step tensors it reads, the streams it leaves."""

    graph: Any
    step: Any  # paged.py: DecodeStep on the device
    hidden: torch.Tensor


class V4StepGraphs:
    """The row-wise segments of V4 steps over fixed buffers of up to `max_rows` rows on `device`; captured in
    CUDA graphs by `capture()`, else run eagerly."""

    def __init__(self, batch: V4Batch, max_rows: int, device: torch.device, longest: int | None = None):
        self.batch = batch
        self.longest = longest  # the most positions one sequence reaches (max_model_len); None: the pools' budget
        self.device = device
        self.layers = batch.layers
        self.buckets = sorted({b for b in ROW_BUCKETS if b < max_rows} | {max_rows})
        self.ids = torch.zeros(1, self.buckets[-1], dtype=torch.long, device=device)
        self.positions = torch.zeros(1, self.buckets[-1], dtype=torch.long, device=device)
        # the cached attention's output [1, rows, heads, head_dim] in the queries' dtype: made at the first segment
        self.attended: torch.Tensor | None = None
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[int, list[dict[str, Any]]] = {}  # each segment's outputs (fixed tensors), by bucket
        self.pool = None
        self.replayed = 0  # steps served from the captured graphs
        self.whole_steps = 0  # decode steps run whole (replayed, or eagerly without graphs)
        self.whole_captures = 0  # whole decode steps captured (first use of a key, or again after the pools grew)
        self.whole_capture_s = 0.0  # the seconds those captures took, their warm-up runs included
        self.captured = False
        self.whole: OrderedDict[tuple, _WholeStep] = OrderedDict()  # by DecodeStep.key, least recently used first
        self.whole_generation = -1  # the paged pools' generation the whole graphs read
        self.whole_off: str | None = None  # why whole decode steps are not captured, after a capture failed
        self.forecast: Forecast | None = None  # the next decode step, made while the GPU ran the last one
        self.forecast_off: str | None = None  # why next steps are not made ahead (bench.v4_trace compares)
        self.forecasts_used = 0  # whole decode steps that took the step made ahead of them

    def fits(self, pieces: list[Piece]) -> bool:
        return (sum(p.end - p.start for p in pieces) <= self.buckets[-1]
                and all(p.adapter is None for p in pieces))

    def hidden_streams(self, pieces: list[Piece]) -> torch.Tensor:
        """`V4Batch.hidden_streams` of a step that `fits`, from the segments of its bucket (or whole)."""
        ids, positions, spans = flat_rows(pieces)
        n = ids.shape[1]
        rows = next(b for b in self.buckets if b >= n)
        pad = torch.zeros(1, rows - n, dtype=torch.long)
        self.ids[:, :rows].copy_(torch.cat([ids, pad], dim=1), non_blocking=True)
        self.positions[:, :rows].copy_(torch.cat([positions, pad], dim=1), non_blocking=True)
        if self.batch.paged is not None and self.whole_off is None and all(p.paged is not None for p in pieces):
            return self._decode_whole(pieces, rows)
        graphs, segments, out = self.graphs.get(rows), None, None
        kept = any(p.record is not None for p in pieces)  # a verified draft's record keeps the cached parts' inputs
        self.replayed += graphs is not None
        with self.batch.lora.step(AdapterRows(spans)), device_scope(self.device):
            for k in range(len(self.layers) + 1):
                if graphs is not None:
                    graphs[k].replay()
                    out = self.outputs[rows][k]
                else:
                    out = self._eagerly(k, rows, out)
                if k == 0:  # the positions already on the device (a copy from the host would wait for the stream
                    # to run segment 0)
                    at = self.positions[:, :n]
                    segments = self.batch.segments(pieces, spans, out["embeds"][:, :n], at.clone() if kept else at)
                if k < len(self.layers):
                    attended = self.batch.cached_attention(self.layers[k].self_attn, out["before"].first(n, kept),
                                                           segments)
                    self.attended[:, :n].copy_(attended)
                    self.attended[:, n:rows].zero_()
        return out["hidden"][0, :n].clone()  # the next step's replay overwrites `out`

    def _decode_whole(self, pieces: list[Piece], rows: int) -> torch.Tensor:
        """A step of paged decode rows (one a piece), padded to `rows`: its whole graph replayed (captured at the
        key's first step), or without graphs the same work eagerly."""
        n = len(pieces)
        paged = self.batch.paged
        sequences, positions = [p.paged for p in pieces], [p.start for p in pieces]
        forecast, self.forecast = self.forecast, None
        if forecast is not None and forecast.step.rows == rows and forecast.holds(sequences, positions,
                                                                                   paged.generation):
            step, staged = forecast.step, forecast.staged
            self.forecasts_used += 1
        else:
            step, staged = paged.padded_step(sequences, positions, rows, torch.device("cpu")), None
        self.whole_steps += 1
        with self.batch.lora.step(AdapterRows.uniform(None)), device_scope(self.device):
            if not self.captured:
                hidden = self._whole(rows, step.to(self.device))
                self._forecast(sequences, positions, rows, None)
                return hidden[0, :n].clone()
            whole = self._whole_graph(step)
            if whole is None:  # its capture failed: this step and the later ones as segments
                return self.hidden_streams(pieces)
            if staged is not whole:  # not already copied into this graph's inputs behind the step before
                whole.step.copy_(step)
            whole.graph.replay()
            self._forecast(sequences, positions, rows, whole)
        self.replayed += 1
        return whole.hidden[0, :n].clone()  # the next replay overwrites it

    def _forecast(self, sequences: list, positions: list[int], rows: int, whole: _WholeStep | None) -> None:
        """Make the next decode step of these sequences now, while the GPU runs this one, so that the host's part of
        that step (its page tables, ~0.5 ms at one row) is not spent between two steps; replayed graphs also get its
        tensors copied into `whole`'s inputs behind this step on the stream (from pinned memory, so the copy waits
        for nothing). The next step takes it if it is the step this forecasts (`Forecast.holds`)."""
        if self.forecast_off is not None:
            return
        forecast = self.batch.paged.next_step(sequences, positions, rows)
        if forecast is not None and whole is not None and forecast.step.key == whole.step.key:
            pinned = forecast.step.pinned()
            whole.step.copy_(pinned)  # ordered after this step's replay, which reads the tensors it overwrites
            forecast.step, forecast.staged = pinned, whole
        self.forecast = forecast

    def _whole(self, rows: int, step: Any) -> torch.Tensor:
        """Every segment of a `rows`-row bucket with each layer's paged attention between them: the streams."""
        out = None
        for k in range(len(self.layers) + 1):
            out = self._segment(k, rows, out)
            if k < len(self.layers):
                a = out["before"]
                self.attended[:, :rows].copy_(self.batch.paged.attend(self.layers[k].self_attn.layer_idx, step,
                                                                      a.q, a.kv, a.x, a.q_residual))
        return out["hidden"]

    def _whole_graph(self, step: Any) -> _WholeStep | None:
        """The captured whole step of `step`'s key, captured now if it is not kept (None: the capture failed)."""
        paged = self.batch.paged
        if self.whole_generation != paged.generation:  # the pools grew: the graphs read tensors no longer used
            self.whole.clear()
            self.whole_generation = paged.generation
        whole = self.whole.get(step.key)
        if whole is not None:
            self.whole.move_to_end(step.key)
            return whole
        started = time.perf_counter()
        fixed = step.to(self.device)
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):  # warm-up: the step's own cache writes, which the replay makes again
                self._whole(step.rows, fixed)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                hidden = self._whole(step.rows, fixed)
        except Exception as exc:  # the segments still serve these steps
            current.wait_stream(side)
            self.whole_off = f"{type(exc).__name__}: {exc}"
            log.warning("kt_use_cuda_graph: a whole V4 decode step could not be captured (%s); decode steps run "
                        "as segments with their cached attention eager", self.whole_off)
            return None
        whole = self.whole[step.key] = _WholeStep(graph, fixed, hidden)
        while len(self.whole) > WHOLE_GRAPHS:
            self.whole.popitem(last=False)
        seconds = time.perf_counter() - started
        self.whole_captures += 1
        self.whole_capture_s += seconds
        log.info("kt_use_cuda_graph: captured a whole V4 decode step of %d rows, page widths %s, in %.0f ms",
                 step.rows, dict(step.key[1]), seconds * 1e3)
        return whole

    def _segment(self, k: int, rows: int, previous: dict[str, Any] | None) -> dict[str, Any]:
        """Segment `k` over the first `rows` rows of the buffers, after segment k-1 gave `previous`."""
        b, ids = self.batch, self.ids[:, :rows]
        if k == 0:
            embeds, rope = b.embed(ids, self.positions[:, :rows])
            out = {"embeds": embeds, "rope": rope, "hidden": b.streams(embeds)}
        else:
            rope, before = previous["rope"], previous["before"]
            hidden = b.after_attention(self.layers[k - 1], previous["hidden"], before, self.attended[:, :rows],
                                       rope, ids)
            out = {"rope": rope, "hidden": hidden}
        if k < len(self.layers):
            out["before"] = q = b.before_attention(self.layers[k], out["hidden"], out["rope"])
            if self.attended is None:
                self.attended = q.q.new_zeros(1, self.buckets[-1], q.q.shape[1], q.q.shape[3])
        return out

    def _eagerly(self, k: int, rows: int, previous: dict[str, Any] | None) -> dict[str, Any]:
        """Segment `k` run eagerly, its outputs left in the same tensors every step (as a replayed graph leaves
        them), so what keeps them past the step is seen to copy them."""
        out = self._segment(k, rows, previous)
        kept = self.outputs.setdefault(rows, [])
        if len(kept) == k:
            kept.append(out)
        return _copied_into(kept[k], out)

    def capture(self) -> None:
        """Capture every segment of every bucket, largest bucket first (the smaller ones reuse its memory)."""
        started = time.perf_counter()
        with torch.inference_mode(), torch.cuda.device(self.device), self.batch.lora.step(AdapterRows.uniform(None)):
            for rows in reversed(self.buckets):
                self.graphs[rows], self.outputs[rows] = self._capture(rows)
        self.captured = True
        log.info("kt_use_cuda_graph: captured %d V4 step segments x %d row buckets (%s) in %.1fs; each "
                 "sequence's cached attention runs between them", len(self.layers) + 1, len(self.buckets),
                 ",".join(map(str, self.buckets)), time.perf_counter() - started)
        self._capture_short_decode_steps()

    def _capture_short_decode_steps(self) -> None:
        """The whole decode steps of sequences within one page per rate (up to PAGE x the smallest rate
        positions), every bucket, and of one sequence at every page width it takes on its way to the longest
        context, captured now over pools sized to the cache budget, so that requests do not wait for those
        captures (~60 ms each at 4 of V4-Flash's layers); other keys are captured at their first step."""
        paged = self.batch.paged
        if paged is None or paged.sized_for is None or self.attended is None:
            return  # pools without a budget are made at the first sequence's size: their steps wait for it
        if paged.dtype is None:
            paged.prepare(self.attended.dtype)
        started = time.perf_counter()
        with (torch.inference_mode(), torch.cuda.device(self.device), device_scope(self.device),
              self.batch.lora.step(AdapterRows.uniform(None))):
            for rows in reversed(self.buckets):
                if self._whole_graph(paged.blank_step(rows)) is None:
                    return
            longest = min(self.longest or paged.sized_for[1], paged.sized_for[1])
            wider = paged.widths_up_to(longest)[1:WHOLE_GRAPHS - len(self.buckets) + 1]
            for pages in wider:  # one sequence's steps, as its context grows
                if self._whole_graph(paged.blank_step(self.buckets[0], pages)) is None:
                    return
        log.info("kt_use_cuda_graph: captured whole V4 decode steps of one page per rate x %d row buckets and of "
                 "one sequence at %d wider page widths in %.1fs", len(self.buckets), len(wider),
                 time.perf_counter() - started)

    def _capture(self, rows: int) -> tuple[list[torch.cuda.CUDAGraph], list[dict[str, Any]]]:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisation (the experts' pinned buffers) must not happen in capture
                out = None
                for k in range(len(self.layers) + 1):
                    out = self._segment(k, rows, out)
        current.wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graphs, outputs, out = [], [], None
        for k in range(len(self.layers) + 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._segment(k, rows, out)
            graphs.append(graph)
            outputs.append(out)  # the next segment's inputs: kept alive, so no later capture reuses them
        return graphs, outputs

    def describe(self) -> str:
        return (f"piecewise: rows {','.join(map(str, self.buckets))}; decode steps over the paged caches whole "
                f"(attention included, a graph per rows and page widths: one page per rate and one sequence's "
                f"every width captured at load, other keys at first use), other steps' "
                f"cached attention eager")


def _copied_into(kept: Any, new: Any) -> Any:
    """`kept` (tensors in dicts and tuples) with `new`'s values copied into its tensors."""
    if isinstance(new, torch.Tensor):
        if kept is not new:
            kept.copy_(new)
        return kept
    if isinstance(new, dict):
        return {key: _copied_into(kept[key], value) for key, value in new.items()}
    parts = [_copied_into(a, b) for a, b in zip(kept, new)]
    return type(new)(*parts) if hasattr(new, "_fields") else tuple(parts)


def step_graphs(model: Any, batch: V4Batch, max_rows: int, longest: int | None = None
                ) -> tuple[V4StepGraphs | None, str]:
    """The captured segments of V4 steps of up to `max_rows` rows (and whole decode steps of one sequence up to
    `longest` positions), or None and why not (what the engine details then say)."""
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    held = {m for e in experts for m in e.modules()}
    devices = {t.device for m in model.modules() if m not in held
               for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]}
    why = None
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        why = f"the non-expert model is not on one GPU (it is on {', '.join(sorted(map(str, devices)))})"
    elif not all(hasattr(m.mlp.experts, "submit") for m in batch.layers):
        why = "routed experts run in torch, whose dispatch waits on the host"
    elif any(e.gpu_experts for e in experts):
        why = "the rules keep hot experts on the GPU (gpu_experts), whose torch part is not captured"
    elif any(getattr(e, "method", None) == "LLAMAFILE" for e in experts):
        why = "the experts run as LLAMAFILE, whose calls wait on the host instead of queuing on the stream"
    if why is not None:
        log.info("kt_use_cuda_graph: V4 steps run without CUDA graphs, because %s", why)
        return None, f"none: {why}"
    graphs = V4StepGraphs(batch, max_rows, next(iter(devices)), longest)
    graphs.capture()
    return graphs, graphs.describe()
