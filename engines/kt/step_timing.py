"""Where a KT model step's time goes: GPU work, CPU experts, and the stalls between them.

On a GPU the experts run stream-ordered (engines/kt/experts/cpu.py): Python never blocks on them, the GPU
stream does, inside kt-kernel's stream wait. So the wait is measured where it happens, with CUDA events on
that stream (they also work inside captured CUDA graphs: `external=True` makes them event-record nodes):

    submitted  recorded just before the stream starts the layer's CPU experts
    waiting    recorded just before the stream's wait for them (the shared experts ran in between)
    done       recorded just after that wait returns

Per step and summed over layers: `expert_wait` = waiting -> done (the GPU stream idles on the CPU experts),
`expert` = submitted -> done (CPU expert time seen by the step: exact whenever the stream had to wait, an
upper bound when the shared experts took longer). Two more events bracket the whole step on the stream:
`gpu` = that span minus `expert_wait` (GPU compute, plus launch gaps when the step is not a CUDA graph).

Without a GPU the experts block Python in `sync()`, timed with perf_counter: the same two figures, `gpu` 0.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields

import torch

log = logging.getLogger("ktserve.engine.kt")


@dataclass(slots=True)
class StepTimes:
    """Cumulative seconds, as EngineStats carries them."""

    expert_wait: float = 0.0
    expert: float = 0.0
    gpu: float = 0.0

    def add(self, other: "StepTimes") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def timing_event() -> "torch.cuda.Event | None":
    try:
        return torch.cuda.Event(enable_timing=True, external=True)
    except TypeError:  # a torch without external events cannot time inside CUDA graphs
        return None


class ExpertEvents:
    """The three events of one layer's stream-ordered expert call (see the module docstring)."""

    __slots__ = ("submitted", "waiting", "done", "recorded", "captured")

    def __init__(self) -> None:
        self.submitted, self.waiting, self.done = timing_event(), timing_event(), timing_event()
        self.recorded = False  # recorded eagerly in the current step
        self.captured = False  # captured into the decode graphs: every replay records them

    def record(self, name: str, stream: "torch.cuda.Stream") -> None:
        getattr(self, name).record(stream)
        if name == "done":
            if torch.cuda.is_current_stream_capturing():
                self.captured = True
            else:
                self.recorded = True

    def seconds(self) -> tuple[float, float]:
        """(stall, span) of the last recording, in seconds; the events must be complete."""
        return self.waiting.elapsed_time(self.done) / 1e3, self.submitted.elapsed_time(self.done) / 1e3


class HostTimes:
    """Blocking (not stream-ordered) expert calls, timed on the host: the sync, and submit -> sync returned."""

    __slots__ = ("submitted_at", "wait", "span")

    def __init__(self) -> None:
        self.submitted_at = 0.0
        self.wait = 0.0
        self.span = 0.0

    def synced(self, wait_started: float) -> None:
        now = time.perf_counter()
        self.wait += now - wait_started
        self.span += now - self.submitted_at

    def take(self) -> tuple[float, float]:
        out, self.wait, self.span = (self.wait, self.span), 0.0, 0.0
        return out


class StepTimer:
    """Brackets each model step and adds the experts' figures up into `totals` (read by EngineStats).

    Timing never fails a step: if reading the events fails, GPU timing is switched off with a warning."""

    def __init__(self, experts: list, device: torch.device):
        self.experts = experts  # engines.kt.experts.protocol.RoutedExperts: `.host_times`, `.events`
        self.totals = StepTimes()
        self.device = device
        self.cuda = device.type == "cuda" and timing_event() is not None
        self._start = self._end = None
        if self.cuda:
            self._start, self._end = timing_event(), timing_event()
            for e in experts:
                e.events = ExpertEvents()

    def begin(self) -> None:
        for e in self.experts:
            e.host_times.take()  # calls outside model steps (scoring prompts) are not a step's time
        if self.cuda:
            for e in self.experts:
                e.events.recorded = False
            self._start.record(torch.cuda.current_stream(self.device))

    def end(self, replayed: bool) -> None:
        """Call once the step's results reached the host; `replayed`: the step was a CUDA graph replay."""
        step = StepTimes()
        for e in self.experts:
            wait, span = e.host_times.take()
            step.expert_wait += wait
            step.expert += span
        if self.cuda:
            try:
                self._end.record(torch.cuda.current_stream(self.device))
                self._end.synchronize()
                stall = 0.0
                for e in self.experts:
                    ev = e.events
                    if ev.captured if replayed else ev.recorded:
                        wait, span = ev.seconds()
                        stall += wait
                        step.expert += span
                step.expert_wait += stall
                # blocking expert calls (chunks too big for the stream path) idle the stream as well
                step.gpu = max(0.0, self._start.elapsed_time(self._end) / 1e3 - step.expert_wait)
            except RuntimeError as exc:
                self.stop_gpu_timing(f"reading the CUDA timing events failed ({exc})")
        self.totals.add(step)

    def stop_gpu_timing(self, why: str) -> None:
        log.warning("%s; GPU time and the stalls on CPU experts are no longer measured", why)
        self.cuda = False
        for e in self.experts:
            e.events = None
