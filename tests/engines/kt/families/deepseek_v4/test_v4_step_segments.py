"""DeepSeek-V4 steps in row-wise segments (engines/kt/families/deepseek_v4/graphs.py: what the CUDA graphs capture),
run here eagerly on the CPU over the padded fixed buffers, each segment's outputs left in the same tensors every
step as a replayed graph leaves them: a step padded to its bucket of rows gives each sequence the logits the eager
step gives it (also a verified draft's cache taken back after the bucket's buffers were refilled), and steps that
do not fit the buckets (or carry an adapter) run eagerly."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import require_kt_kernel
from .v4_helpers import feeding_plan, load_v4_runner, max_next_token_diff, runner_sequence, stepped_logprobs

require_kt_kernel()

LENGTHS = [24, 18, 12]
# Segmented and padded vs the eager step, next-token logprobs of the float32 demo: padding changes the rows the
# float32 GEMMs and kt-kernel see (3 -> 4, 6 -> 8), which rounds differently now and then by one bf16 step of an
# expert input. Measured: 1.6e-4 for both tests on the avx512_bf16 build; 1.6e-4 and 1.5e-3 on the avx2 build (a
# sequence fed another's rows or cache is off by whole units; the batched steps' own bound is 0.05).
SEGMENTED_TOLERANCE = 0.02


@pytest.fixture(scope="module")
def runner(v4_model_dir):
    return load_v4_runner(v4_model_dir, max_concurrent=len(LENGTHS))


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(100, 120000, (n,), generator=generator).tolist() for n in LENGTHS]


class CountingSegments:
    """graphs.py's V4StepGraphs, not captured (its segments run eagerly), counting the steps it served."""

    def __init__(self, runner, max_rows: int):
        from engines.kt.families.deepseek_v4.graphs import V4StepGraphs

        self.inner = V4StepGraphs(runner.batch, max_rows, torch.device("cpu"))
        self.served: list[int] = []

    def fits(self, pieces) -> bool:
        return self.inner.fits(pieces)

    def hidden_streams(self, pieces):
        self.served.append(sum(p.end - p.start for p in pieces))
        return self.inner.hidden_streams(pieces)


def segmented_vs_eager(runner, prompts, plans, starts, max_rows: int) -> tuple[float, list[int]]:
    """The largest |segmented - eager| next-token logprob over the prompts fed by `plans`, and the rows of each
    step the segments served."""
    eager = stepped_logprobs(runner, [runner_sequence(p) for p in prompts], plans, starts)
    segments = CountingSegments(runner, max_rows)
    runner.graphs = segments
    try:
        segmented = stepped_logprobs(runner, [runner_sequence(p) for p in prompts], plans, starts)
    finally:
        runner.graphs = None
    diff = max(max_next_token_diff(s, e, p) for s, e, p in zip(segmented, eager, prompts))
    print(f"\nsegmented vs eager: max |dlogprob| {diff:.2e}, rows served {segments.served}, "
          f"decode steps whole {segments.inner.whole_steps}")
    return diff, segments.served


def test_three_sequences_decoding_together_padded_to_four_rows_get_the_eager_logits(runner, prompts):
    plans = [feeding_plan(n, [n - 4]) for n in LENGTHS]  # a prompt chunk each (eager: too many rows), then 4 decodes
    diff, served = segmented_vs_eager(runner, prompts, plans, [0, 0, 0], max_rows=4)
    assert served == [3, 3, 3, 3]
    assert diff < SEGMENTED_TOLERANCE


def test_a_decode_row_and_a_prompt_chunk_in_one_padded_step_get_the_eager_logits(runner, prompts):
    short = [prompts[0][:14], prompts[1][:8]]
    plans = [feeding_plan(14, [9]), [5, 3]]  # step 1: the first one's decode row beside the second's 5-row chunk
    diff, served = segmented_vs_eager(runner, short, plans, [0, 1], max_rows=8)
    assert served[:2] == [6, 4]
    assert diff < SEGMENTED_TOLERANCE


def test_a_step_with_an_adapter_or_past_the_buckets_runs_eagerly(runner, prompts):
    from engines.kt.families.deepseek_v4.batch import Piece
    from engines.kt.families.deepseek_v4.graphs import V4StepGraphs

    segments = V4StepGraphs(runner.batch, 4, torch.device("cpu"))
    assert segments.buckets == [1, 2, 4]
    plain = [Piece(prompts[0], 0, 3, None, None), Piece(prompts[1], 0, 1, None, None)]
    assert segments.fits(plain)
    assert not segments.fits(plain + [Piece(prompts[2], 0, 1, None, None)])
    assert not segments.fits([Piece(prompts[0], 0, 1, None, "an-adapter")])


def test_a_model_not_on_one_gpu_captures_no_graphs_and_says_why(runner):
    from engines.kt.families.deepseek_v4.graphs import step_graphs

    graphs, described = step_graphs(runner.model, runner.batch, 4)
    assert graphs is None
    assert described == "none: the non-expert model is not on one GPU (it is on cpu)"


def test_a_verified_draft_taken_back_after_another_step_of_its_bucket_gets_the_eager_logits(runner, prompts):
    """A drafted check records what it put into the cache; the cache goes back to the accepted length at the
    sequence's next step, after another sequence's step has refilled the bucket's buffers."""
    from engines.runtime.model_runner import ScheduledChunk

    a_ids, b_ids = prompts[0][:19], prompts[1][:8]

    def run() -> torch.Tensor:
        a, b = runner_sequence(a_ids[:16]), runner_sequence(b_ids[:4])
        runner.execute([ScheduledChunk(seq=a, start=0, end=16), ScheduledChunk(seq=b, start=0, end=3)])
        a.token_ids = a_ids[:17]
        runner.execute([ScheduledChunk(seq=a, start=16, end=17, draft=tuple(a_ids[17:19])),
                        ScheduledChunk(seq=b, start=3, end=4)])  # 3 + 1 rows
        b.token_ids = b_ids[:7]
        runner.execute([ScheduledChunk(seq=b, start=4, end=7)])  # 3 rows: the same bucket of 4
        a.token_ids = a_ids[:19]  # the first drafted token accepted, the second not: back to 18 positions
        return runner.execute([ScheduledChunk(seq=a, start=18, end=19, all_logits=True)])[0].float()

    eager = run()
    runner.graphs = CountingSegments(runner, 4)
    try:
        segmented = run()
        served = runner.graphs.served
    finally:
        runner.graphs = None
    assert served == [4, 3, 1]
    diff = float((torch.log_softmax(segmented, -1) - torch.log_softmax(eager, -1)).abs().max())
    print(f"\ndrafted check taken back: max |dlogprob| {diff:.2e}")
    assert diff < SEGMENTED_TOLERANCE
