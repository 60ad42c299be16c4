"""Whether drafting pays (engines/runtime/draft_gate.py), from made-up step times: the gate drafts while drafted
decode steps give at least as many tokens a second as plain ones, pauses when they give fewer, and drafts again
after the pause to see whether that changed."""
from __future__ import annotations

import logging

from engines.runtime.draft_gate import MEASURE, MIN_DRAFTED, PAUSE, DraftGate

PLAIN_S = 0.016  # a plain decode step
SLOW_S = 0.045  # a drafted step where checking the draft costs more than it saves
FAST_S = 0.020  # one where it pays


def run(gate: DraftGate, steps: int, drafted_s: float, accepted: float, plain_s: float = PLAIN_S) -> list[bool]:
    """Decode steps of one sequence, each run as the gate chooses; whether each drafted. `accepted`: the share of
    drafted steps whose draft is kept, spread evenly over them."""
    drafted: list[bool] = []
    for _ in range(steps):
        drafted.append(gate.drafting)
        if gate.drafting:
            n = drafted.count(True)
            gate.record(drafted_s, 1, 1, int(n * accepted) - int((n - 1) * accepted))
        else:
            gate.record(plain_s, 1, 0, 0)
    return drafted


def test_drafting_pauses_when_drafted_steps_are_slow_and_rarely_accepted(caplog):
    gate = DraftGate()
    with caplog.at_level(logging.INFO, logger="ktserve.engine"):
        drafted = run(gate, MIN_DRAFTED + MEASURE + 50, SLOW_S, 0.25)
    # it drafts until it has the evidence, times plain steps, then stops drafting
    assert drafted[:MIN_DRAFTED] == [True] * MIN_DRAFTED
    assert drafted[MIN_DRAFTED:] == [False] * (MEASURE + 50)
    assert gate.paused and gate.paused_steps == MEASURE + 50
    paused = [r.getMessage() for r in caplog.records if "paused" in r.getMessage()]
    assert len(paused) == 1
    assert "give 27.8 tokens/s per sequence, plain steps 62.5 (25% of draft tokens accepted)" in paused[0]


def test_drafting_goes_on_when_drafted_steps_pay():
    gate = DraftGate()
    drafted = run(gate, 400, FAST_S, 0.9)  # 1.9 tokens in 20 ms against 1 in 16 ms
    assert not gate.paused and gate.drafting
    # only the plain steps that time what it is compared against went without drafts: at the start, and again
    # after a few hundred drafted steps
    assert drafted.count(False) == 2 * MEASURE


def test_a_pause_ends_with_drafts_again_and_drafting_resumes_when_it_pays_then(caplog):
    gate = DraftGate()
    run(gate, MIN_DRAFTED + MEASURE, SLOW_S, 0.0)
    assert gate.paused
    assert run(gate, PAUSE, SLOW_S, 0.0) == [False] * PAUSE
    with caplog.at_level(logging.INFO, logger="ktserve.engine"):
        probe = run(gate, MIN_DRAFTED + 20, FAST_S, 0.9)  # the text got easier
    assert probe == [True] * (MIN_DRAFTED + 20)
    assert not gate.paused
    assert sum("resumed" in r.getMessage() for r in caplog.records) == 1


def test_a_probe_that_still_does_not_pay_pauses_again_without_logging_again(caplog):
    gate = DraftGate()
    with caplog.at_level(logging.INFO, logger="ktserve.engine"):
        drafted = run(gate, MIN_DRAFTED + MEASURE + PAUSE + MIN_DRAFTED + 10, SLOW_S, 0.0)
    assert drafted[MIN_DRAFTED + MEASURE + PAUSE:] == [True] * MIN_DRAFTED + [False] * 10
    assert gate.paused
    assert sum("paused" in r.getMessage() for r in caplog.records) == 1


def test_drafts_proposed_before_the_gate_closed_count_as_neither_kind_of_step():
    gate = DraftGate()
    run(gate, MIN_DRAFTED, SLOW_S, 0.0)
    assert not gate.drafting
    gate.record(SLOW_S, 1, 1, 0)  # a draft the head proposed after the step that closed the gate
    assert gate.paused_steps == 0 and not gate.drafting


def test_with_speculative_adaptive_off_there_is_no_gate_to_hold_drafts_back():
    """`--no-speculative-adaptive`: no gate, so step times never hold drafts back (the behaviour before the gate)."""
    from types import SimpleNamespace

    from engines.runtime.speculative import SpeculativeOptions, Speculator

    runner = SimpleNamespace(drafts=True, draft_max_batch=None)  # a runner that drafts, as far as the gate goes
    speculator = Speculator(runner, SpeculativeOptions(speculative="mtp", speculative_adaptive=False))
    assert speculator.gate is None and speculator.gate_open
