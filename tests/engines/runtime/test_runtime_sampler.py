"""Sampling rules on hand-made logits."""
from __future__ import annotations

import numpy as np
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


def test_tokens_tied_with_the_last_of_the_nucleus_stay_in_it(sampler, tokenizer):
    logits = torch.full((VOCAB,), -20.0)
    logits[7] = 3.0
    logits[[9, 11, 13]] = 2.0  # 7 holds 0.48 of the mass and each tie 0.17: a run reaching 0.6 ends in the ties
    tokens = {sampler.sample(logits.clone(), seq_for(tokenizer, temperature=1.0, top_p=0.6, seed=s))[0]
              for s in range(60)}
    assert tokens == {7, 9, 11, 13}  # not 7 and whichever tie a sort happened to put first


def test_a_nucleus_wider_than_the_candidates_looked_at_first_is_found_over_the_whole_row():
    from engines.runtime.sampler import NUCLEUS_CANDIDATES, _distributions

    gen = torch.Generator().manual_seed(3)
    flat = torch.randn(4 * NUCLEUS_CANDIDATES, generator=gen) * 0.1  # top_p 0.9 keeps ~90% of its tokens
    peaked = torch.randn(4 * NUCLEUS_CANDIDATES, generator=gen) * 5
    params = [SamplingParams(temperature=1.0, top_p=0.9) for _ in range(2)]
    probs = _distributions(torch.stack([flat, peaked]), params)
    assert int((probs[0] > 0).sum()) > NUCLEUS_CANDIDATES
    for row, row_probs in zip((flat, peaked), probs):
        assert torch.equal(row_probs, _reference_probs(row, params[0]))


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


def _reference_adjusted(logits: torch.Tensor, seq, eos=(1,)) -> torch.Tensor:
    """The rules that change one row's logits, written out plainly in the order the sampler applies them."""
    p, logits = seq.sampling, logits.clone()
    for token, value in (p.logit_bias or {}).items():
        logits[token] += torch.tensor(value, dtype=logits.dtype)
    if seq.num_output_tokens < p.min_tokens:
        logits[[t for t in (*eos, *p.stop_token_ids)]] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)))
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
        ids, counts = torch.tensor(seq.output_ids).unique(return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    allowed = seq.logits_processor.allowed() if seq.logits_processor is not None else None
    if isinstance(allowed, int):
        logits[:] = float("-inf")
        logits[allowed] = 0.0
    elif allowed is not None:
        bits = np.unpackbits(allowed.numpy().view(np.uint8), bitorder="little", count=logits.numel())
        logits[torch.from_numpy(bits == 0)] = float("-inf")
    return logits


def _reference_probs(logits: torch.Tensor, p) -> torch.Tensor:
    """One row's sampling distribution: temperature, top_k, min_p, top_p."""
    scaled = logits / p.temperature
    if 0 < p.top_k < scaled.numel():
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:  # the shortest run of most likely tokens whose mass reaches top_p, and all tied with its last
        ordered = torch.sort(probs, descending=True).values
        before = torch.cumsum(ordered, dim=-1) - ordered
        past = (before > p.top_p).nonzero()
        last = int(past[0]) - 1 if past.numel() else ordered.numel() - 1
        probs = probs.masked_fill(probs < ordered[last], 0.0)
    return probs


def _reference(logits: torch.Tensor, seq) -> tuple[int, float | None]:
    """One row's token, and its logprob if asked: the specification the batched sampler is checked against."""
    from engines.runtime.sampler import _pick, uniform

    p = seq.sampling
    logprobs = torch.log_softmax(logits, dim=-1) if p.logprobs is not None else None
    logits = _reference_adjusted(logits, seq)
    token = int(torch.argmax(logits))
    if not p.greedy and p.temperature >= 1e-5:
        probs = _reference_probs(logits, p)
        if bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0:
            token = _pick(probs.unsqueeze(0), uniform(seq.generator).view(1))[0]
    if seq.logits_processor is not None:
        seq.logits_processor.accept(token)
    return token, None if logprobs is None else float(logprobs[token])


class EvenTokensOnly:
    """A stand-in grammar: allows even token ids only (or forces one), and records what it was told was chosen."""

    def __init__(self, vocab: int = 102400, forces: int | None = None):
        self.words = torch.full(((vocab + 31) // 32,), 0x55555555, dtype=torch.int32)  # bits 0, 2, 4, ...
        self.forces = forces
        self.accepted: list[int] = []

    def allowed(self):
        return self.forces if self.forces is not None else self.words

    def accept(self, token):
        self.accepted.append(token)


def _mixed_step(tokenizer, vocab: int) -> tuple[list[torch.Tensor], list]:
    """A step of 20 rows at a real vocabulary size: plain greedy, plain temperature (seeded and not), and every
    rule that changes the logits or asks for logprobs, alone and together."""
    gen = torch.Generator().manual_seed(7)
    rows = [torch.randn(vocab, generator=gen) * 3 for _ in range(20)]
    params = [dict(temperature=0), dict(temperature=0.7, seed=1), dict(temperature=1.3), dict(temperature=0),
              dict(temperature=0.7, seed=2), dict(temperature=0, frequency_penalty=0.5), dict(temperature=1.0),
              dict(temperature=0.9, logprobs=2), dict(temperature=0.8, top_p=0.9, seed=3),
              dict(temperature=0, min_tokens=5), dict(temperature=2.0, seed=4), dict(temperature=0, top_k=1),
              dict(temperature=1.0, top_k=40, seed=5), dict(temperature=1.0, min_p=0.05),
              dict(temperature=0.6, top_p=0.5, top_k=100, min_p=0.01, logprobs=5, seed=6),
              dict(temperature=1.1, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=-0.3,
                   logit_bias={9: 5.0, 100: -100.0}, min_tokens=4, stop_token_ids=(2,), seed=7),
              dict(temperature=0, logprobs=0, logit_bias={17: 30.0}),
              dict(temperature=1.0, logit_bias={5: -100.0, 6: 100.0}, seed=8),  # all mass on one token
              dict(temperature=0.9, top_p=0.95, seed=9), dict(temperature=1.0, seed=10)]
    seqs = [seq_for(tokenizer, output=[5, 6, 6, 9], **p) for p in params]
    seqs[18].logits_processor = EvenTokensOnly()
    seqs[19].logits_processor = EvenTokensOnly()
    return rows, seqs


def test_batched_sampling_picks_what_the_one_row_rules_pick(sampler, tokenizer):
    for trial in range(3):
        rows, seqs = _mixed_step(tokenizer, 102400)
        torch.manual_seed(trial)  # rows without a seed draw from the global generator, in row order
        expected = [_reference(row, seq) for row, seq in zip(rows, seqs)]
        rows, seqs = _mixed_step(tokenizer, 102400)
        torch.manual_seed(trial)
        batched = sampler.sample_batch(rows, seqs)
        assert [t for t, _ in batched] == [t for t, _ in expected]
        assert [e.logprob if e else None for _, e in batched] == [lp for _, lp in expected]


def test_each_rule_changes_a_batched_row_as_it_changes_the_row_alone(tokenizer):
    from engines.runtime.sampler import _adjust, _distributions

    rows, seqs = _mixed_step(tokenizer, 102400)
    for seq in seqs:  # the penalised tokens among the likeliest, so that each rule moves the outcome
        for token in seq.token_ids:
            rows[seqs.index(seq)][token] = 9.0 + token % 3
    logits = torch.stack(rows)
    _adjust(logits, seqs, (1,))
    for row, seq, adjusted in zip(rows, seqs, logits):
        assert torch.equal(adjusted, _reference_adjusted(row, seq))
    sampled = [r for r, seq in enumerate(seqs) if not seq.sampling.greedy]
    probs = _distributions(logits[sampled], [seqs[r].sampling for r in sampled])
    for r, row_probs in zip(sampled, probs):
        assert torch.equal(row_probs, _reference_probs(logits[r], seqs[r].sampling))


def test_grammar_rows_in_a_batch_are_masked_and_told_their_token(sampler, tokenizer):
    rows, seqs = _mixed_step(tokenizer, VOCAB)
    for r in (18, 19):
        seqs[r].logits_processor = EvenTokensOnly(VOCAB)
    tokens = [t for t, _ in sampler.sample_batch(rows, seqs)]
    for r in (18, 19):
        assert tokens[r] % 2 == 0 and seqs[r].logits_processor.accepted == [tokens[r]]


def test_a_grammar_that_forces_its_end_gets_it_even_while_min_tokens_bans_it(sampler, tokenizer):
    seq = seq_for(tokenizer, temperature=0, min_tokens=5)
    seq.logits_processor = EvenTokensOnly(VOCAB, forces=1)  # complete: only EOS (1) is left
    assert sampler.sample(logits_with(7, 9), seq)[0] == 1


def test_a_grammars_mask_shorter_than_the_models_rows_forbids_the_rows_past_it(sampler, tokenizer):
    seq = seq_for(tokenizer, temperature=0)
    seq.logits_processor = EvenTokensOnly(32)  # a tokenizer of 32 tokens, a model of VOCAB = 50 rows
    assert sampler.sample(logits_with(40, 9), seq)[0] not in (40, 9)


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
        # the same values up to float32 rounding: the GPU reduces in another order
        assert [e.logprob if e else None for _, e in on_gpu] == \
            pytest.approx([e.logprob if e else None for _, e in on_cpu], abs=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_with_rows_on_the_host_and_on_a_gpu_samples_what_the_host_samples(sampler, tokenizer):
    rows, seqs = _mixed_step(tokenizer, 102400)
    torch.manual_seed(0)
    on_cpu = sampler.sample_batch(rows, seqs)
    rows, seqs = _mixed_step(tokenizer, 102400)
    torch.manual_seed(0)
    mixed = sampler.sample_batch([row.cuda() if r % 2 else row for r, row in enumerate(rows)], seqs)
    assert [t for t, _ in mixed] == [t for t, _ in on_cpu]


def _prompt_rows(count: int = 10, vocab: int = 102400) -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(5)
    return torch.randn(count, vocab, generator=gen) * 3, torch.randint(vocab, (count,), generator=gen).tolist()


def test_prompt_logprobs_are_each_rows_log_softmax_at_its_next_token_with_the_rows_best(sampler):
    rows, targets = _prompt_rows()  # more rows than one block of the CPU path
    entries = sampler.prompt_entries(rows, targets, 3)
    assert [e.token_id for e in entries] == targets
    for row, target, entry in zip(rows, targets, entries):
        logprobs = torch.log_softmax(row, dim=-1)
        assert entry.logprob == float(logprobs[target])
        assert [t.token_id for t in entry.top] == torch.topk(logprobs, 3).indices.tolist()
        assert [t.logprob for t in entry.top] == torch.topk(logprobs, 3).values.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prompt_logprobs_on_a_gpu_match_the_hosts(sampler):
    rows, targets = _prompt_rows(600)  # more rows than one block of the GPU path
    on_cpu = sampler.prompt_entries(rows, targets, 2)
    on_gpu = sampler.prompt_entries(rows.cuda(), targets, 2)
    # float32 sums of 102,400 terms in another order: ~1e-6 apart relative (2e-5 at -20 measured on an H200)
    assert [e.logprob for e in on_gpu] == pytest.approx([e.logprob for e in on_cpu], rel=1e-5)
    assert [[t.token_id for t in e.top] for e in on_gpu] == [[t.token_id for t in e.top] for e in on_cpu]


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
