"""response_format on the demo model: sampled freely (temperature 1), every reply still parses and
validates, because generation is constrained to the grammar and ends when it completes."""
from __future__ import annotations

import json

import jsonschema
import pytest

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 4}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pet": {"enum": ["cat", "dog"]}},
    "required": ["name", "age", "pet"], "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


def reference_engine_only(server) -> None:
    """Twenty samples cost a few hundred model steps; the grammar path is the shared runtime's, so the
    reference engine is enough to run them on."""
    if server.engine.name != "huggingface":
        pytest.skip("sampled many times on the reference engine only")


def sampled(server, response_format, n=20, max_tokens=60):
    """`n` choices at temperature 1; each choice samples with its own seed (seed + index)."""
    return server.openai().chat.completions.create(model=server.engine.info.id, messages=MESSAGES, n=n, seed=100,
                                                   temperature=1.0, max_tokens=max_tokens,
                                                   response_format=response_format).choices


def test_json_schema_replies_all_validate(server):
    reference_engine_only(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    choices = sampled(server, fmt)
    for choice in choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({c.message.content for c in choices}) > 1  # really sampled, not one forced string


def test_json_object_replies_parse_as_objects_or_end_with_length(server):
    # Free-form JSON has no length bound: the random demo model closes about half its objects at once and
    # writes the other half's string until max_tokens. The grammar keeps every token valid JSON; a reply that
    # finished is a whole object, and one that did not says so with finish_reason "length".
    reference_engine_only(server)
    choices = sampled(server, {"type": "json_object"})
    finished = [c for c in choices if c.finish_reason == "stop"]
    assert finished
    for choice in finished:
        assert isinstance(json.loads(choice.message.content), dict)
    for choice in choices:
        assert choice.finish_reason in ("stop", "length") and choice.message.content.startswith("{")


def test_generation_ends_when_the_grammar_completes(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": {"enum": ["cat", "dog"]}}}
    choice = sampled(server, fmt, n=1, max_tokens=50)[0]
    assert choice.finish_reason == "stop" and choice.message.content in ('"cat"', '"dog"')


def test_streamed_json_schema_reply_validates(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    stream = server.openai().chat.completions.create(model=server.engine.info.id, messages=MESSAGES, seed=3,
                                                     temperature=1.0, max_tokens=60, response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strang"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 5}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "json_schema"},
    {"type": "yaml"},
])
def test_an_invalid_response_format_is_a_400_naming_it(server, fmt):
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, "response_format": fmt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("response_format")
    assert "response_format" in r.json()["error"]["message"]
