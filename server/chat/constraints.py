"""What a chat request constrains its output to: `response_format` JSON, or a tool call when `tool_choice`
demands one. Both become an engine `Grammar`; the engine's structured-output processor enforces it.

`tool_choice: "required"` constrains the whole reply to one or more DeepSeek-V3 tool calls of the offered
tools (exactly one with `parallel_tool_calls: false`), a named function to exactly one call of it, each call's arguments to that function's parameter
schema; the reply then ends after the call block. `"auto"` leaves the model free and parses what it
writes; `"none"` neither offers the tools in the prompt nor parses calls."""
from __future__ import annotations

import json
from typing import Any

from engines.base import Grammar, InvalidRequestError, json_schema_grammar, lark_json
from server.chat.protocol import ChatCompletionRequest, NamedToolChoice, Tool
from server.chat.tool_calls import ARGS_CLOSE, ARGS_OPEN, CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def check_tool_choice(req: ChatCompletionRequest) -> None:
    names = [t.function.name for t in req.tools or []]
    choice = req.tool_choice
    if choice == "required" and not names:
        raise InvalidRequestError("'tool_choice': 'required' needs 'tools'", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidRequestError(f"'tool_choice' names the function {choice.function.name!r}, which is not "
                                  f"in 'tools'", param="tool_choice")


def request_grammar(req: ChatCompletionRequest, tokenizer: Any) -> Grammar | None:
    """The grammar the reply must follow, or None when it is free."""
    check_tool_choice(req)
    choice = req.effective_tool_choice
    forced_tool = choice == "required" or isinstance(choice, NamedToolChoice)
    fmt = req.response_format
    if forced_tool:
        if fmt is not None and fmt.type != "text":
            raise InvalidRequestError("'response_format' cannot be combined with a 'tool_choice' that forces a "
                                      "tool call", param="response_format")
        only = choice.function.name if isinstance(choice, NamedToolChoice) else None
        return tool_call_grammar(req.tools or [], tokenizer, only, single=req.parallel_tool_calls is False)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_schema_grammar(ANY_OBJECT)
    assert fmt.json_schema is not None  # the protocol model guarantees it
    return json_schema_grammar(fmt.json_schema.json_schema)


def tool_call_grammar(tools: list[Tool], tokenizer: Any, only: str | None = None, single: bool = False) -> Grammar:
    """A Lark grammar of DeepSeek-V3 tool calls: one call of `only`, or one (`single`) or more of any tool."""
    def token(text: str) -> str:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:  # a tokenizer without the V3 markers cannot be steered into the format
            raise InvalidRequestError("this model's tokenizer has no DeepSeek-V3 tool-call tokens, so a tool "
                                      "call cannot be forced", param="tool_choice")
        return f"<[{ids[0]}]>"

    def literal(text: str) -> str:
        return json.dumps(text, ensure_ascii=False)

    offered = [t for t in tools if only is None or t.function.name == only]
    rules = [f"fn_{i}: {literal(t.function.name + chr(10) + ARGS_OPEN)} {lark_json(t.function.parameters or ANY_OBJECT)}"
             for i, t in enumerate(offered)]
    close = ARGS_CLOSE[:-len(CALL_END)]
    repeat = "" if only or single else f' ({literal(chr(10))} call)*'
    lines = [f"start: {token(CALLS_BEGIN)} call{repeat} {token(CALLS_END)}",
             f"call: {token(CALL_BEGIN)} {literal('function')} {token(SEP)} fn {literal(close)} {token(CALL_END)}",
             "fn: " + " | ".join(f"fn_{i}" for i in range(len(offered))), *rules]
    return Grammar("lark", "\n".join(lines) + "\n", param="tools")
