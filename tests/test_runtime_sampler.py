"""Sampling rules on hand-made logits."""
from __future__ import annotations

import pytest
import torch

from engines.base import GenerationRequest, RequestHandle, SamplingParams
from engines.runtime.detokenizer import IncrementalDetokenizer
from engines.runtime.sampler import Sampler
from engines.runtime.sequence import Sequence

VOCAB = 50


def seq_for(tokenizer, output=(), **params):
    req = GenerationRequest(prompt_token_ids=[3, 4], sampling=SamplingParams(**params))
    handle = RequestHandle(req.request_id, loop=None, on_cancel=lambda _: None)  # type: ignore[arg-type]
    seq = Sequence.create(req, handle, IncrementalDetokenizer(tokenizer))
    seq.token_ids += list(output)
    return seq


def logits_with(best: int, runner_up: int) -> torch.Tensor:
    logits = torch.zeros(VOCAB)
    logits[best], logits[runner_up] = 5.0, 4.0
    return logits


@pytest.fixture
def sampler(tokenizer):
    return Sampler(tokenizer, eos_token_ids=(1,))


def test_greedy_takes_the_argmax(sampler, tokenizer):
    token, _ = sampler.sample(logits_with(7, 9), seq_for(tokenizer, temperature=0))
    assert token == 7


def test_frequency_penalty_moves_away_from_repeated_tokens(sampler, tokenizer):
    seq = seq_for(tokenizer, output=[7, 7], temperature=0, frequency_penalty=1.0)
    assert sampler.sample(logits_with(7, 9), seq)[0] == 9


def test_presence_penalty_counts_each_token_once(sampler, tokenizer):
    seq = seq_for(tokenizer, output=[7, 7, 7], temperature=0, presence_penalty=0.5)
    assert sampler.sample(logits_with(7, 9), seq)[0] == 7


def test_repetition_penalty_covers_the_prompt(sampler, tokenizer):
    seq = seq_for(tokenizer, temperature=0, repetition_penalty=2.0)
    assert sampler.sample(logits_with(3, 9), seq)[0] == 9


def test_logit_bias_can_force_a_token(sampler, tokenizer):
    seq = seq_for(tokenizer, temperature=0, logit_bias={11: 100.0})
    assert sampler.sample(logits_with(7, 9), seq)[0] == 11


def test_min_tokens_blocks_eos(sampler, tokenizer):
    seq = seq_for(tokenizer, temperature=0, min_tokens=2)
    assert sampler.sample(logits_with(1, 9), seq)[0] == 9


def test_top_k_one_sampling_is_greedy(sampler, tokenizer):
    tokens = {sampler.sample(logits_with(7, 9), seq_for(tokenizer, temperature=1.5, top_k=1, seed=s))[0]
              for s in range(20)}
    assert tokens == {7}


def test_top_p_keeps_only_the_nucleus(sampler, tokenizer):
    logits = torch.full((VOCAB,), -20.0)
    logits[7], logits[9], logits[11] = 3.0, 2.9, -1.0
    tokens = {sampler.sample(logits.clone(), seq_for(tokenizer, temperature=1.0, top_p=0.9, seed=s))[0]
              for s in range(40)}
    assert tokens == {7, 9}


def test_same_seed_same_choice(sampler, tokenizer):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    picks = [sampler.sample(logits.clone(), seq_for(tokenizer, temperature=1.0, seed=42))[0] for _ in range(3)]
    assert len(set(picks)) == 1


def test_logprobs_are_the_models_own_distribution(sampler, tokenizer):
    logits = logits_with(7, 9)
    seq = seq_for(tokenizer, temperature=0, frequency_penalty=2.0, logprobs=2, output=[7])
    token, entry = sampler.sample(logits.clone(), seq)
    expected = torch.log_softmax(logits, dim=-1)
    assert token == 9
    assert entry.logprob == pytest.approx(float(expected[9]))
    assert [t.token_id for t in entry.top] == [7, 9]


def test_a_subnormal_temperature_is_greedy_not_an_error(sampler, tokenizer):
    assert sampler.sample(logits_with(7, 9), seq_for(tokenizer, temperature=5e-324))[0] == 7


def test_a_distribution_with_nothing_left_falls_back_to_the_best_token(sampler, tokenizer):
    logits = torch.full((VOCAB,), float("-inf"))
    logits[3] = 0.0
    seq = seq_for(tokenizer, temperature=1.0, logit_bias={3: -100.0}, repetition_penalty=10.0)
    assert sampler.sample(logits, seq)[0] == 3


def _mixed_step(tokenizer, vocab: int) -> tuple[list[torch.Tensor], list]:
    """A step of 12 rows at a real vocabulary size: plain greedy, plain temperature (seeded and not), and
    rows that need the one-at-a-time path (penalties, logprobs, top_p, min_tokens)."""
    gen = torch.Generator().manual_seed(7)
    rows = [torch.randn(vocab, generator=gen) * 3 for _ in range(12)]
    params = [dict(temperature=0), dict(temperature=0.7, seed=1), dict(temperature=1.3), dict(temperature=0),
              dict(temperature=0.7, seed=2), dict(temperature=0, frequency_penalty=0.5), dict(temperature=1.0),
              dict(temperature=0.9, logprobs=2), dict(temperature=0.8, top_p=0.9, seed=3),
              dict(temperature=0, min_tokens=5), dict(temperature=2.0, seed=4), dict(temperature=0, top_k=1)]
    return rows, [seq_for(tokenizer, output=[5, 6], **p) for p in params]


def test_batched_sampling_picks_what_row_by_row_sampling_picks(sampler, tokenizer):
    for trial in range(3):
        rows, seqs = _mixed_step(tokenizer, 102400)
        torch.manual_seed(trial)  # rows without a seed draw from the global generator, in row order
        one_by_one = [sampler.sample(row.clone(), seq) for row, seq in zip(rows, seqs)]
        rows, seqs = _mixed_step(tokenizer, 102400)
        torch.manual_seed(trial)
        batched = sampler.sample_batch(rows, seqs)
        assert [t for t, _ in batched] == [t for t, _ in one_by_one]
        assert [e.logprob if e else None for _, e in batched] == [e.logprob if e else None for _, e in one_by_one]


def test_batched_sampling_leaves_the_logits_rows_unchanged(sampler, tokenizer):
    rows, seqs = _mixed_step(tokenizer, VOCAB)
    before = [row.clone() for row in rows]
    sampler.sample_batch(rows, seqs)
    assert all(torch.equal(a, b) for a, b in zip(rows, before))


def test_a_step_of_one_row_samples_as_the_row_alone(sampler, tokenizer):
    rows, seqs = _mixed_step(tokenizer, VOCAB)
    for row, seq in zip(rows, seqs):
        torch.manual_seed(3)
        alone = sampler.sample(row.clone(), seq)[0]
        torch.manual_seed(3)
        seq.generator = None if seq.sampling.seed is None else torch.Generator().manual_seed(seq.sampling.seed)
        assert sampler.sample_batch([row], [seq])[0][0] == alone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_on_a_gpu_sample_what_the_same_rows_on_the_cpu_sample(sampler, tokenizer):
    for trial in range(3):
        rows, seqs = _mixed_step(tokenizer, 102400)
        torch.manual_seed(trial)
        on_cpu = sampler.sample_batch(rows, seqs)
        rows, seqs = _mixed_step(tokenizer, 102400)
        torch.manual_seed(trial)
        on_gpu = sampler.sample_batch([row.cuda() for row in rows], seqs)
        assert [t for t, _ in on_gpu] == [t for t, _ in on_cpu]
        assert [e.logprob if e else None for _, e in on_gpu] == [e.logprob if e else None for _, e in on_cpu]


def test_draws_follow_the_distribution_and_never_pick_a_token_without_mass():
    from engines.runtime.sampler import _pick

    probs = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0], [0.5, 0.0, 0.0, 0.0, 0.0, 0.5]])
    uniforms = torch.rand(20000, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    picks = torch.tensor([_pick(probs, u) for u in uniforms])  # [20000, 2]
    for row in range(2):
        counts = torch.bincount(picks[:, row], minlength=6).float() / 20000
        assert counts[probs[row] == 0].sum() == 0
        assert torch.allclose(counts, probs[row], atol=0.015)


def test_a_draw_that_rounds_up_to_the_total_takes_the_last_token_with_mass():
    from engines.runtime.sampler import _pick

    assert _pick(torch.tensor([[0.0, 0.5, 0.5, 0.0]]), torch.tensor([1.0], dtype=torch.float64)) == [2]


def test_the_same_seed_draws_the_same_tokens(sampler, tokenizer):
    rows, _ = _mixed_step(tokenizer, VOCAB)
    draws = []
    for _ in range(2):
        seqs = [seq_for(tokenizer, temperature=1.0, seed=11) for _ in rows]
        draws.append([t for t, _ in sampler.sample_batch(rows, seqs)])
    assert draws[0] == draws[1] and len(set(draws[0])) > 1
