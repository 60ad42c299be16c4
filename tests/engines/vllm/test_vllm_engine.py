"""The vllm engine end to end on the demo model, through the routes every engine serves.

vLLM's CPU MLA kernel is built for DeepSeek's real latent width (kv_lora_rank 512 + rope 64), so these run
on the demo model with those two sizes; everything else about it is the demo model's. The reference is
transformers in float32, which the vllm engine also computes in on the CPU."""
from __future__ import annotations

import json
import time

import httpx
import jsonschema
import pytest

from tests.conftest import start_server
from tests.helpers import forward_logprobs, greedy_reference

# vLLM starts three processes that each import it: minutes on two busy cores
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
START_TIMEOUT = 600

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Hello there"}]
# vLLM and transformers both compute in float32 here; measured: 1.5e-5 at most over a 20-token prompt
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engines.kt.families.deepseek_mla.demo_model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("vllm-demo"), kv_lora_rank=512, qk_rope_head_dim=64)


@pytest.fixture(scope="module")
def reference(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("tests.conftest.SERVER_START_TIMEOUT", START_TIMEOUT)
        running = start_server(model_dir, engine="vllm", adapter_roots=[str(tmp_path_factory.mktemp("adapters"))])
    yield running
    running.stop()


def complete(server, **kwargs):
    kwargs.setdefault("model", server.engine.info.id)
    kwargs.setdefault("temperature", 0)
    return server.openai().completions.create(**kwargs)


def test_greedy_completion_equals_transformers_generate(server, reference):
    model, tokenizer = reference
    reply = complete(server, prompt=PROMPT, max_tokens=16)
    expected = greedy_reference(model, tokenizer.encode(PROMPT), 16)
    assert reply.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)


def test_streamed_greedy_chat_equals_the_non_streamed_reply(server):
    client = server.openai()
    whole = client.chat.completions.create(model=server.engine.info.id, messages=MESSAGES, temperature=0,
                                           max_tokens=16)
    stream = client.chat.completions.create(model=server.engine.info.id, messages=MESSAGES, temperature=0,
                                            max_tokens=16, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_echo_logprobs_agree_with_transformers(server, reference):
    model, tokenizer = reference
    reply = complete(server, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    ids = tokenizer.encode(PROMPT)
    expected = forward_logprobs(model, ids)
    lp = reply.choices[0].logprobs
    assert reply.choices[0].text == PROMPT and reply.usage.completion_tokens == 0
    # the BOS the server adds is not echoed: every echoed token is the client's text, scored given BOS
    assert ids[0] == tokenizer.bos_token_id and len(lp.token_logprobs) == len(ids) - 1
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i - 1] == pytest.approx(float(expected[i - 1, ids[i]]), abs=LOGPROB_TOLERANCE)


def test_sampled_logprobs_report_the_chosen_token_and_its_alternatives(server):
    reply = server.openai().chat.completions.create(model=server.engine.info.id, messages=MESSAGES, max_tokens=4,
                                                    temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)  # greedy picks the top one


def test_the_same_seed_samples_the_same_text(server):
    texts = {complete(server, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5).choices[0].text
             for _ in range(2)}
    assert len(texts) == 1


def test_a_stop_string_ends_the_reply_before_it(server):
    free = complete(server, prompt=PROMPT, max_tokens=16).choices[0].text
    stop = free[len(free) // 2:][:3]
    reply = complete(server, prompt=PROMPT, max_tokens=16, stop=[stop]).choices[0]
    assert reply.finish_reason == "stop" and reply.text == free[:free.index(stop)]


def test_json_schema_output_validates(server):
    schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"],
              "additionalProperties": False}
    reply = server.openai().chat.completions.create(
        model=server.engine.info.id, messages=MESSAGES, max_tokens=30, temperature=1.0, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_a_named_tool_choice_makes_the_model_call_that_function(server):
    # the forced call is a Lark grammar with token-id terminals, run by vLLM's llguidance backend
    from tests.server.test_tool_calls_api import TOOLS, WEATHER_PARAMS

    choice = server.openai().chat.completions.create(
        model=server.engine.info.id, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0, seed=5,
        max_tokens=60).choices[0]
    # a call the request forced by name finishes with "stop", as OpenAI and vLLM answer it
    assert choice.finish_reason == "stop" and len(choice.message.tool_calls) == 1
    assert choice.message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), WEATHER_PARAMS)


def test_ollama_chat_replies_as_the_openai_route_does(server):
    import ollama

    openai_text = server.openai().chat.completions.create(model=server.engine.info.id, messages=MESSAGES,
                                                          temperature=0, max_tokens=8).choices[0].message.content
    reply = ollama.Client(host=server.base_url, timeout=120).chat(
        model=server.engine.info.id, messages=MESSAGES, options={"temperature": 0, "num_predict": 8})
    assert reply.message.content == openai_text


def test_a_disconnected_stream_is_aborted_in_vllm(server):
    body = {"messages": MESSAGES, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            for _ in range(5):
                next(lines)
            assert server.engine.stats().running == 1
    deadline = time.monotonic() + 20
    unfinished = server.engine._llm.output_processor.get_num_unfinished_requests
    while (server.engine.stats().running or unfinished()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine.stats().running == 0 and unfinished() == 0
    with server.http() as http:
        assert http.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 3}).status_code == 200


def test_reward_scores_are_a_400_that_says_why(server):
    with server.http() as http:
        r = http.post("/v1/score/evaluation", json={"model": server.engine.info.id, "messages": ["hi"]})
    assert r.status_code == 400, r.text
    assert "vllm engine cannot compute reward scores" in r.json()["error"]["message"]


def test_loading_an_adapter_on_this_moe_model_is_a_400_that_says_why(server, tmp_path):
    with server.http() as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": server.settings.adapter_roots[0]})
    assert r.status_code == 400, r.text
    assert "mixture-of-experts" in r.json()["error"]["message"]
