"""Tool calls end to end. A scripted model writes DeepSeek-V3 tool-call text and the official openai client
reads OpenAI tool_calls back, streamed and not; on the demo model a forced tool_choice yields a valid call."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tests.scripted_engine import ECHO, scripted_server
from server.chat.tool_calls import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def call_text(name: str, args: dict) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{json.dumps(args)}\n```{CALL_END}"


ONE_CALL = "Let me look." + CALLS_BEGIN + call_text("get_weather", {"city": "Paris", "unit": "celsius"}) + CALLS_END
TWO_CALLS = CALLS_BEGIN + call_text("get_weather", {"city": "Tokyo", "unit": "celsius"}) + "\n" + \
    call_text("get_time", {"zone": "Asia/Tokyo"}) + CALLS_END


@pytest.fixture(scope="module")
def scripted(demo_model_dir):
    with scripted_server(demo_model_dir) as server:
        yield server


def ask(server, text: str, **kwargs):
    kwargs.setdefault("tools", TOOLS)
    kwargs.setdefault("temperature", 0)
    return server.openai().chat.completions.create(model=server.engine.info.id,
                                                   messages=[{"role": "user", "content": text}], **kwargs)


def test_a_tool_call_in_the_output_becomes_openai_tool_calls(scripted):
    choice = ask(scripted, ONE_CALL).choices[0]
    call = choice.message.tool_calls[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}


def test_several_calls_are_all_returned_in_order(scripted):
    message = ask(scripted, TWO_CALLS).choices[0].message
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_time"]
    assert message.content is None


def test_the_openai_stream_helper_assembles_streamed_tool_calls(scripted):
    with scripted.openai().chat.completions.stream(
            model="scripted", messages=[{"role": "user", "content": TWO_CALLS}], tools=TOOLS) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion().choices[0]
    assert "tool_calls.function.arguments.delta" in kinds
    assert final.finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in final.message.tool_calls] == [
        {"city": "Tokyo", "unit": "celsius"}, {"zone": "Asia/Tokyo"}]


def test_a_streamed_call_opens_with_index_id_type_and_name_then_argument_pieces(scripted):
    deltas = [tc for chunk in ask(scripted, ONE_CALL, stream=True) for c in chunk.choices
              for tc in (c.delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather") and first.id
    assert rest and all(d.id is None and d.function.name is None for d in rest)
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Paris", "unit": "celsius"}


def test_tool_choice_none_leaves_the_text_as_content(scripted):
    choice = ask(scripted, ONE_CALL, tool_choice="none").choices[0]
    assert choice.message.content == ONE_CALL and not choice.message.tool_calls and choice.finish_reason == "stop"


def test_without_tools_the_markers_are_plain_content(scripted):
    message = scripted.openai().chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": ONE_CALL}]).choices[0].message
    assert message.content == ONE_CALL and not message.tool_calls


@pytest.mark.parametrize("broken", [
    CALLS_BEGIN + "get_weather(city=Paris)" + CALLS_END,
    CALLS_BEGIN + call_text("get_weather", {"city": "Paris"}).replace('{"city": "Paris"}', "{city: Paris"),
])
def test_malformed_tool_output_degrades_to_plain_content(scripted, broken):
    choice = ask(scripted, broken).choices[0]
    assert choice.message.content == broken and not choice.message.tool_calls and choice.finish_reason == "stop"


def test_a_streamed_call_block_that_is_not_a_call_stays_content(scripted):
    broken = CALLS_BEGIN + "get_weather(city=Paris)" + CALLS_END
    streamed = "".join(c.choices[0].delta.content or "" for c in ask(scripted, broken, stream=True) if c.choices)
    assert streamed == broken


def test_offered_tools_are_rendered_into_the_prompt(scripted, tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    with_tools = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "### get_weather" in with_tools and json.dumps(WEATHER_PARAMS) in with_tools
    usage = ask(scripted, "hi", max_tokens=1).usage
    assert usage.prompt_tokens == len(tokenizer.encode(with_tools, add_special_tokens=False))


def test_tool_results_go_back_into_the_conversation(scripted):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [{"role": "user", "content": ECHO}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees"}]
    prompt = scripted.openai().chat.completions.create(model="scripted", messages=messages,
                                                       temperature=0).choices[0].message.content
    assert call_text("get_weather", {"city": "Paris", "unit": "celsius"}) in prompt
    assert "<｜tool▁output▁begin｜>22 degrees<｜tool▁output▁end｜>" in prompt


@pytest.mark.parametrize("body", [
    {"tool_choice": {"type": "function", "function": {"name": "not_offered"}}, "tools": TOOLS},
    {"tool_choice": "required"},
    {"tool_choice": "sometimes", "tools": TOOLS},
])
def test_an_impossible_tool_choice_is_a_400_naming_it(scripted, body):
    with scripted.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


def test_a_named_tool_choice_makes_the_demo_model_call_that_function_and_finish_with_stop(server):
    """As OpenAI and vLLM answer a call the request forced by name: finish_reason "stop"."""
    choice = server.openai().chat.completions.create(
        model=server.engine.info.id, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0, seed=5,
        max_tokens=60).choices[0]
    assert choice.finish_reason == "stop" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)


def test_required_tool_choice_without_parallel_calls_makes_exactly_one_call(server):
    if server.engine.name != "huggingface":
        pytest.skip("one forced call on the reference engine is enough")
    choice = server.openai().chat.completions.create(
        model=server.engine.info.id, messages=[{"role": "user", "content": "Weather or time?"}], tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=2, max_tokens=60).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert choice.message.tool_calls[0].function.name in ("get_weather", "get_time")


# ------------------------------------------------------------------------------------ cut by max_tokens
def tokens_until(tokenizer, script: str, inside: str) -> int:
    """How many of `script`'s tokens the model writes before its text first covers `inside`."""
    ids = tokenizer.encode(script, add_special_tokens=False)
    return next(k for k in range(1, len(ids) + 1) if inside in tokenizer.decode(ids[:k]))


def streamed_message(server, text: str, **kwargs) -> dict:
    """The final message a client assembles from the stream: content, calls by index, finish reason."""
    content, calls, finish = "", {}, None
    for chunk in ask(server, text, stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": None, "arguments": ""})
                call["name"] = d.function.name or call["name"]
                call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return {"content": content or None, "calls": [calls[i] for i in sorted(calls)] or None, "finish": finish}


def whole_message(server, text: str, **kwargs) -> dict:
    choice = ask(server, text, **kwargs).choices[0]
    calls = [{"name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls or []] or None
    return {"content": choice.message.content, "calls": calls, "finish": choice.finish_reason}


def test_a_call_cut_mid_arguments_ends_with_the_partial_call_and_length(scripted, tokenizer):
    limit = tokens_until(tokenizer, ONE_CALL, '"city": "Pa')
    message = whole_message(scripted, ONE_CALL, max_tokens=limit)
    assert message["finish"] == "length" and message["content"] == "Let me look."
    [call] = message["calls"]
    assert call["name"] == "get_weather" and '{"city": "Pa' in call["arguments"]
    assert CALL_BEGIN not in call["arguments"] and not call["arguments"].endswith("}")


@pytest.mark.parametrize("inside", ['"city": "Pa', "function" + SEP + "get_wea", CALLS_BEGIN + CALL_BEGIN,
                                    '"unit": "celsius"}\n```'],
                         ids=["in-arguments", "in-the-name", "at-the-block-start", "at-the-call-end"])
def test_a_call_cut_by_max_tokens_gives_the_same_message_streamed_or_not(scripted, tokenizer, inside):
    limit = tokens_until(tokenizer, ONE_CALL, inside)
    whole = whole_message(scripted, ONE_CALL, max_tokens=limit)
    assert streamed_message(scripted, ONE_CALL, max_tokens=limit) == whole
    assert whole["finish"] == "length" and CALL_BEGIN not in (whole["content"] or "")


def test_a_call_cut_before_its_name_leaves_only_the_text_before_it(scripted, tokenizer):
    limit = tokens_until(tokenizer, ONE_CALL, "function" + SEP + "get_wea")
    assert whole_message(scripted, ONE_CALL, max_tokens=limit) == {
        "content": "Let me look.", "calls": None, "finish": "length"}


def test_an_ollama_reply_cut_inside_a_call_drops_the_unfinished_call(scripted, tokenizer):
    limit = tokens_until(tokenizer, ONE_CALL, '"city": "Pa')
    with scripted.http() as http:
        r = http.post("/api/chat", json={"model": "scripted", "stream": False, "tools": TOOLS,
                                         "options": {"num_predict": limit},
                                         "messages": [{"role": "user", "content": ONE_CALL}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["done_reason"] == "length" and not body["message"].get("tool_calls")
