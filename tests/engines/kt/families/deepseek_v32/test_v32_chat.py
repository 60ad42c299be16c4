"""DeepSeek-V3.2's conversation format (engines/kt/families/deepseek_v32/chat.py), the checkpoint's own encoder
behind trust_remote_code, and V3.2's DSML tool-call markup (`function_calls` blocks) parsed to OpenAI `tool_calls`
(also streamed). End-to-end chats with the tiny V3.2 are in
tests/engines/kt/families/deepseek_v32/test_kt_deepseek_v32.py."""
from __future__ import annotations

import json

import pytest

from engines.kt.families.deepseek_v32.chat import V32ChatFormat, checkpoint_encoder, render_tool_calls
from engines.kt.families.dsml_chat import ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER, install
from server.chat.tool_calls import tool_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}
CALL2 = {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
     {"role": "user", "content": "Weather?"}],
    [{"role": "user", "content": "Weather in Paris and Oslo?"},
     {"role": "assistant", "content": "", "reasoning_content": "two cities", "tool_calls": [CALL, CALL2]},
     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
     {"role": "tool", "tool_call_id": "call_2", "content": "snow"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "reasoning_content": "look it up", "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
     {"role": "assistant", "content": "Sunny.", "reasoning_content": "answer"},
     {"role": "user", "content": "Thanks"}],
]

# A stand-in for the release's encoding/encoding_dsv32.py, written here from the published description of the
# format (no real checkpoint can be downloaded in tests): the opt-in path runs it instead of ours. Tools ride on
# the system message, as the release takes them.
CHECKPOINT_ENCODER = '''
import json
B, E, U, A, S, T = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"
D = "｜DSML｜"
TOOLS = """## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{D}function_calls>" block like the following as part of your reply to the user:
<{D}function_calls>
<{D}invoke name="$FUNCTION_NAME">
<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}parameter>
...
</{D}invoke>
<{D}invoke name="$FUNCTION_NAME2">
...
</{D}invoke>
</{D}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<{D}function_calls>
...
</{D}function_calls>
<function_results>
...
</function_results>
{S}...thinking about results{T}
Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""

def _args(call):
    args = call["function"]["arguments"]
    args = json.loads(args) if isinstance(args, str) else args
    return "\\n".join('<%sparameter name="%s" string="%s">%s</%sparameter>' % (
        D, k, "true" if isinstance(v, str) else "false", v if isinstance(v, str) else json.dumps(v, ensure_ascii=False), D)
        for k, v in args.items())

def encode_messages(messages, thinking_mode, context=None, drop_thinking=True, add_default_bos_token=True):
    think = thinking_mode == "thinking"
    last = max([i for i, m in enumerate(messages) if m["role"] in ("user", "developer")] or [-1])
    out = B if add_default_bos_token else ""
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "system":
            out += content
            if m.get("tools"):
                out += "\\n\\n" + TOOLS.format(D=D, S=S, T=T, schemas="\\n".join(
                    json.dumps(t["function"], ensure_ascii=False) for t in m["tools"]))
        elif role == "user":
            out += U + content + A + (S if think and i == last else T)
        elif role == "tool":
            j = i
            while messages[j - 1]["role"] == "tool":
                j -= 1
            calls = messages[j - 1]["tool_calls"]
            n = i - j + 1
            out += ("\\n\\n<function_results>" if n == 1 else "") + "\\n<result>" + content + "</result>"
            if n == len(calls):
                out += "\\n</function_results>" + "\\n\\n" + (S if think and i >= last else T)
        else:
            if think and i > last:
                out += (m.get("reasoning_content") or "") + T
            out += content
            if m.get("tool_calls"):
                out += "\\n\\n<%sfunction_calls>\\n" % D + "\\n".join(
                    '<%sinvoke name="%s">\\n%s\\n</%sinvoke>' % (D, c["function"]["name"], _args(c), D)
                    for c in m["tool_calls"]) + "\\n</%sfunction_calls>" % D
            out += E
    return out
'''


def test_a_non_thinking_chat_ends_by_closing_the_thinking():
    text = V32ChatFormat().encode([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}])
    assert text == BOS + "S" + USER + "Hi" + ASSISTANT + THINK_END


def test_a_thinking_chat_opens_the_reasoning_and_drops_earlier_turns_reasoning():
    text = V32ChatFormat().encode(CONVERSATIONS[1], thinking=True)
    assert text.endswith(USER + "Weather?" + ASSISTANT + THINK_START)
    assert "greet back" not in text and ASSISTANT + THINK_END + "Hello!" + EOS in text


def test_tool_results_follow_the_calls_and_reopen_the_thinking_in_thinking_mode():
    text = V32ChatFormat().encode(CONVERSATIONS[2], tools=[WEATHER], thinking=True)
    assert "## Tools" in text and json.dumps(WEATHER["function"], ensure_ascii=False) in text
    assert text.endswith("two cities" + THINK_END + render_tool_calls([CALL, CALL2]) + EOS
                         + "\n\n<function_results>\n<result>sunny</result>\n<result>snow</result>\n</function_results>"
                         + "\n\n" + THINK_START)
    assert V32ChatFormat().encode(CONVERSATIONS[2], tools=[WEATHER]).endswith("</function_results>\n\n" + THINK_END)


def test_reasoning_effort_is_checked_but_v32_has_no_effort_preamble():
    plain = V32ChatFormat().encode(CONVERSATIONS[0], thinking=True)
    assert V32ChatFormat().encode(CONVERSATIONS[0], thinking=True, reasoning_effort="high") == plain
    with pytest.raises(ValueError, match="reasoning_effort"):
        V32ChatFormat().encode(CONVERSATIONS[0], reasoning_effort="extreme")


def test_a_tool_result_without_a_call_to_answer_is_an_error_naming_the_message():
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        V32ChatFormat().encode([{"role": "user", "content": "Hi"}, {"role": "tool", "content": "x"}])


def test_the_checkpoint_encoder_runs_only_when_allowed_and_renders_as_ours(tmp_path):
    from engines.kt.families.deepseek_v32.family import DeepseekV32Family

    (tmp_path / "encoding").mkdir()
    (tmp_path / "encoding" / "encoding_dsv32.py").write_text(CHECKPOINT_ENCODER, encoding="utf-8")
    family = DeepseekV32Family()
    assert isinstance(family.chat_encoder(tmp_path, allow_checkpoint_code=False), V32ChatFormat)
    theirs = family.chat_encoder(tmp_path, allow_checkpoint_code=True)
    assert theirs is not None and not isinstance(theirs, V32ChatFormat) and checkpoint_encoder(tmp_path) is not None
    for messages in CONVERSATIONS:
        for thinking in (False, True):
            for tools in (None, [WEATHER]):
                assert (theirs.encode(messages, tools=tools, thinking=thinking)
                        == V32ChatFormat().encode(messages, tools=tools, thinking=thinking))


def test_a_folder_with_a_jinja_template_and_no_encoder_keeps_its_template_as_v32_exp_shipped(tmp_path):
    from engines.kt.families.deepseek_v32.family import DeepseekV32Family

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert DeepseekV32Family().chat_encoder(tmp_path) is None
    (tmp_path / "encoding").mkdir()
    (tmp_path / "encoding" / "encoding_dsv32.py").write_text(CHECKPOINT_ENCODER, encoding="utf-8")
    assert isinstance(DeepseekV32Family().chat_encoder(tmp_path), V32ChatFormat)


def test_without_the_generation_prompt_the_reply_s_opening_is_left_off():
    class Tokenizer:
        def encode(self, text, add_special_tokens=False):
            return list(text)

    tokenizer = Tokenizer()
    install(tokenizer, V32ChatFormat())
    whole = tokenizer.apply_chat_template(CONVERSATIONS[2], thinking=True)
    assert tokenizer.apply_chat_template(CONVERSATIONS[2], thinking=True, add_generation_prompt=False) + \
        "\n\n" + THINK_START == whole
    assert tokenizer.tool_call_format == V32ChatFormat.tool_parser


def test_function_calls_parse_to_openai_calls_when_streamed_a_character_at_a_time():
    reply = "Let me check." + render_tool_calls([CALL, {**CALL, "function": {"name": "noop", "arguments": "{}"}}])
    parser, content, calls = tool_parser(V32ChatFormat.tool_parser), "", []
    for ch in reply:
        delta = parser.feed(ch)
        content, calls = content + delta.content, calls + delta.calls
    content += parser.finish().content
    assert content == "Let me check." and parser.well_formed
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 2}),
                                                                  ("noop", {})]


def test_v4_s_tool_calls_block_is_content_to_v32_s_parser():
    from engines.kt.families.deepseek_v4.chat import render_tool_calls as v4_calls

    parser = tool_parser(V32ChatFormat.tool_parser)
    out = parser.feed("Hm" + v4_calls([CALL]))
    out.content += parser.finish().content
    assert not parser.calls and out.content.startswith("Hm") and "get_weather" in out.content
