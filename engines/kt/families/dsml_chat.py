"""What DeepSeek's Python-encoded conversation formats share (V3.2's `encoding/encoding_dsv32.py`, V4's
`encoding/encoding_dsv4.py`; each family's chat.py holds what differs): the special tokens, the DSML tool-call
markup (a `<｜DSML｜BLOCK>` of `<｜DSML｜invoke>`s, BLOCK being `function_calls` in V3.2 and `tool_calls` in V4),
the `reasoning_effort` values, running the release's own encoder when the user opts in (trust_remote_code), and
installing a format as the tokenizer's `apply_chat_template`.

    <｜begin▁of▁sentence｜>SYSTEM<｜User｜>USER<｜Assistant｜></think>ANSWER<｜end▁of▁sentence｜>
    <｜User｜>USER<｜Assistant｜><think>          (thinking mode: the reply starts with its reasoning)

The server sees a format through `install`: `apply_chat_template(messages, tools, thinking=, reasoning_effort=)`
(request options `chat_template_kwargs.thinking` and `reasoning_effort`), `tool_call_format` naming the
tool-call parser (server/chat/tool_calls_dsml.py); replies are split by the `<think>` reasoning parser."""
from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any, Callable

from engines.base import InvalidRequestError

log = logging.getLogger("ktserve.engine.kt")

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"
EFFORTS = ("low", "medium", "high", "max")


def effort_of(value: Any) -> str:
    """The request's reasoning_effort: "low" (also for none and "medium", the default), "high" or "max"."""
    if value in (None, "", "low", "medium"):
        return "low"
    if value not in EFFORTS:
        raise ValueError(f"reasoning_effort: {value!r} is not one of {', '.join(EFFORTS)}")
    return value


def render_tool_calls(calls: list[dict], block: str) -> str:
    """An assistant's OpenAI `tool_calls` in DSML markup inside `<｜DSML｜{block}>` (strings as they are, other
    values as JSON), with the blank line that separates it from the content."""
    invokes = []
    for call in calls:
        function = call["function"]
        arguments = function.get("arguments") or "{}"
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        params = [f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
                  f'{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}</{DSML}parameter>'
                  for key, value in arguments.items()]
        invokes.append(f'<{DSML}invoke name="{function["name"]}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return f"\n\n<{DSML}{block}>\n" + "\n".join(invokes) + f"\n</{DSML}{block}>"


def with_tools_on_system(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The messages with `tools` on the system message (one added first when there is none), where the releases'
    encoders read them."""
    messages = [dict(m) for m in messages]
    if tools:
        if not messages or messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": ""})
        messages[0]["tools"] = tools
    return messages


class CheckpointChatFormat:
    """A release's own `encode_messages`, run from the model folder (trust_remote_code only)."""

    def __init__(self, encode_messages: Callable[..., str], tool_parser: str, takes_effort: bool):
        self._encode_messages = encode_messages
        self.reasoning_parser = "deepseek_r1"
        self.tool_parser = tool_parser
        self._takes_effort = takes_effort  # V4's takes reasoning_effort; V3.2's has no such setting

    def encode(self, messages: list[dict], tools: list[dict] | None = None, thinking: bool = False,
               reasoning_effort: str | None = None) -> str:
        effort = effort_of(reasoning_effort)
        kwargs = {"reasoning_effort": None if effort == "low" else effort} if self._takes_effort else {}
        return self._encode_messages(with_tools_on_system(messages, tools),
                                     thinking_mode="thinking" if thinking else "chat", **kwargs)


def checkpoint_encoder(model_path: Path, file_name: str, tool_parser: str,
                       takes_effort: bool) -> CheckpointChatFormat | None:
    """The model folder's `encoding/<file_name>`, imported; None when the folder has none."""
    path = Path(model_path) / "encoding" / file_name
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(f"ktserve_checkpoint_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    if not callable(getattr(module, "encode_messages", None)):
        raise ValueError(f"model: {path} has no encode_messages function")
    return CheckpointChatFormat(module.encode_messages, tool_parser, takes_effort)


def choose_encoder(model_path: Path, allow_checkpoint_code: bool, ours: Any, file_name: str,
                   takes_effort: bool) -> Any:
    """The release's `encoding/<file_name>` when the user allows running the model folder's code
    (trust_remote_code) and the folder has it, else `ours` (said once in the log either way)."""
    if allow_checkpoint_code:
        encoder = checkpoint_encoder(model_path, file_name, ours.tool_parser, takes_effort)
        if encoder is not None:
            log.info("chat format: the checkpoint's encoding/%s (trust_remote_code)", file_name)
            return encoder
    elif (Path(model_path) / "encoding" / file_name).is_file():
        log.info("chat format: ktserve's implementation of encoding/%s (the model folder's own runs only with "
                 "trust_remote_code)", file_name)
    return ours


GENERATION_PROMPTS = tuple(lead + token for lead in (ASSISTANT, "\n\n") for token in (THINK_START, THINK_END))


def check_request(messages: list[dict], thinking: Any, reasoning_effort: Any, replying: bool) -> None:
    """What the formats take from a request, checked before rendering: each wrong value is a 400 naming its
    field (`thinking` and `reasoning_effort` reach a format through `chat_template_kwargs`, where no schema
    checks them; a call's arguments must be a JSON object, as the DSML markup writes one parameter per key).
    A reply (`replying`) answers the last message, a user or tool one: the formats open the assistant's turn only
    after those (after a system or assistant message the model would go on writing that message)."""
    if thinking is not None and not isinstance(thinking, bool):
        raise InvalidRequestError(f"chat_template_kwargs.thinking: {thinking!r} is not true or false",
                                  param="chat_template_kwargs.thinking")
    try:
        effort_of(reasoning_effort)
    except ValueError:
        raise InvalidRequestError(f"chat_template_kwargs.reasoning_effort: {reasoning_effort!r} is not one of "
                                  f"{', '.join(EFFORTS)}", param="chat_template_kwargs.reasoning_effort") from None
    last = messages[-1].get("role") if messages else None
    if replying and last not in ("user", "tool"):
        raise InvalidRequestError(f"messages[{len(messages) - 1}]: the conversation ends with a {last} message; a "
                                  f"reply follows a user or tool message (DeepSeek's format opens the assistant's "
                                  f"turn only after one)", param="messages")
    for i, m in enumerate(messages):
        for j, call in enumerate(m.get("tool_calls") or []):
            _check_arguments(call["function"].get("arguments"), f"messages[{i}].tool_calls[{j}].function.arguments")


def _check_arguments(arguments: Any, field: str) -> None:
    if arguments is None or isinstance(arguments, dict):
        return
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError as exc:
        raise InvalidRequestError(f"{field}: not JSON ({exc})", param=field) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{field}: a JSON object of the call's parameters is needed, got "
                                  f"{type(value).__name__}", param=field)


def install(tokenizer: Any, encoder: Any) -> None:
    """Make `encoder` the tokenizer's chat format: the server renders chats through `apply_chat_template`
    and picks its tool-call parser by `tool_call_format`."""
    def apply_chat_template(messages, tools=None, tokenize=False, add_generation_prompt=True, thinking=False,
                            reasoning_effort=None, **_: Any):
        check_request(list(messages), thinking, reasoning_effort, add_generation_prompt)
        text = encoder.encode(list(messages), tools=tools, thinking=bool(thinking), reasoning_effort=reasoning_effort)
        if not add_generation_prompt:  # the reply's opening (after a user turn, or after tool results in V3.2)
            text = next((text[:-len(p)] for p in GENERATION_PROMPTS if text.endswith(p)), text)
        return tokenizer.encode(text, add_special_tokens=False) if tokenize else text

    tokenizer.apply_chat_template = apply_chat_template
    tokenizer.tool_call_format = encoder.tool_parser
