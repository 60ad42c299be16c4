"""Bad input gets OpenAI error JSON with the right status and a message naming the field; the server keeps
serving afterwards. FastAPI's own 422 body never reaches a client."""
from __future__ import annotations

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
