"""POST /v1/responses (the OpenAI Responses API) through the official openai client: text and message-list
input, instructions, streaming events, function tools and their results, max_output_tokens, and the
stateless rules (no previous_response_id; `store` accepted, nothing stored). A scripted model writes known
text; the demo model shows the route runs the same generation as chat."""
from __future__ import annotations

import json

import openai
import pytest

from tests.scripted_engine import ECHO, scripted_server
from server.chat.tool_calls import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ARGS = {"city": "Paris"}
ONE_CALL = ("Checking." + CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}get_weather\n```json\n{json.dumps(ARGS)}\n```"
            + CALL_END + CALLS_END)


@pytest.fixture(scope="module")
def scripted(demo_model_dir):
    with scripted_server(demo_model_dir) as server:
        yield server


def respond(server, **kwargs):
    kwargs.setdefault("model", server.engine.info.id)
    return server.openai().responses.create(**kwargs)


def test_text_input_gives_a_completed_response_with_the_text(scripted):
    response = respond(scripted, input="Hello there")
    assert response.status == "completed" and response.object == "response"
    assert response.output_text == "Hello there"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert response.usage.output_tokens > 0 and response.usage.total_tokens == (
        response.usage.input_tokens + response.usage.output_tokens)


def test_a_message_list_and_instructions_go_into_the_prompt(scripted):
    response = respond(scripted, instructions="Be brief.", input=[
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "input_text", "text": ECHO}]}])
    prompt = response.output_text
    assert prompt.startswith("Be brief.") and "first" in prompt and prompt.endswith(ECHO + "<｜Assistant｜>")


def test_the_route_runs_the_same_generation_as_chat(server):
    response = respond(server, input="Tell me a story", max_output_tokens=6, temperature=0)
    chat = server.openai().chat.completions.create(model=server.engine.info.id, max_tokens=6, temperature=0,
                                                   messages=[{"role": "user", "content": "Tell me a story"}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_max_output_tokens_cuts_the_response_and_says_so(scripted):
    response = respond(scripted, input="one two three four five six seven", max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2 and response.output[0].status == "incomplete"


def test_streaming_sends_the_response_events_in_order_and_ends_completed(scripted):
    events = list(respond(scripted, input="Hello there", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there"
    assert events[-1].response.output_text == "Hello there"


def test_the_client_stream_helper_assembles_the_final_response(scripted):
    with scripted.openai().responses.stream(model="scripted", input="Hello there") as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == "Hello there" and final.status == "completed"


def test_a_function_call_becomes_a_function_call_item(scripted):
    response = respond(scripted, input=ONE_CALL, tools=[WEATHER])
    message, call = response.output
    assert message.type == "message" and response.output_text == "Checking."
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == ARGS and call.status == "completed"


def test_a_streamed_function_call_ends_as_the_whole_one(scripted):
    events = list(respond(scripted, input=ONE_CALL, tools=[WEATHER], stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    streamed = events[-1].response.output[1]
    whole = respond(scripted, input=ONE_CALL, tools=[WEATHER]).output[1]
    assert (streamed.name, streamed.arguments) == (whole.name, whole.arguments)


def test_tool_choice_none_keeps_the_call_as_text(scripted):
    response = respond(scripted, input=ONE_CALL, tools=[WEATHER], tool_choice="none")
    assert [item.type for item in response.output] == ["message"] and response.output_text == ONE_CALL


def test_function_call_results_go_back_into_the_conversation(scripted):
    response = respond(scripted, input=[
        {"role": "user", "content": ECHO},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps(ARGS)},
        {"type": "function_call_output", "call_id": "call_1", "output": "22 degrees"}])
    assert "<｜tool▁output▁begin｜>22 degrees<｜tool▁output▁end｜>" in response.output_text
    assert "get_weather" in response.output_text


def test_previous_response_id_is_refused_naming_it(scripted):
    with pytest.raises(openai.BadRequestError) as caught:
        respond(scripted, input="hi", previous_response_id="resp_123")
    assert caught.value.body["param"] == "previous_response_id"


def test_store_is_accepted_and_the_response_says_nothing_was_stored(scripted):
    response = respond(scripted, input="hi", store=True)
    assert response.status == "completed" and response.store is False


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "background": True}, "background"),
    ({}, "input"),
], ids=["hosted-tool", "image", "hosted-item", "zero-tokens", "background", "no-input"])
def test_what_the_server_cannot_do_is_a_400_naming_the_field(scripted, body, param):
    with scripted.http() as http:
        r = http.post("/v1/responses", json={"model": "scripted", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)
    if param == "input" and body:
        assert "input[0]" in r.json()["error"]["message"]
