"""POST /v1/chat/completions: messages -> prompt ids (the chat template) -> engine -> OpenAI JSON.

The work is split so other chat-shaped APIs (the Ollama routes) reuse it: `plan()` decides everything about
a request (prompt, sampling, grammar, output parsing), `submit()` hands it to the engine, `events()` turns the
engine's deltas into per-choice `ChatDelta`s and `replies()` collects whole replies."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Sequence

from fastapi import Request

from engines.base import Engine, GenerationOutput, SamplingParams, TokenLogprob
from server.chat.constraints import request_grammar
from server.chat.output import ChatDelta, ChatOutputParser, ChatReply, join_deltas
from server.chat.prompt import Prompt, render_prompt
from server.chat.protocol import ChatCompletionRequest, NamedToolChoice
from server.chat.tool_calls import tool_parser
from server.errors import APIError
from server.protocol import check_max_tokens, usage
from server.reasoning import THINK_END, THINK_START, check_reasoning_parser, reasoning_parser
from server.serving import (
    SSE, ChoiceHandle, Deadline, Event, StreamError, check_capacity, collect, merged, new_id, resolve_adapter,
    stream_response, submit_choices, with_deadline,
)
from server.tracking import RequestTracker, tracker_of


def chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {"content": [{
        "token": e.token, "logprob": e.logprob, "bytes": e.bytes,
        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in e.top],
    } for e in entries]}


@dataclass(slots=True)
class ChatOptions:
    """The server settings chat serving follows."""

    reasoning_parser: str | None = None
    force_think: bool = False

    @classmethod
    def of(cls, raw: Request) -> "ChatOptions":
        settings = raw.app.state.settings
        check_reasoning_parser(settings.reasoning_parser)
        return cls(settings.reasoning_parser, settings.kt_force_think)


@dataclass(slots=True)
class ChatPlan:
    """Everything decided about one chat request before it reaches the engine."""

    request_id: str
    model: str
    adapter: str | None
    prompt: list[int]
    params: list[SamplingParams]
    options: ChatOptions
    starts_in_reasoning: bool
    parse_tools: bool
    named_tool: bool = False  # tool_choice names the function to call
    tool_format: str = "deepseek_v3"  # the model's tool-call markup: its tokenizer's `tool_call_format`

    def output_parser(self) -> ChatOutputParser:
        reasoning = reasoning_parser(self.options.reasoning_parser, self.starts_in_reasoning)
        # without a parser, a reply whose thinking the server opened still shows that opening
        prefix = THINK_START + "\n" if self.options.force_think and reasoning is None else ""
        # a call of the function the request named ends with "stop", as OpenAI and vLLM answer it
        return ChatOutputParser(reasoning, tool_parser(self.tool_format) if self.parse_tools else None, prefix,
                                calls_finish="stop" if self.named_tool else "tool_calls")


@dataclass(slots=True)
class ChoiceEvent:
    """One step of one choice: what it adds to the reply, and the engine's delta it came from."""

    index: int
    delta: ChatDelta
    output: GenerationOutput
    finish_reason: str | None  # set on the choice's last event


class ChatServing:
    def __init__(self, engine: Engine, request_timeout: float | None = None):
        self.engine = engine
        self.request_timeout = request_timeout

    async def plan(self, req: ChatCompletionRequest, options: ChatOptions, prompt: Prompt | None = None) -> ChatPlan:
        """Decide everything about `req`; `prompt` replaces the rendered messages (a raw completion)."""
        engine = self.engine
        adapter = resolve_adapter(engine, req.model)
        check_capacity(engine, req.n)
        prompt = prompt or await render_prompt(engine, req, options.force_think)
        limit = engine.info.max_model_len
        max_tokens = check_max_tokens(req.requested_max_tokens, limit, len(prompt.token_ids), limit, "messages")
        top = (req.top_logprobs or 0) if req.logprobs else None
        vocab = len(engine.tokenizer)
        params = [req.sampling_params(max_tokens=max_tokens, logprobs=top, vocab_size=vocab, choice=i)
                  for i in range(req.n)]
        plan = ChatPlan(new_id("chatcmpl"), req.model or engine.info.id, adapter, prompt.token_ids, params, options,
                        starts_in_reasoning=prompt.opens_reasoning,
                        parse_tools=req.effective_tool_choice != "none",
                        named_tool=isinstance(req.effective_tool_choice, NamedToolChoice),
                        tool_format=getattr(engine.tokenizer, "tool_call_format", "deepseek_v3"))
        grammar = request_grammar(req, engine.tokenizer)
        if grammar is not None:
            if options.reasoning_parser and prompt.opens_reasoning:  # constrain only after </think>
                grammar = replace(grammar, start_after=_single_token(engine.tokenizer, THINK_END))
            await asyncio.to_thread(engine.check_grammar, grammar)  # compiled (and cached) by the engine
            plan.params = [replace(p, grammar=grammar) for p in plan.params]
        return plan

    def submit(self, plan: ChatPlan, tracker: RequestTracker) -> Sequence[ChoiceHandle]:
        return submit_choices(self.engine, tracker, plan.prompt, plan.params, plan.adapter, plan.request_id)

    async def create(self, req: ChatCompletionRequest, raw: Request):
        tracker = tracker_of(raw)
        plan = await self.plan(req, ChatOptions.of(raw))
        handles = self.submit(plan, tracker)
        if req.stream:
            return stream_response(tracker, self._stream(req, plan, handles), handles, SSE)
        replies = await self.replies(raw, tracker, plan, handles)
        return self._response(plan, replies)

    # ---------------------------------------------------------------------------------- whole replies
    async def replies(self, raw: Request, tracker: RequestTracker, plan: ChatPlan,
                      handles: Sequence[ChoiceHandle]) -> list[tuple[GenerationOutput, ChatReply]]:
        outputs = await collect(raw, tracker, handles, self.request_timeout)
        for out in outputs:
            if out.finish_reason == "error":
                raise APIError(500, out.error or "generation failed", type="internal_error")
        return [(out, plan.output_parser().reply(out.text, out.finish_reason)) for out in outputs]

    def _response(self, plan: ChatPlan, replies: list[tuple[GenerationOutput, ChatReply]]) -> dict:
        choices = []
        for i, (out, reply) in enumerate(replies):
            message: dict[str, Any] = {"role": "assistant", "content": reply.content}
            if reply.reasoning is not None:
                message["reasoning_content"] = reply.reasoning
            if reply.tool_calls:
                message["tool_calls"] = reply.tool_calls
            choices.append({"index": i, "message": message, "logprobs": chat_logprobs(out.logprobs),
                            "finish_reason": reply.finish_reason, "stop_reason": out.stop_reason})
        completion = sum(out.completion_tokens for out, _ in replies)
        return {"id": plan.request_id, "object": "chat.completion", "created": int(time.time()),
                "model": plan.model, "choices": choices,
                "usage": usage(len(plan.prompt), completion, replies[0][0].cached_tokens)}

    # ---------------------------------------------------------------------------------- streaming
    async def events(self, plan: ChatPlan, handles: Sequence[ChoiceHandle]) -> AsyncIterator[ChoiceEvent]:
        """Per-choice reply deltas as the engine produces them. Raises TimeoutError past the request timeout;
        an engine error arrives as an event whose output has finish_reason "error"."""
        parsers = [plan.output_parser() for _ in handles]
        async for i, out in with_deadline(merged(handles), Deadline(self.request_timeout)):
            if out.finish_reason == "error":
                yield ChoiceEvent(i, ChatDelta(), out, "error")
                return
            delta = parsers[i].feed(out.text)
            if out.finished:
                delta = join_deltas([delta, parsers[i].finish(out.finish_reason)])
            yield ChoiceEvent(i, delta, out, parsers[i].finish_reason(out.finish_reason) if out.finished else None)

    async def _stream(self, req: ChatCompletionRequest, plan: ChatPlan, handles: Sequence[ChoiceHandle]
                      ) -> AsyncIterator[Event]:
        base = {"id": plan.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": plan.model}
        include_usage = req.include_usage

        def chunk(choices: list[dict], usage_value: Any = None) -> dict[str, Any]:
            body = {**base, "choices": choices}
            if include_usage:
                body["usage"] = usage_value
            return body

        for i in range(len(handles)):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        completion_tokens = [0] * len(handles)
        cached_tokens = 0
        try:
            async for event in self.events(plan, handles):
                i, out = event.index, event.output
                completion_tokens[i] = out.completion_tokens
                cached_tokens = out.cached_tokens if i == 0 else cached_tokens
                if event.finish_reason == "error":
                    yield StreamError.of(out)
                    return
                if event.delta or out.logprobs:
                    yield chunk([{"index": i, "delta": delta_json(event.delta),
                                  "logprobs": chat_logprobs(out.logprobs), "finish_reason": None}])
                if event.finish_reason is not None:
                    yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": event.finish_reason,
                                  "stop_reason": out.stop_reason}])
        except TimeoutError:
            yield StreamError(f"the request did not finish within {self.request_timeout:g} seconds",
                              "timeout_error", "request_timeout")
            return
        if include_usage:
            yield chunk([], usage(len(plan.prompt), sum(completion_tokens), cached_tokens))


def delta_json(delta: ChatDelta) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if delta.reasoning:
        body["reasoning_content"] = delta.reasoning
    if delta.content or not (delta.reasoning or delta.tool_calls):
        body["content"] = delta.content
    if delta.tool_calls:
        body["tool_calls"] = [c.openai() for c in delta.tool_calls]
    return body


def _single_token(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None
