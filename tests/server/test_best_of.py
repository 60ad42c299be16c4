"""`best_of` on /v1/completions, as vLLM implements it: generate `best_of` candidates per prompt and return
the `n` with the highest cumulative logprob, best first; refused with `stream` and beyond 20."""
from __future__ import annotations

import openai
import pytest

PROMPT = "Once upon a time"
SAMPLED = dict(prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7, extra_body={"ignore_eos": True})


def complete(server, **kwargs):
    return server.openai().completions.create(model=server.engine.info.id, **kwargs)


def cumulative(choice) -> float:
    return sum(choice.logprobs.token_logprobs)


def test_best_of_returns_the_candidates_with_the_highest_cumulative_logprob(server):
    candidates = complete(server, n=3, logprobs=0, **SAMPLED).choices  # the same seeds: the same candidates
    ranked = sorted(candidates, key=cumulative, reverse=True)
    best = complete(server, n=2, best_of=3, logprobs=0, **SAMPLED).choices
    assert [c.text for c in best] == [c.text for c in ranked[:2]]
    assert [c.index for c in best] == [0, 1]


def test_best_of_shows_no_logprobs_unless_asked(server):
    choice = complete(server, best_of=2, prompt=PROMPT, max_tokens=3).choices
    assert len(choice) == 1 and choice[0].logprobs is None


def test_usage_counts_every_candidate_generated(server):
    usage = complete(server, best_of=3, **SAMPLED).usage
    assert usage.completion_tokens == 3 * SAMPLED["max_tokens"]  # ignore_eos: each runs to max_tokens


@pytest.mark.parametrize("kwargs", [dict(best_of=1000), dict(best_of=0), dict(best_of=1, n=2),
                                    dict(best_of=3, stream=True)],
                         ids=["absurd", "zero", "fewer-than-n", "with-stream"])
def test_an_impossible_best_of_is_400_naming_it(server, kwargs):
    with pytest.raises(openai.BadRequestError) as caught:
        complete(server, prompt=PROMPT, max_tokens=2, **kwargs)
    assert caught.value.body["param"] == "best_of"
