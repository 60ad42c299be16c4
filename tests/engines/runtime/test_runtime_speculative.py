"""Verification of drafted tokens (engines/runtime/speculative.py): greedy keeps exactly the model's own choices;
rejection sampling emits tokens distributed as the model's distribution, whatever the draft proposes.

The distribution checks draw a fixed number of times from seeded generators, so they give the same counts on
every run; the bound is Pearson's chi-square at a p-value of about 1e-6 for the degrees of freedom, which a
correct sampler passes for all but one seed in a million and a sampler that keeps draft tokens too often (or
resamples from p instead of the residual) fails by orders of magnitude."""
from __future__ import annotations

import torch

from engines.runtime.sampler import sample_from, uniform
from engines.runtime.speculative import accepted_prefix, verify_chain

P0 = torch.tensor([0.35, 0.25, 0.15, 0.10, 0.10, 0.05])  # the model's distribution at the last token
P1 = torch.tensor([0.05, 0.05, 0.10, 0.20, 0.30, 0.30])  # ... at the draft token, after accepting it
Q0 = torch.tensor([0.05, 0.10, 0.10, 0.15, 0.25, 0.35])  # the draft's distribution: unlike P0
DRAWS = 4000
CHI2_BOUND = 33.0  # P(chi-square with 5 degrees of freedom > 33) is about 4e-6


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def run(draft_of, draft_probs, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    target = torch.stack([P0, P1])
    return [verify_chain(target, [draft_of(gen)], draft_probs, lambda: uniform(gen),
                         lambda probs: sample_from(probs, gen)) for _ in range(DRAWS)]


def test_tokens_drawn_from_a_draft_distribution_are_distributed_as_the_model_samples():
    emitted = run(lambda gen: sample_from(Q0, gen), Q0.unsqueeze(0), seed=1)
    first = torch.bincount(torch.tensor([tokens[0] for tokens in emitted]), minlength=6).float()
    assert chi_square(first, P0) < CHI2_BOUND
    assert chi_square(first, Q0) > 100 * CHI2_BOUND  # the check can tell the draft's distribution from the model's


def test_a_deterministic_draft_token_is_kept_with_the_models_probability_and_replaced_by_the_rest():
    emitted = run(lambda gen: 5, None, seed=2)  # q one-hot on token 5, which the model gives 0.05
    first = torch.bincount(torch.tensor([tokens[0] for tokens in emitted]), minlength=6).float()
    assert chi_square(first, P0) < CHI2_BOUND


def test_after_an_accepted_draft_the_next_token_follows_the_models_next_distribution():
    emitted = run(lambda gen: 0, None, seed=3)  # token 0: accepted about 35% of the time
    bonus = [tokens[1] for tokens in emitted if len(tokens) == 2]
    assert all(tokens[0] == 0 for tokens in emitted if len(tokens) == 2)
    assert 0.30 * DRAWS < len(bonus) < 0.40 * DRAWS
    counts = torch.bincount(torch.tensor(bonus), minlength=6).float()
    assert chi_square(counts, P1) < CHI2_BOUND


def test_a_draft_the_model_gives_no_probability_is_never_kept():
    target = torch.stack([torch.tensor([0.5, 0.5, 0.0]), torch.tensor([1.0, 0.0, 0.0])])
    gen = torch.Generator().manual_seed(4)
    for _ in range(200):
        tokens = verify_chain(target, [2], None, lambda: uniform(gen), lambda probs: sample_from(probs, gen))
        assert len(tokens) == 1 and tokens[0] in (0, 1)


def test_greedy_verification_keeps_the_draft_up_to_the_first_token_the_model_would_not_pick():
    assert accepted_prefix([7, 8, 9], [7, 8, 9, 10]) == 3
    assert accepted_prefix([7, 8, 9], [7, 5, 9, 10]) == 1
    assert accepted_prefix([7], [6, 1]) == 0
