"""The Ollama-compatible routes, spoken to in Ollama's own format with httpx and with the `ollama` client."""
from __future__ import annotations

import json

import pytest

from tests.scripted_engine import scripted_server
from server.chat.tool_calls import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

USER = [{"role": "user", "content": "Hello there, friend"}]
DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


@pytest.fixture(scope="module")
def scripted(demo_model_dir):
    with scripted_server(demo_model_dir, reasoning_parser="deepseek_r1") as server:
        yield server


def post(server, path: str, body: dict):
    with server.http() as http:
        return http.post(path, json=body)


def ndjson(server, path: str, body: dict) -> list[dict]:
    with server.http() as http, http.stream("POST", path, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in r.iter_lines() if line]


def assert_final(obj: dict, done_reason: str = "stop") -> None:
    assert obj["done"] is True and obj["done_reason"] == done_reason
    assert obj["prompt_eval_count"] > 0 and obj["eval_count"] > 0
    assert all(isinstance(obj[k], int) and obj[k] >= 0 for k in DURATIONS)


def test_version_and_tags_list_the_served_model(scripted):
    with scripted.http() as http:
        assert http.get("/api/version").json()["version"]
        models = http.get("/api/tags").json()["models"]
    assert [m["name"] for m in models] == ["scripted:latest"] and "details" in models[0]


def test_show_describes_the_model_and_404s_an_unknown_one(scripted):
    assert post(scripted, "/api/show", {"model": "scripted:latest"}).json()["details"]["family"] == "Script"
    missing = post(scripted, "/api/show", {"model": "nope"})
    assert missing.status_code == 404 and isinstance(missing.json()["error"], str)


def test_chat_without_streaming_is_one_done_object(scripted):
    body = post(scripted, "/api/chat", {"model": "scripted", "messages": USER, "stream": False}).json()
    assert body["message"] == {"role": "assistant", "content": "Hello there, friend"}
    assert_final(body)


def test_chat_streams_newline_delimited_json_ending_with_done(scripted):
    lines = ndjson(scripted, "/api/chat", {"model": "scripted", "messages": USER})
    assert all(not line["done"] for line in lines[:-1])
    assert "".join(line["message"]["content"] for line in lines) == "Hello there, friend"
    assert_final(lines[-1])


def test_generate_streams_the_response_and_returns_the_context(scripted):
    lines = ndjson(scripted, "/api/generate", {"model": "scripted", "prompt": "Hello there, friend"})
    assert "".join(line["response"] for line in lines) == "Hello there, friend"
    assert_final(lines[-1])
    assert lines[-1]["context"][-1] == scripted.engine.tokenizer.eos_token_id


def test_generate_raw_sends_the_prompt_without_a_template(scripted):
    body = post(scripted, "/api/generate", {"model": "scripted", "prompt": "plain text", "raw": True,
                                            "stream": False}).json()
    assert body["response"] == "plain text" and body["prompt_eval_count"] == 3  # BOS + two tokens


def test_num_predict_limits_the_reply(scripted):
    body = post(scripted, "/api/chat", {"model": "scripted", "messages": USER, "stream": False,
                                        "options": {"num_predict": 2, "temperature": 0}}).json()
    assert body["eval_count"] == 2 and body["done_reason"] == "length"


def test_reasoning_arrives_as_thinking(scripted):
    messages = [{"role": "user", "content": "<think>\nPonder.</think>\n\nDone."}]
    body = post(scripted, "/api/chat", {"model": "scripted", "messages": messages, "stream": False}).json()
    assert (body["message"]["thinking"], body["message"]["content"]) == ("Ponder.", "Done.")


def test_tool_calls_come_back_with_object_arguments(scripted):
    call = f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_time\n```json\n{{"zone": "UTC"}}\n```{CALL_END}{CALLS_END}'
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    request = {"model": "scripted", "messages": [{"role": "user", "content": call}], "tools": tools}
    body = post(scripted, "/api/chat", {**request, "stream": False}).json()
    assert body["message"]["tool_calls"] == [{"function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]
    streamed = [c for line in ndjson(scripted, "/api/chat", request) for c in line["message"].get("tool_calls", [])]
    assert streamed == body["message"]["tool_calls"]


@pytest.mark.parametrize("body,status", [
    ({"model": "scripted", "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ({"model": "scripted", "messages": USER, "options": {"temperature": 9}}, 400),
    ({"model": "other", "messages": USER}, 404),
])
def test_errors_use_ollamas_error_shape(scripted, body, status):
    r = post(scripted, "/api/chat", body)
    assert r.status_code == status and isinstance(r.json()["error"], str) and r.json()["error"]


BODIES = {"/api/show": ("ShowRequest", {"model", "name"}, []),
          "/api/chat": ("ChatRequest", {"model", "messages", "options", "stream", "format", "tools"}, ["model"]),
          "/api/generate": ("GenerateRequest", {"model", "prompt", "system", "context", "raw", "options"}, ["model"]),
          "/api/embed": ("EmbedRequest", {"model", "input", "truncate", "dimensions"}, ["model", "input"]),
          "/api/embeddings": ("EmbeddingsRequest", {"model", "prompt"}, ["model"])}


@pytest.mark.parametrize("path", list(BODIES))
def test_the_openapi_document_describes_each_ollama_request_body(scripted, path):
    """The routes read their bodies themselves (for Ollama's error shape); the schema still says what they take,
    so schema-driven clients and fuzzers reach them."""
    title, fields, required = BODIES[path]
    with scripted.http() as http:
        body = http.get("/openapi.json").json()["paths"][path]["post"]["requestBody"]
    schema = body["content"]["application/json"]["schema"]
    assert schema["title"] == title and fields <= set(schema["properties"])
    assert schema.get("required", []) == required and body["required"] is bool(required)
    assert "$ref" not in json.dumps(schema)  # nested models written in place, nothing left to resolve
    if path == "/api/chat":
        assert schema["properties"]["options"]["properties"]["num_predict"]["anyOf"][0] == {"type": "integer"}


@pytest.mark.parametrize("path,body,named", [
    ("/api/chat", {"messages": USER}, "'model' is required"),
    ("/api/chat", {"model": "scripted", "messages": USER, "options": {"num_predict": True}}, "options.num_predict"),
    ("/api/generate", {"model": "scripted", "prompt": "hi", "context": [1.5]}, "context[0]"),
    ("/api/embed", {"model": "scripted", "input": "hi", "dimensions": 8.0}, "dimensions"),
    ("/api/show", {"model": 5}, "'model'"),
])
def test_an_ollama_body_is_still_checked_by_the_route_naming_the_field(scripted, path, body, named):
    r = post(scripted, path, body)
    assert r.status_code == 400 and set(r.json()) == {"error"} and named in r.json()["error"], r.text
    reply = post(scripted, "/api/chat", {"model": "scripted", "messages": USER, "stream": False,
                                         "options": {"num_predict": 3.0}})  # a number Ollama reads as 3
    assert reply.status_code == 200 and reply.json()["done"] is True


def test_the_ollama_client_chats_streams_and_lists(scripted):
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=scripted.base_url)
    assert client.chat(model="scripted", messages=USER).message.content == "Hello there, friend"
    pieces = [part.message.content for part in client.chat(model="scripted", messages=USER, stream=True)]
    assert "".join(pieces) == "Hello there, friend"
    assert client.generate(model="scripted", prompt="Hi you").response == "Hi you"
    assert [m.model for m in client.list().models] == ["scripted:latest"]


def test_the_routes_need_the_api_key_when_one_is_set(demo_model_dir):
    with scripted_server(demo_model_dir, api_key="sekret") as server:
        assert post(server, "/api/tags", {}).status_code in (401, 405)
        with server.http() as http:
            assert http.get("/api/tags").status_code == 401
            assert http.get("/api/tags", headers={"Authorization": "Bearer sekret"}).status_code == 200


def test_sampling_options_reach_the_demo_model(server):
    def ask(seed):
        return post(server, "/api/chat", {"model": server.engine.info.id, "messages": USER, "stream": False,
                                          "options": {"temperature": 1.0, "seed": seed, "num_predict": 6}}).json()
    first, again, other = ask(7), ask(7), ask(8)
    assert first["message"]["content"] == again["message"]["content"] != other["message"]["content"]


def test_format_json_constrains_the_demo_model(server):
    body = post(server, "/api/generate", {"model": server.engine.info.id, "prompt": "JSON please", "format": "json",
                                          "stream": False, "options": {"num_predict": 40}}).json()
    assert isinstance(json.loads(body["response"]), dict)
