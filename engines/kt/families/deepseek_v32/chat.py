"""DeepSeek-V3.2's conversation format. The final release encodes chats in Python (`encoding/encoding_dsv32.py` in
the model folder, `encode_messages(messages, thinking_mode)`), not a jinja template:

    <｜begin▁of▁sentence｜>SYSTEM[\\n\\n## Tools ...<functions>...</functions>]<｜User｜>USER<｜Assistant｜></think>
    ANSWER[\\n\\n<｜DSML｜function_calls>...</｜DSML｜function_calls>]<｜end▁of▁sentence｜>
    \\n\\n<function_results>\\n<result>RESULT</result>...\\n</function_results>\\n\\n</think>   (after tool calls)

In thinking mode the last user turn (and the tool results after it) open `<think>` instead of closing it, and
assistant turns after the last user turn carry their reasoning before `</think>`; earlier turns' reasoning is
dropped. Unlike V4, tool results follow the calling turn directly (no user turn), the markup's block is
`function_calls`, and there is no reasoning-effort preamble (`reasoning_effort` is accepted and changes nothing).
What V3.2 shares with V4's format is engines/kt/families/dsml_chat.py."""
from __future__ import annotations

import json
from pathlib import Path

from engines.base import InvalidRequestError
from engines.kt.families import dsml_chat
from engines.kt.families.dsml_chat import (ASSISTANT, BOS, DSML, EOS, THINK_END, THINK_START, USER,
                                           effort_of)

TOOL_PARSER = "dsml_function_calls"  # server/chat/tool_calls.py: the DSML parser of `function_calls` blocks
ENCODER_FILE = "encoding_dsv32.py"
TOOLS_PREAMBLE = f"""## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{DSML}function_calls>" block like the following as part of your reply to the user:
<{DSML}function_calls>
<{DSML}invoke name="$FUNCTION_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$FUNCTION_NAME2">
...
</{DSML}invoke>
</{DSML}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<{DSML}function_calls>
...
</{DSML}function_calls>
<function_results>
...
</function_results>
{THINK_START}...thinking about results{THINK_END}
Here are the functions available in JSONSchema format:
<functions>
"""
TOOLS_CLOSING = "\n</functions>\n"


def render_tool_calls(calls: list[dict]) -> str:
    """An assistant's OpenAI `tool_calls` in V3.2's DSML markup (a `<｜DSML｜function_calls>` block)."""
    return dsml_chat.render_tool_calls(calls, "function_calls")


def render_tools(tools: list[dict]) -> str:
    return TOOLS_PREAMBLE + "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools) + TOOLS_CLOSING


class V32ChatFormat:
    """Our implementation of `encode_messages`, for OpenAI-style messages (system / user / assistant / tool)."""

    reasoning_parser = "deepseek_r1"
    tool_parser = TOOL_PARSER

    def encode(self, messages: list[dict], tools: list[dict] | None = None, thinking: bool = False,
               reasoning_effort: str | None = None) -> str:
        effort_of(reasoning_effort)  # checked as for V4; V3.2's format has no effort setting
        turns = dsml_chat.with_tools_on_system(messages, tools)
        added = len(turns) - len(messages)  # the system message the tools were put on, when the request had none
        last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=-1)
        text = BOS
        for i, m in enumerate(turns):
            role, content = m["role"], m.get("content") or ""
            if role == "system":
                text += content + ("\n\n" + render_tools(m["tools"]) if m.get("tools") else "")
            elif role == "user":
                text += USER + content + ASSISTANT + (THINK_START if thinking and i == last_user else THINK_END)
            elif role == "assistant":
                if thinking and i > last_user:
                    text += (m.get("reasoning_content") or "") + THINK_END
                text += content + (render_tool_calls(m["tool_calls"]) if m.get("tool_calls") else "") + EOS
            elif role == "tool":
                text += _tool_result(turns, i, thinking and i >= last_user, f"messages[{i - added}]")
            else:
                raise ValueError(f"messages[{i - added}].role: {role!r} is not one V3.2's format has")
        return text


def _tool_result(turns: list[dict], i: int, opens_thinking: bool, field: str) -> str:
    """The i-th message (the request's `field`), a tool result: the n-th answer to the calling assistant turn's
    n-th call, opening the `<function_results>` block at the first and closing it (and the reply's thinking) at
    the last."""
    caller = i - 1
    while caller >= 0 and turns[caller]["role"] == "tool":
        caller -= 1
    calls = (turns[caller].get("tool_calls") or []) if caller >= 0 and turns[caller]["role"] == "assistant" else []
    order = i - caller
    if order > len(calls):
        raise InvalidRequestError(f"{field}: a tool result without an assistant tool call before it to answer",
                                  param=field)
    text = ("\n\n<function_results>" if order == 1 else "") + f"\n<result>{turns[i].get('content') or ''}</result>"
    if order == len(calls):
        text += "\n</function_results>\n\n" + (THINK_START if opens_thinking else THINK_END)
    return text


def checkpoint_encoder(model_path: Path) -> dsml_chat.CheckpointChatFormat | None:
    """The model folder's `encoding/encoding_dsv32.py`, imported; None when the folder has none."""
    return dsml_chat.checkpoint_encoder(model_path, ENCODER_FILE, TOOL_PARSER, takes_effort=False)
