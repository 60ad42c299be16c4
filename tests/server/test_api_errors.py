"""Bad input gets OpenAI error JSON with the right status and a message naming the field; the server keeps
serving afterwards. FastAPI's own 422 body never reaches a client."""
from __future__ import annotations

import json

import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def post(server, path, **kwargs):
    with server.http() as http:
        return http.post(path, **kwargs)


def assert_error(response, status: int, param: str | None = None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
        assert param.split(".")[0].split("[")[0] in body["error"]["message"]


def assert_still_serving(server):
    assert post(server, CHAT, json=GOOD).status_code == 200


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("temperature", 3), ("top_p", 0), ("top_p", 1.5), ("n", 0), ("n", 1000),
    ("presence_penalty", 5), ("frequency_penalty", -3), ("max_tokens", -1), ("top_logprobs", 50),
])
def test_out_of_range_sampling_values_are_400_naming_the_field(server, field, value):
    body = {**GOOD, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    assert_error(post(server, CHAT, json=body), 400, field)
    assert_still_serving(server)


def test_nan_temperature_is_400(server):
    r = post(server, CHAT, content=b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
             headers={"content-type": "application/json"})
    assert_error(r, 400, "temperature")


def test_empty_messages_are_400(server):
    assert_error(post(server, CHAT, json={"messages": []}), 400, "messages")
    assert_still_serving(server)


def test_missing_messages_are_400(server):
    assert_error(post(server, CHAT, json={"max_tokens": 3}), 400, "messages")


def test_unknown_role_is_400_naming_the_message(server):
    r = post(server, CHAT, json={"messages": [{"role": "wizard", "content": "hi"}]})
    assert_error(r, 400, "messages[0].role")


def test_malformed_json_is_400_without_fastapi_detail(server):
    r = post(server, CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert_error(r, 400)
    assert "JSON" in r.json()["error"]["message"]
    assert_still_serving(server)


def test_prompt_plus_max_tokens_over_the_context_is_400(server):
    limit = server.engine.info.max_model_len
    r = post(server, CHAT, json={**GOOD, "max_tokens": limit})
    assert_error(r, 400, "max_tokens")
    assert str(limit) in r.json()["error"]["message"]


def test_prompt_longer_than_the_context_is_400(server):
    limit = server.engine.info.max_model_len
    r = post(server, COMPLETIONS, json={"prompt": list(range(10, 10 + limit + 5)), "max_tokens": 1})
    assert_error(r, 400, "prompt")
    assert_still_serving(server)


def test_unknown_model_is_404(server):
    r = post(server, CHAT, json={**GOOD, "model": "no-such-model"})
    assert_error(r, 404, "model")
    assert r.json()["error"]["code"] == "model_not_found"


def test_too_many_stop_strings_are_400(server):
    assert_error(post(server, CHAT, json={**GOOD, "stop": ["x"] * 5000}), 400, "stop")
    assert_still_serving(server)


def test_logit_bias_with_a_token_outside_the_vocabulary_is_400(server):
    r = post(server, CHAT, json={**GOOD, "logit_bias": {"999999999": 5}})
    assert_error(r, 400, "logit_bias")


def test_completion_token_ids_outside_the_vocabulary_are_400(server):
    assert_error(post(server, COMPLETIONS, json={"prompt": [5, 10**9], "max_tokens": 1}), 400, "prompt")


def test_negative_token_ids_are_400_in_a_batch_of_prompts_too(server):
    assert_error(post(server, COMPLETIONS, json={"prompt": [-1, 5], "max_tokens": 1}), 400, "prompt")
    assert_error(post(server, COMPLETIONS, json={"prompt": [[5], [-1, 5]], "max_tokens": 1}), 400, "prompt")
    assert_still_serving(server)


def test_zero_max_tokens_without_echo_is_400(server):
    assert_error(post(server, COMPLETIONS, json={"prompt": "hi", "max_tokens": 0}), 400, "max_tokens")


def test_unknown_route_is_404_error_json(server):
    with server.http() as http:
        assert_error(http.get("/v1/nothing-here"), 404)


EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"


@pytest.mark.parametrize("path,body,param,shown", [
    (CHAT, {**GOOD, "max_tokens": True}, "max_tokens", "true"),
    (CHAT, {**GOOD, "n": 69.0}, "n", "69.0"),
    (CHAT, {**GOOD, "n": "2"}, "n", '"2"'),
    (CHAT, {**GOOD, "max_completion_tokens": 2.0}, "max_completion_tokens", "2.0"),
    (CHAT, {**GOOD, "seed": False}, "seed", "false"),
    (CHAT, {**GOOD, "top_k": 5.0}, "top_k", "5.0"),
    (CHAT, {**GOOD, "stop_token_ids": [1.0]}, "stop_token_ids[0]", "1.0"),
    (CHAT, {**GOOD, "logprobs": True, "top_logprobs": True}, "top_logprobs", "true"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2.0}, "max_tokens", "2.0"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "logprobs": True}, "logprobs", "true"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "min_tokens": 1.0}, "min_tokens", "1.0"),
    (COMPLETIONS, {"prompt": [5, 6.0], "max_tokens": 2}, "prompt", "6.0"),
    (COMPLETIONS, {"prompt": [[5], [True]], "max_tokens": 2}, "prompt", "true"),
    (EMBEDDINGS, {"input": "hi", "dimensions": 8.0}, "dimensions", "8.0"),
    (RESPONSES, {"input": "hi", "max_output_tokens": True}, "max_output_tokens", "true"),
], ids=lambda v: json.dumps(v)[:60] if isinstance(v, dict) else str(v))
def test_an_integer_field_given_a_boolean_a_float_or_a_string_is_400_naming_it(server, path, body, param, shown):
    """OpenAI refuses `"max_tokens": true` and `"n": 69.0`; pydantic's lax mode read them as 1 and 69."""
    r = post(server, path, json=body)
    assert_error(r, 400, param)
    assert shown in r.json()["error"]["message"], r.json()["error"]["message"]
    assert_still_serving(server)


def test_the_integers_an_integer_field_takes_still_work(server):
    reply = post(server, CHAT, json={**GOOD, "n": 2, "max_tokens": 3, "seed": 7, "top_k": 5}).json()
    assert len(reply["choices"]) == 2 and reply["usage"]["completion_tokens"] <= 6
    assert post(server, COMPLETIONS, json={"prompt": [5, 6], "max_tokens": 2, "logprobs": 1}).status_code == 200
