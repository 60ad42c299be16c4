"""POST /v1/completions end to end: prompts in every form, echo, legacy logprobs, streaming."""
from __future__ import annotations

import pytest

from tests.helpers import logprob_tolerance, forward_logprobs, greedy_reference

PROMPT = "The capital of France is"


def complete(server, **kwargs):
    kwargs.setdefault("model", server.engine.info.id)
    kwargs.setdefault("temperature", 0)
    return server.openai().completions.create(**kwargs)


def test_greedy_completion_equals_transformers_generate(server, tokenizer, reference_model):
    reply = complete(server, prompt=PROMPT, max_tokens=16)
    expected = greedy_reference(reference_model, tokenizer.encode(PROMPT), 16)
    assert reply.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)


def test_a_list_of_prompts_gives_one_choice_each(server):
    reply = complete(server, prompt=[PROMPT, "One, two,"], max_tokens=4)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].text == complete(server, prompt=PROMPT, max_tokens=4).choices[0].text


def test_token_id_prompt_equals_the_text_prompt(server, tokenizer):
    by_text = complete(server, prompt=PROMPT, max_tokens=6).choices[0].text
    by_ids = complete(server, prompt=tokenizer.encode(PROMPT), max_tokens=6).choices[0].text
    assert by_ids == by_text


def test_echo_prepends_the_prompt(server):
    plain = complete(server, prompt=PROMPT, max_tokens=5).choices[0].text
    echoed = complete(server, prompt=PROMPT, max_tokens=5, echo=True).choices[0].text
    assert echoed == PROMPT + plain


def test_echo_with_zero_max_tokens_scores_the_prompt(server, tokenizer, reference_model):
    reply = complete(server, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    ids = tokenizer.encode(PROMPT)
    reference = forward_logprobs(reference_model, ids)
    lp = reply.choices[0].logprobs
    assert reply.choices[0].text == PROMPT
    # the BOS the server puts before a text prompt is not echoed: the first entry is the text's first token,
    # scored given the BOS (docs/reliability.md, lm-eval's slicing)
    assert ids[0] == tokenizer.bos_token_id and len(lp.token_logprobs) == len(ids) - 1
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i - 1] == pytest.approx(float(reference[i - 1, ids[i]]),
                                                         abs=logprob_tolerance(server.engine))
    assert reply.usage.completion_tokens == 0


def test_usage_counts_exactly_the_prompt_tokens_an_echo_returns(server, tokenizer):
    """A text prompt's BOS, which the server adds, is neither echoed nor counted: `usage.prompt_tokens` is the
    number of echoed prompt tokens (12 counted against 11 echoed before), with or without echo, streamed or
    not. A token-id prompt is the client's own, BOS included: all of it is echoed and counted."""
    ids = tokenizer.encode(PROMPT)
    scored = complete(server, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    assert scored.choices[0].text == PROMPT
    assert len(scored.choices[0].logprobs.tokens) == scored.usage.prompt_tokens == len(ids) - 1
    assert scored.usage.total_tokens == scored.usage.prompt_tokens and scored.usage.completion_tokens == 0
    generating = complete(server, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1)
    assert len(generating.choices[0].logprobs.tokens) == generating.usage.prompt_tokens + 3
    assert complete(server, prompt=PROMPT, max_tokens=3).usage.prompt_tokens == scored.usage.prompt_tokens
    streamed = list(complete(server, prompt=PROMPT, max_tokens=3, stream=True,
                             stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens == scored.usage.prompt_tokens
    by_ids = complete(server, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert by_ids.choices[0].logprobs.token_logprobs[0] is None
    assert len(by_ids.choices[0].logprobs.tokens) == by_ids.usage.prompt_tokens == len(ids)


def test_legacy_logprobs_offsets_index_the_returned_text(server):
    reply = complete(server, prompt=PROMPT, max_tokens=8, echo=True, logprobs=2)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(choice.text)
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])


def test_streamed_completion_concatenates_to_the_non_streamed_text(server):
    whole = complete(server, prompt=PROMPT, max_tokens=12).choices[0].text
    stream = complete(server, prompt=PROMPT, max_tokens=12, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
