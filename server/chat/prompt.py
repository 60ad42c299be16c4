"""Chat messages -> prompt token ids, through the chat template the engine's tokenizer carries (the model
directory's own, or the built-in one the `template` setting names)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from engines.base import Engine, InvalidRequestError
from server.chat.protocol import ChatCompletionRequest
from server.reasoning import THINK_START, prompt_opens_reasoning
from server.serving import OFF_LOOP_CHARACTERS

OFF_LOOP_MESSAGES = 256  # conversations this long are rendered on a worker thread whatever their size
# the apply_chat_template arguments rendering sets from the request itself: in `chat_template_kwargs` they are
# not template variables, and would collide with ours ("got multiple values for argument")
RENDER_ARGUMENTS = ("conversation", "messages", "tools", "tokenize", "add_generation_prompt")


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    text: str
    opens_reasoning: bool  # the prompt ends inside <think>: the output starts in the model's reasoning


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    messages = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        messages.append(msg)
    return messages


async def render_prompt(engine: Engine, req: ChatCompletionRequest, force_think: bool = False) -> Prompt:
    """`render_prompt_now`, on a worker thread when the conversation is large: rendering thousands of
    messages or tokenizing megabytes of text takes seconds that would stall every other request."""
    size = sum(len(m.text()) for m in req.messages)
    if size < OFF_LOOP_CHARACTERS and len(req.messages) < OFF_LOOP_MESSAGES:
        return render_prompt_now(engine, req, force_think)
    return await asyncio.to_thread(render_prompt_now, engine, req, force_think)


def render_prompt_now(engine: Engine, req: ChatCompletionRequest, force_think: bool = False) -> Prompt:
    """Apply the chat template; with `force_think` the prompt ends with `<think>\\n` (KTransformers'
    kt_force_think), added when the template did not open the thinking itself. Template errors (e.g.
    roles out of order) are the client's to fix: 400."""
    tokenizer = engine.tokenizer
    offered = req.effective_tool_choice != "none" and req.tools
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if offered else None
    kwargs = dict(req.chat_template_kwargs or {})
    for key in RENDER_ARGUMENTS:
        if key in kwargs:
            raise InvalidRequestError(f"chat_template_kwargs.{key}: not a template variable (the request sets it)",
                                      param=f"chat_template_kwargs.{key}")
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    try:
        text = tokenizer.apply_chat_template(template_messages(req), tools=tools, tokenize=False,
                                             add_generation_prompt=req.add_generation_prompt, **kwargs)
    except InvalidRequestError:  # a format that names the offending field itself
        raise
    except Exception as exc:  # jinja raises TemplateError (and others) for conversations it rejects
        raise InvalidRequestError(f"the chat template cannot render these messages: {exc}",
                                  param="messages") from None
    if force_think and req.add_generation_prompt and not prompt_opens_reasoning(text):
        text += THINK_START + "\n"
    return Prompt(tokenizer.encode(text, add_special_tokens=False), text, prompt_opens_reasoning(text))
