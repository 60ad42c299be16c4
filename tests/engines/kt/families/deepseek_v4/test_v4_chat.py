"""DeepSeek-V4's conversation format (engines/kt/families/deepseek_v4/chat.py), the checkpoint's own encoder
behind trust_remote_code, V4's DSML tool-call markup parsed to OpenAI `tool_calls` (also streamed), and
thinking / non-thinking chats with the tiny V4 served end to end."""
from __future__ import annotations

import json

import pytest

from engines.kt.families.deepseek_v4.chat import (ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER, V4ChatFormat,
                                                  checkpoint_encoder, render_tool_calls)
from server.chat.tool_calls_dsml import DsmlToolParser

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
     {"role": "user", "content": "Weather?"}],
    [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
]

# A stand-in for the release's encoding/encoding_dsv4.py, written here as a plain transcription of the same
# format (no real checkpoint can be downloaded in tests): the opt-in path runs it instead of ours.
CHECKPOINT_ENCODER = '''
import json
B, E, U, A, S, T = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"
D = "｜DSML｜"

def encode_messages(messages, thinking_mode, context=None, drop_thinking=True, add_default_bos_token=True,
                    reasoning_effort=None):
    think = thinking_mode == "thinking"
    users = [i for i, m in enumerate(messages) if m["role"] in ("user", "tool")]
    last = users[-1] if users else -1
    out = B
    for i, m in enumerate(messages):
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if m["role"] == "system":
            out += m["content"]
        elif m["role"] in ("user", "tool"):
            out += (U + m["content"]) if m["role"] == "user" else (U + "<tool_result>" + m["content"] + "</tool_result>")
            if nxt in (None, "assistant"):
                out += A + (S if think and i >= last else T)
        else:
            if think and i > last:
                out += m.get("reasoning_content", "") + T
            out += m["content"]
            for c in m.get("tool_calls", []):
                args = json.loads(c["function"]["arguments"])
                params = "\\n".join('<%sparameter name="%s" string="%s">%s</%sparameter>' % (
                    D, k, "true" if isinstance(v, str) else "false", v if isinstance(v, str) else json.dumps(v), D)
                    for k, v in args.items())
                out += '\\n\\n<%stool_calls>\\n<%sinvoke name="%s">\\n%s\\n</%sinvoke>\\n</%stool_calls>' % (
                    D, D, c["function"]["name"], params, D, D)
            out += E
    return out
'''


def test_a_non_thinking_chat_ends_by_closing_the_thinking():
    text = V4ChatFormat().encode([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}])
    assert text == BOS + "S" + USER + "Hi" + ASSISTANT + THINK_END


def test_a_thinking_chat_opens_the_reasoning_and_drops_earlier_turns_reasoning():
    text = V4ChatFormat().encode(CONVERSATIONS[1], thinking=True)
    assert text.endswith(USER + "Weather?" + ASSISTANT + THINK_START)
    assert "greet back" not in text and ASSISTANT + THINK_END + "Hello!" + EOS in text


def test_reasoning_effort_adds_its_preamble_only_when_thinking():
    high = V4ChatFormat().encode(CONVERSATIONS[0], thinking=True, reasoning_effort="high")
    assert high.startswith(BOS + "Reasoning Effort: Absolute maximum")
    assert V4ChatFormat().encode(CONVERSATIONS[0], reasoning_effort="high") == BOS + USER + "Hi" + ASSISTANT + THINK_END
    with pytest.raises(ValueError, match="reasoning_effort"):
        V4ChatFormat().encode(CONVERSATIONS[0], thinking=True, reasoning_effort="extreme")


def test_tools_are_offered_in_the_system_prompt_and_results_come_back_as_a_user_turn():
    text = V4ChatFormat().encode(CONVERSATIONS[2], tools=[WEATHER])
    assert "## Tools" in text and json.dumps(WEATHER["function"], ensure_ascii=False) in text
    assert render_tool_calls([CALL]) + EOS + USER + "<tool_result>sunny</tool_result>" + ASSISTANT in text


def test_the_checkpoint_encoder_runs_only_when_allowed_and_renders_as_ours(tmp_path):
    from engines.kt.families.deepseek_v4.family import DeepseekV4Family

    (tmp_path / "encoding").mkdir()
    (tmp_path / "encoding" / "encoding_dsv4.py").write_text(CHECKPOINT_ENCODER, encoding="utf-8")
    family = DeepseekV4Family()
    assert isinstance(family.chat_encoder(tmp_path, allow_checkpoint_code=False), V4ChatFormat)
    theirs = family.chat_encoder(tmp_path, allow_checkpoint_code=True)
    assert theirs is not None and not isinstance(theirs, V4ChatFormat)
    assert theirs is not None and checkpoint_encoder(tmp_path) is not None
    for messages in CONVERSATIONS:
        for thinking in (False, True):
            assert theirs.encode(messages, thinking=thinking) == V4ChatFormat().encode(messages, thinking=thinking)


def test_dsml_tool_calls_parse_to_openai_calls_when_streamed_a_character_at_a_time():
    reply = "Let me check." + render_tool_calls([CALL, {**CALL, "function": {"name": "noop", "arguments": "{}"}}])
    parser, content, calls = DsmlToolParser(), "", []
    for ch in reply:
        delta = parser.feed(ch)
        content, calls = content + delta.content, calls + delta.calls
    tail = parser.finish()
    content += tail.content
    assert content == "Let me check." and parser.well_formed
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 2}),
                                                                  ("noop", {})]


def test_broken_dsml_markup_comes_back_as_content():
    text = f"Hm\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"x\" string=\"false\">{{bad</｜DSML｜parameter>\n</｜DSML｜invoke>"
    parser = DsmlToolParser()
    out = parser.feed(text)
    tail = parser.finish()
    assert not parser.calls and (out.content + tail.content).replace("\n", "") == text.replace("\n", "")


def test_v4_thinking_chat_answers_in_reasoning_content_and_plain_chat_does_not(v4_server):
    client = v4_server.openai()
    messages = [{"role": "user", "content": "Say something."}]
    thinking = client.chat.completions.create(model=v4_server.engine.info.id, messages=messages, max_tokens=6,
                                              temperature=0, extra_body={"chat_template_kwargs": {"thinking": True}},
                                              reasoning_effort="high")
    plain = client.chat.completions.create(model=v4_server.engine.info.id, messages=messages, max_tokens=6,
                                           temperature=0)
    assert getattr(thinking.choices[0].message, "reasoning_content", None)
    assert not getattr(plain.choices[0].message, "reasoning_content", None) and plain.choices[0].message.content
