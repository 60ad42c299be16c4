"""Whether drafting pays (`speculative_adaptive`): speculative decoding pauses itself while its decode steps give
fewer tokens a second than plain ones.

A drafted step checks more positions and runs the draft head after it, so it takes longer than a plain step; it
pays only while the tokens it keeps make up for that. Where the step's cost is the CPU's routed experts (read once
more for each checked position) it can cost more than it saves at any acceptance. The gate compares, per decoding
sequence, the rate of the last drafted decode steps — tokens they emitted over their wall time, the draft head's
run after each included — with the rate of the last plain decode steps (one token each over their time):

- it starts drafting; once drafted steps have verified `MIN_DRAFTED` draft tokens and no plain step has been
  timed lately (at the start, and every `REMEASURE` drafted steps, since step times change with the context and
  the batch), it times `MEASURE` plain steps;
- then it decides: drafting goes on while its rate is at least the plain rate, and pauses (logged with the figures)
  when it is below; while drafting it decides again after every drafted step, over the window;
- while paused, after `PAUSE` plain steps it drafts again with a fresh window (a probe), so an easier text or a
  smaller batch is picked up; the probe's evidence resumes drafting (logged) or pauses it again.

Only decode steps count (every chunk one token of a sequence, no more sequences than may draft); steps are counted,
not seconds, so what the gate does depends on the step times only through the comparison. While the gate holds
drafting back (measuring or paused) the draft head sits the steps out, so such a step is a plain one (on the
V4-Flash shape the MTP block is most of a plain step's time again); the first drafts after it see a head cache
without the positions decoded meanwhile (V4's head starts its cache afresh; V3's attends over what its layer of
the KV cache holds there, as after steps of more sequences than `ModelRunner.draft_max_batch`), so a probe may
undervalue drafting a little. Outputs never depend on it: a step without drafts emits the tokens a drafted one would
(engines/runtime/speculative.py)."""
from __future__ import annotations

import logging
from collections import deque

log = logging.getLogger("ktserve.engine")

MIN_DRAFTED = 32  # draft tokens verified before drafted steps' rate is trusted
MEASURE = 8  # plain steps timed to compare against
REMEASURE = 256  # drafted steps after which the plain steps are timed again
PAUSE = 256  # plain steps a pause lasts before drafting is tried again
WINDOW = 64  # steps of each kind the rates are taken over


class DraftGate:
    """The engine thread's record of decode steps, and from it whether the next steps draft."""

    def __init__(self) -> None:
        self.drafting = True  # the next decode steps draft (False: measuring plain steps, or paused)
        self.paused = False  # drafting is paused because it did not pay (not merely measuring)
        self.paused_steps = 0  # decode steps run without drafts while paused or measuring
        self._drafted: deque[tuple[int, int, int, float]] = deque(maxlen=WINDOW)  # (sequences, drafts, kept, s)
        self._plain: deque[float] = deque(maxlen=WINDOW)  # seconds
        self._measuring = False  # the plain steps now run to be timed (else, while not drafting: paused)
        self._left = 0  # plain steps left to measure or to stay paused
        self._since_measured = 0  # drafted steps since plain steps were last timed

    def record(self, seconds: float, sequences: int, drafted: int, accepted: int) -> None:
        """A decode step of `sequences` sequences took `seconds`, with `drafted` draft tokens fed (0: a plain
        step) of which `accepted` were kept."""
        if drafted:
            if self.drafting:  # (else drafts proposed before the gate closed: neither kind of step)
                self._drafted_step(seconds, sequences, drafted, accepted)
        elif not self.drafting:  # (else a drafting step without drafts, as the first after the gate opens)
            self._plain_step(seconds)

    def _drafted_step(self, seconds: float, sequences: int, drafted: int, accepted: int) -> None:
        self._drafted.append((sequences, drafted, accepted, seconds))
        self._since_measured += 1
        if sum(d for _, d, _, _ in self._drafted) < MIN_DRAFTED:
            return
        if len(self._plain) < MEASURE or self._since_measured >= REMEASURE:
            self._plain.clear()
            self._measuring, self.drafting, self._left = True, False, MEASURE
        else:
            self._decide()

    def _plain_step(self, seconds: float) -> None:
        self._plain.append(seconds)
        self.paused_steps += 1
        self._left -= 1
        if self._left > 0:
            return
        self.drafting, self._since_measured = True, 0
        if self._measuring:
            self._measuring = False
            self._decide()
        else:  # the pause is over: draft again, judged on fresh drafted steps (a probe)
            self._drafted.clear()
            log.debug("speculative decoding: drafting again for a while to see whether it pays now")

    def rates(self) -> tuple[float, float, float]:
        """Tokens a second per sequence with drafts and without, and the share of draft tokens kept, over the
        windows (a drafted step emits its sequences' accepted draft tokens and one token more each)."""
        tokens = sum((n + kept) / n for n, _, kept, _ in self._drafted)
        seconds = sum(s for _, _, _, s in self._drafted)
        drafts = sum(d for _, d, _, _ in self._drafted)
        kept = sum(k for _, _, k, _ in self._drafted)
        plain = sum(self._plain)
        return (tokens / seconds if seconds > 0 else float("inf"),
                len(self._plain) / plain if plain > 0 else float("inf"), kept / drafts if drafts else 0.0)

    def _decide(self) -> None:
        with_drafts, plain, accepted = self.rates()
        if with_drafts >= plain:
            if self.paused:
                self.paused = False
                log.info("speculative decoding resumed: drafted steps give %.1f tokens/s per sequence, plain steps "
                         "%.1f (%.0f%% of draft tokens accepted)", with_drafts, plain, 100 * accepted)
            return
        if not self.paused:
            log.info("speculative decoding paused: drafted steps give %.1f tokens/s per sequence, plain steps %.1f "
                     "(%.0f%% of draft tokens accepted); drafting again for a while after %d plain steps",
                     with_drafts, plain, 100 * accepted, PAUSE)
        self.paused, self.drafting, self._left = True, False, PAUSE
