"""Bad chat requests to a DeepSeek-V4 server (the tiny V4 served end to end, engines/kt/families/dsml_chat.py's
checks, V3.2 sharing them): each is a 400 in OpenAI's error JSON whose `param` and message name the field, a
streamed one as much as a whole one, and the server serves the next request."""
from __future__ import annotations

import json

import openai
import pytest

from tests.helpers import assert_error

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def post(server, body: dict):
    with server.http(timeout=60) as http:
        return http.post(CHAT, json={"model": server.engine.info.id, "max_tokens": 2, **body})


def refused(server, body: dict, param: str) -> str:
    """The 400 that `body` gets, naming `param` in its `param` and its message; the server serves the next
    request. Its message."""
    message = assert_error(post(server, body), 400, param)["message"]
    assert param in message
    assert post(server, {"messages": HI}).status_code == 200
    return message


def with_a_call(arguments) -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return HI + [{"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.mark.parametrize("value", ["false", "yes", 1])
def test_v4_thinking_that_is_not_true_or_false_is_a_400_naming_it(v4_server, value):
    """`"false"` used to switch thinking on (any non-empty string is truthy)."""
    refused(v4_server, {"messages": HI, "chat_template_kwargs": {"thinking": value}}, "chat_template_kwargs.thinking")


def test_v4_a_streamed_request_with_a_bad_thinking_value_gets_the_400_not_a_stream(v4_server):
    client = v4_server.openai(timeout=60)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=v4_server.engine.info.id, messages=HI, max_tokens=2, stream=True,
                                       extra_body={"chat_template_kwargs": {"thinking": "false"}})
    assert error.value.body["param"] == "chat_template_kwargs.thinking"
    assert client.chat.completions.create(model=v4_server.engine.info.id, messages=HI, max_tokens=2).choices


def test_v4_reasoning_effort_in_chat_template_kwargs_outside_its_values_is_a_400_naming_it(v4_server):
    message = refused(v4_server, {"messages": HI, "chat_template_kwargs": {"thinking": True,
                                                                           "reasoning_effort": "extreme"}},
                      "chat_template_kwargs.reasoning_effort")
    assert "high" in message and "max" in message


@pytest.mark.parametrize("arguments", ['{"city": ', "[1, 2]", 5])
def test_v4_history_tool_call_arguments_that_are_not_a_json_object_are_a_400_naming_them(v4_server, arguments):
    refused(v4_server, {"messages": with_a_call(arguments)}, "messages[1].tool_calls[0].function.arguments")


def test_a_history_tool_call_without_a_function_name_is_a_400_naming_the_calls(v4_server):
    messages = HI + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {}}]}]
    refused(v4_server, {"messages": messages}, "messages[1].tool_calls")


@pytest.mark.parametrize("content,says", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], "text parts only"),
    ([], "empty list"),
])
def test_content_other_than_text_parts_is_a_400_naming_the_message_content(v4_server, content, says):
    assert says in refused(v4_server, {"messages": [{"role": "user", "content": content}]}, "messages[0].content")


@pytest.mark.parametrize("key", ["tokenize", "messages", "add_generation_prompt"])
def test_chat_template_kwargs_that_are_rendering_arguments_are_a_400_naming_the_key(v4_server, key):
    refused(v4_server, {"messages": HI, "chat_template_kwargs": {key: True}}, f"chat_template_kwargs.{key}")


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "Be brief."}],
    HI + [{"role": "assistant", "content": "Hello"}],
    HI + [{"role": "system", "content": "Be brief."}],
])
def test_v4_a_conversation_not_ending_with_a_user_or_tool_message_is_a_400_naming_the_last(v4_server, messages):
    """DeepSeek's format opens the reply only after a user or tool turn: the model used to go on writing the
    system prompt, or past an assistant turn's end-of-sentence."""
    message = refused(v4_server, {"messages": messages}, "messages")
    assert f"messages[{len(messages) - 1}]" in message and messages[-1]["role"] in message


def test_v4_tool_calls_with_tools_offered_and_valid_arguments_are_served(v4_server):
    """The checks above leave a well-formed tool conversation alone."""
    body = {"messages": with_a_call(json.dumps({"city": "Paris"})), "tools": [WEATHER]}
    assert post(v4_server, body).status_code == 200


def test_v32_tool_result_error_names_the_request_s_message_when_tools_add_a_system_message():
    from engines.base import InvalidRequestError
    from engines.kt.families.deepseek_v32.chat import V32ChatFormat

    with pytest.raises(InvalidRequestError) as error:
        V32ChatFormat().encode([{"role": "user", "content": "Hi"}, {"role": "tool", "content": "x"}],
                               tools=[WEATHER])
    assert error.value.param == "messages[1]" and "messages[1]" in str(error.value)
