"""The scheduler's KV admission by use: requests start with the room their tokens fill, grow step by step,
and when the cache is full the newest running one is preempted to the front of the queue, keeping its tokens,
and later recomputes them. A runner with a page count stands in for the model."""
from __future__ import annotations

from engines.base import GenerationRequest, SamplingParams
from engines.runtime.model_runner import ModelRunner
from engines.runtime.scheduler import Scheduler
from engines.runtime.sequence import Sequence

PAGE = 4


class PagedRunner(ModelRunner):
    """`pages` pages of PAGE positions, given by use as the KT runner gives them; no model."""

    max_model_len = 1024

    def __init__(self, pages: int):
        self.free = pages
        self.held: dict[str, int] = {}

    def admit(self, seq: Sequence) -> int | None:
        return 0 if self.grow(seq, len(seq)) else None

    def grow(self, seq: Sequence, num_positions: int) -> bool:
        need = -(-num_positions // PAGE) - self.held.get(seq.id, 0)
        if need > self.free:
            return False
        self.free -= max(need, 0)
        self.held[seq.id] = self.held.get(seq.id, 0) + max(need, 0)
        return True

    def release(self, seq: Sequence) -> None:
        self.free += self.held.pop(seq.id, 0)

    def execute(self, chunks):
        raise NotImplementedError


def sequence(name: str, prompt_tokens: int, max_tokens: int = 1000) -> Sequence:
    request = GenerationRequest(list(range(1, prompt_tokens + 1)), SamplingParams(max_tokens=max_tokens),
                                request_id=name)
    return Sequence.create(request, None, None)  # type: ignore[arg-type]


def step(scheduler: Scheduler) -> dict[str, tuple[int, int]]:
    """Schedule, then account for the step as the engine does (each sampling chunk yields token 9)."""
    chunks = scheduler.schedule()
    for chunk in chunks:
        chunk.seq.num_computed = chunk.end
        if chunk.samples:
            chunk.seq.token_ids.append(9)
    return {c.seq.id: (c.start, c.end) for c in chunks}


def test_requests_start_with_the_room_their_prompt_fills_not_their_max_tokens():
    scheduler = Scheduler(PagedRunner(pages=3), max_running=8, max_queue=8, chunk_size=64)
    for name in "abc":
        scheduler.add(sequence(name, PAGE, max_tokens=1000))  # reserving max_tokens, none would fit
    assert step(scheduler) == {"a": (0, 4), "b": (0, 4), "c": (0, 4)}


def test_a_full_cache_preempts_the_newest_running_request_to_the_front_of_the_queue():
    runner = PagedRunner(pages=4)
    scheduler = Scheduler(runner, max_running=8, max_queue=8, chunk_size=64)
    a, b, c, d = (sequence(name, PAGE) for name in "abcd")
    for seq in (a, b, c):
        scheduler.add(seq)
    step(scheduler)  # three prompts, a page each; each samples its first token
    scheduler.add(d)
    # a and b each need a second page for their next position; only one is free: c (the newest) goes back,
    # and nothing is admitted in that step
    assert step(scheduler) == {"a": (4, 5), "b": (4, 5)}
    assert scheduler.preemptions == 1
    assert list(scheduler.waiting) == [c, d]
    assert c.num_computed == 0 and c.token_ids == [1, 2, 3, 4, 9]  # what it generated stays


def test_a_preempted_request_is_readmitted_first_and_recomputes_all_its_tokens_in_one_chunk():
    runner = PagedRunner(pages=4)
    scheduler = Scheduler(runner, max_running=8, max_queue=8, chunk_size=64)
    a, b, c = (sequence(name, PAGE) for name in "abc")
    for seq in (a, b, c):
        scheduler.add(seq)
    step(scheduler)
    step(scheduler)  # c preempted
    scheduler.remove(a)
    runner.release(a)
    assert step(scheduler) == {"b": (5, 6), "c": (0, 5)}  # its last chunk ends at its end: it samples next
    assert scheduler.prompt_tokens == 3 * PAGE  # its prompt was counted when it first started, not again


def test_a_recomputed_prompt_does_not_ask_again_for_the_prompt_logprobs_it_has():
    scheduler = Scheduler(PagedRunner(pages=8), max_running=8, max_queue=8, chunk_size=64)
    seq = sequence("a", PAGE)
    seq.prompt_logprobs = [None] * PAGE  # every prompt position has its entry: computed before a preemption
    seq.token_ids.append(9)
    scheduler.add(seq)
    (chunk,) = scheduler.schedule()
    assert (chunk.start, chunk.end, chunk.all_logits) == (0, PAGE + 1, False)


def test_a_batch_invariant_prompt_is_cut_every_chunk_size_whatever_its_neighbours_leave_of_the_budget():
    scheduler = Scheduler(PagedRunner(pages=100), max_running=8, max_queue=8, chunk_size=16)
    other, invariant = sequence("other", 10), sequence("invariant", 40)
    invariant.batch_invariant = True
    scheduler.add(other)
    scheduler.add(invariant)
    # the neighbour takes 10 of the 16 tokens: the invariant prompt's first chunk (16) does not fit the 6 left,
    # so it waits rather than be cut at 6
    assert step(scheduler) == {"other": (0, 10)}
    assert step(scheduler) == {"other": (10, 11), "invariant": (0, 16)}
    assert step(scheduler) == {"other": (11, 12), "invariant": (16, 32)}
    assert step(scheduler) == {"other": (12, 13), "invariant": (32, 40)}
