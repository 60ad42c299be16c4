"""DeepSeek-V4's conversation format. The release encodes chats in Python (`encoding/encoding_dsv4.py` in the
model folder, `encode_messages(messages, thinking_mode, ..., reasoning_effort)`), not a jinja template:

    <｜begin▁of▁sentence｜>[effort preamble]SYSTEM[\\n\\n## Tools ...]<｜User｜>USER<｜Assistant｜></think>ANSWER<｜end▁of▁sentence｜>
    <｜User｜>USER<｜Assistant｜><think>          (thinking mode: the reply starts with its reasoning)

An assistant turn is `[reasoning</think>]content[\\n\\n<｜DSML｜tool_calls>...</｜DSML｜tool_calls>]<｜end▁of▁sentence｜>`
(earlier turns' reasoning is dropped unless tools are offered); tool results join the next user turn as
`<tool_result>...</tool_result>` blocks. `V4ChatFormat` is our implementation; `checkpoint_encoder` loads the
release's own file when the user opts in to running code from the model folder (`trust_remote_code`).
What V4 shares with V3.2's format (tokens, DSML markup, the opt-in, how the server sees a format) is
engines/kt/families/dsml_chat.py; `reasoning_effort` ("high" / "max"; thinking only) adds V4's preamble."""
from __future__ import annotations

import json
from pathlib import Path

from engines.kt.families import dsml_chat
from engines.kt.families.dsml_chat import (ASSISTANT, BOS, DSML, EOS, THINK_END, THINK_START, USER,
                                           effort_of)

TOOL_PARSER = "dsml"  # server/chat/tool_calls.py: the DSML parser of `<｜DSML｜tool_calls>` blocks
ENCODER_FILE = "encoding_dsv4.py"
EFFORTS = {
    "high": ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
             "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
             "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
             "adversarial scenarios.\n"
             "Explicitly write out your entire deliberation process, documenting every intermediate step, "
             "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
             "unchecked.\n\n"),
    "max": ("Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
            "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
            "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
            "resolve the underlying cause rather than any surface symptom.\n"
            "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
            "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"),
}
TOOLS_PREAMBLE = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

"""
TOOLS_CLOSING = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"


def render_tool_calls(calls: list[dict]) -> str:
    """An assistant's OpenAI `tool_calls` in V4's DSML markup (a `<｜DSML｜tool_calls>` block)."""
    return dsml_chat.render_tool_calls(calls, "tool_calls")


class V4ChatFormat:
    """Our implementation of `encode_messages`, for OpenAI-style messages (system / user / assistant / tool)."""

    reasoning_parser = "deepseek_r1"
    tool_parser = TOOL_PARSER

    def encode(self, messages: list[dict], tools: list[dict] | None = None, thinking: bool = False,
               reasoning_effort: str | None = None) -> str:
        effort = effort_of(reasoning_effort)
        turns = _merge_tool_results(messages)
        last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=-1)
        keep_reasoning = bool(tools)  # with tools, earlier turns keep their reasoning (calls depend on it)
        text = BOS + (EFFORTS.get(effort, "") if thinking else "")
        if tools and not any(m["role"] == "system" for m in turns):
            turns.insert(0, {"role": "system", "content": ""})
            last_user += 1
        for i, m in enumerate(turns):
            if m["role"] == "system":
                text += m.get("content") or ""
                if tools:
                    text += "\n\n" + TOOLS_PREAMBLE + "\n".join(
                        json.dumps(t["function"], ensure_ascii=False) for t in tools) + TOOLS_CLOSING
            elif m["role"] == "user":
                text += USER + m["content"]
                if i + 1 == len(turns) or turns[i + 1]["role"] == "assistant":
                    opens = thinking and (keep_reasoning or i >= last_user)
                    text += ASSISTANT + (THINK_START if opens else THINK_END)
            elif m["role"] == "assistant":
                if thinking and (keep_reasoning or i > last_user):
                    text += (m.get("reasoning_content") or "") + THINK_END
                text += m.get("content") or ""
                if m.get("tool_calls"):
                    text += render_tool_calls(m["tool_calls"])
                text += EOS
            else:
                raise ValueError(f"messages[{i}].role: {m['role']!r} is not one V4's format has")
        return text


def _merge_tool_results(messages: list[dict]) -> list[dict]:
    """Tool results become `<tool_result>` blocks of a user turn, joined with the user text that follows."""
    out: list[dict] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "tool":
            block = f"<tool_result>{content}</tool_result>"
            if out and out[-1]["role"] == "user" and out[-1].get("merged"):
                out[-1]["content"] += "\n\n" + block
            else:
                out.append({"role": "user", "content": block, "merged": True})
        elif role == "user" and out and out[-1]["role"] == "user" and out[-1].get("merged"):
            out[-1]["content"] += "\n\n" + content
            out[-1]["merged"] = False
        else:
            out.append({**m, "content": content})
    return out


def checkpoint_encoder(model_path: Path) -> dsml_chat.CheckpointChatFormat | None:
    """The model folder's `encoding/encoding_dsv4.py`, imported; None when the folder has none."""
    return dsml_chat.checkpoint_encoder(model_path, ENCODER_FILE, TOOL_PARSER, takes_effort=True)
