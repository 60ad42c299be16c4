"""POST /v1/chat/completions end to end, through the official openai client."""
from __future__ import annotations

import pytest

from tests.helpers import logprob_tolerance, chat_prompt_ids, forward_logprobs, greedy_reference

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers."}]


def greedy_chat(server, max_tokens=24, **kwargs):
    return server.openai().chat.completions.create(model=server.engine.info.id, messages=MESSAGES,
                                                   temperature=0, max_tokens=max_tokens, **kwargs)


def test_greedy_chat_equals_transformers_generate(server, tokenizer, reference_model):
    reply = greedy_chat(server, max_tokens=24)
    expected = greedy_reference(reference_model, chat_prompt_ids(tokenizer, MESSAGES), 24)
    assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)


def test_streamed_chat_concatenates_to_the_non_streamed_text(server):
    whole = greedy_chat(server).choices[0].message.content
    stream = server.openai().chat.completions.create(model=server.engine.info.id, messages=MESSAGES,
                                                     temperature=0, max_tokens=24, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_usage_counts_prompt_and_completion_tokens(server, tokenizer):
    reply = greedy_chat(server, max_tokens=7)
    assert reply.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, MESSAGES))
    assert reply.usage.completion_tokens == 7
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 7


def test_stream_include_usage_ends_with_a_usage_chunk(server):
    stream = server.openai().chat.completions.create(
        model=server.engine.info.id, messages=MESSAGES, temperature=0, max_tokens=5, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_n2_with_a_seed_gives_two_reproducible_choices(server):
    def ask():
        return server.openai().chat.completions.create(model=server.engine.info.id, messages=MESSAGES, n=2,
                                                       seed=1234, temperature=1.0, max_tokens=12)
    first, again = ask(), ask()
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts[0] != texts[1]
    assert texts == [c.message.content for c in again.choices]


def test_max_tokens_ends_with_finish_reason_length(server):
    reply = greedy_chat(server, max_tokens=3)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3


def test_max_completion_tokens_is_honoured(server):
    reply = server.openai().chat.completions.create(model=server.engine.info.id, messages=MESSAGES,
                                                    temperature=0, max_completion_tokens=4)
    assert reply.usage.completion_tokens == 4


def _stop_inside(text: str) -> tuple[str, str]:
    """A stop string from the middle of `text`, and the text before it."""
    start = len(text) // 2
    stop = text[start:start + 3]
    return stop, text[:text.index(stop)]


def test_stop_string_ends_the_text_before_it(server):
    whole = greedy_chat(server, max_tokens=24).choices[0].message.content
    stop, before = _stop_inside(whole)
    reply = greedy_chat(server, max_tokens=24, stop=[stop])
    assert reply.choices[0].message.content == before
    assert reply.choices[0].finish_reason == "stop"


def test_stop_string_split_across_tokens_never_leaks_while_streaming(server, tokenizer, reference_model):
    ids = greedy_reference(reference_model, chat_prompt_ids(tokenizer, MESSAGES), 24)
    pieces = [tokenizer.decode(ids[:i], skip_special_tokens=True) for i in range(len(ids) + 1)]
    # a stop made of the last character of one token's text and the first of the next one
    k = next(i for i in range(4, len(ids) - 1) if len(pieces[i + 1]) > len(pieces[i]) > len(pieces[i - 1]))
    stop = pieces[k][-1] + pieces[k + 1][len(pieces[k])]
    before = pieces[-1][:pieces[-1].index(stop)]
    stream = server.openai().chat.completions.create(model=server.engine.info.id, messages=MESSAGES,
                                                     temperature=0, max_tokens=24, stop=stop, stream=True)
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(deltas) == before
    assert all(stop not in d for d in deltas)


def test_logprobs_match_a_direct_forward_pass(server, tokenizer, reference_model):
    reply = greedy_chat(server, max_tokens=6, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    prompt = chat_prompt_ids(tokenizer, MESSAGES)
    generated = greedy_reference(reference_model, prompt, 6)
    reference = forward_logprobs(reference_model, prompt + generated)
    for i, entry in enumerate(content):
        row = reference[len(prompt) - 1 + i]
        assert entry.logprob == pytest.approx(float(row[generated[i]]), abs=logprob_tolerance(server.engine))
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(float(row.max()), abs=logprob_tolerance(server.engine))


def test_chinese_output_streams_without_replacement_characters(server, tokenizer):
    # bias the random model towards whole-character tokens of a Chinese sentence (byte-piece tokens could
    # legitimately combine into invalid UTF-8; the detokenizer's unit tests cover characters split across tokens)
    ids = tokenizer.encode("我们今天去北京的长城看看风景，天气很好。", add_special_tokens=False)
    bias = {str(t): 100 for t in set(ids) if "\ufffd" not in tokenizer.decode([t])}
    stream = server.openai().chat.completions.create(model=server.engine.info.id, messages=MESSAGES,
                                                     temperature=0.8, seed=7, max_tokens=40, stream=True,
                                                     logit_bias=bias)
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert any("\u4e00" <= ch <= "\u9fff" for ch in "".join(deltas))
    assert not any("\ufffd" in d for d in deltas)


def test_text_part_content_is_accepted(server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three "}, {"type": "text", "text": "rivers."}]}]
    reply = server.openai().chat.completions.create(model=server.engine.info.id, messages=parts,
                                                    temperature=0, max_tokens=3)
    assert reply.choices[0].finish_reason == "length"


def test_unknown_fields_are_ignored(server):
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                    "some_vendor_extension": {"x": 1}})
    assert r.status_code == 200
