"""Ollama requests through the chat serving path: the same prompt rendering, sampling, constraints,
reasoning and tool-call parsing as /v1/chat/completions, answered in Ollama's shapes — one JSON body, or
newline-delimited JSON chunks ending with a `done: true` object that carries the counts and durations."""
from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engines.base import Engine
from server.chat.output import ChatDelta, ChatReply
from server.chat.prompt import Prompt, render_prompt
from server.chat.protocol import ChatCompletionRequest
from server.chat.serving import ChatOptions, ChatPlan, ChatServing
from server.errors import OLLAMA_PREFIX, APIError, to_api_error, wire_error
from server.ollama.protocol import ChatRequest, GenerateRequest, tagged, timestamp
from server.reasoning import prompt_opens_reasoning
from server.serving import (
    ChoiceHandle, Event, Framing, StreamError, cancel_all, encode, stream_response, while_connected,
)
from server.tracking import tracker_of


def ollama_error(exc: Exception) -> JSONResponse:
    """Ollama's error body, `{"error": "..."}`, with the status the OpenAI routes would give."""
    body, status, headers = wire_error(OLLAMA_PREFIX, to_api_error(exc))
    return JSONResponse(body, status_code=status, headers=headers)


class Timing:
    """Ollama's durations, in nanoseconds: prompt evaluation lasts until the first delta arrives."""

    def __init__(self) -> None:
        self.start = time.perf_counter_ns()
        self.first: int | None = None

    def mark(self) -> None:
        if self.first is None:
            self.first = time.perf_counter_ns()

    def durations(self) -> dict[str, int]:
        end = time.perf_counter_ns()
        first = self.first or end
        return {"total_duration": end - self.start, "load_duration": 0,
                "prompt_eval_duration": first - self.start, "eval_duration": end - first}


def tool_calls_json(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tool calls -> Ollama's, whose arguments are an object rather than a JSON string. Complete calls
    only: Ollama sends a call once, with its arguments parsed (a call cut off by the token limit is dropped)."""
    out = []
    for c in calls:
        try:
            args = json.loads(c["function"]["arguments"])
        except ValueError:
            continue
        out.append({"function": {"name": c["function"]["name"], "arguments": args}})
    return out


def done_reason(finish_reason: str | None) -> str:
    return "length" if finish_reason == "length" else "stop"


def _ndjson_response(body: AsyncIterator[str], headers: dict[str, str] | None) -> StreamingResponse:
    return StreamingResponse(body, media_type="application/x-ndjson", headers=headers)


# Ollama's streams: one JSON object a line, errors as `{"error": "..."}`, no end marker (the last object says
# `done: true`).
NDJSON = Framing(frame=lambda event: json.dumps(event, ensure_ascii=False) + "\n",
                 error=lambda error: {"error": error.message}, respond=_ndjson_response)


class OllamaServing:
    def __init__(self, chat: ChatServing):
        self.chat = chat

    @property
    def engine(self) -> Engine:
        return self.chat.engine

    async def chat_reply(self, body: ChatRequest, raw: Request):
        plan = await self.chat.plan(body.openai(), ChatOptions.of(raw))
        return await self._run(plan, raw, body.stream, chat=True)

    async def generate(self, body: GenerateRequest, raw: Request):
        req = body.openai()
        options = ChatOptions.of(raw)
        prompt = None
        if body.raw or body.context:
            prompt = await self._raw_prompt(body, req, options)
        plan = await self.chat.plan(req, options, prompt)
        return await self._run(plan, raw, body.stream, chat=False)

    async def _raw_prompt(self, body: GenerateRequest, req: ChatCompletionRequest, options: ChatOptions) -> Prompt:
        """`raw` sends the prompt as it is; `context` (the ids a previous reply returned) goes before it."""
        tokenizer = self.engine.tokenizer
        text = body.prompt if body.raw else (await render_prompt(self.engine, req, options.force_think)).text
        if body.context:
            self.engine.check_token_ids(body.context, "context")
            ids = await encode(tokenizer, text, add_special_tokens=False)
            ids = list(body.context) + (ids[1:] if ids[:1] == [tokenizer.bos_token_id] else ids)
        else:
            ids = await encode(tokenizer, text)  # as /v1/completions encodes a prompt
        return Prompt(ids, text, prompt_opens_reasoning(text))

    async def _run(self, plan: ChatPlan, raw: Request, stream: bool, chat: bool):
        timing = Timing()
        tracker = tracker_of(raw)
        handles = self.chat.submit(plan, tracker)
        if stream:
            return stream_response(tracker, self._stream(plan, handles, timing, chat), handles, NDJSON)
        # a client that leaves ends the generation, as on the OpenAI routes (the stream ends with its response)
        reply, output_ids, eval_count = await while_connected(raw, tracker, self._whole(plan, handles, timing), None)
        body = self._head(plan)
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": reply.content or ""}
            if reply.reasoning:
                message["thinking"] = reply.reasoning
            if reply.tool_calls:
                message["tool_calls"] = tool_calls_json(reply.tool_calls)
            body["message"] = message
        else:
            body["response"] = reply.content or ""
            if reply.reasoning:
                body["thinking"] = reply.reasoning
            body["context"] = plan.prompt + output_ids
        return {**body, **self._done(plan, reply.finish_reason, eval_count, timing)}

    async def _whole(self, plan: ChatPlan, handles: Sequence[ChoiceHandle], timing: Timing
                     ) -> tuple[ChatReply, list[int], int]:
        """Run the request to its end, timing its first delta: (reply, output ids, output token count)."""
        text: list[str] = []
        ids: list[int] = []
        try:
            async for event in self.chat.events(plan, handles):
                timing.mark()
                out = event.output
                if event.finish_reason == "error":
                    raise APIError(500, out.error or "generation failed", type="internal_error")
                text.append(out.text)
                ids += out.token_ids
                if event.finish_reason is not None:
                    reply = plan.output_parser().reply("".join(text), out.finish_reason)
                    return reply, ids, out.completion_tokens
        except TimeoutError:
            raise APIError(408, f"the request did not finish within {self.chat.request_timeout:g} seconds",
                           type="timeout_error", code="request_timeout") from None
        finally:
            cancel_all(handles)
        raise APIError(500, "the generation ended without a final delta", type="internal_error")

    def _head(self, plan: ChatPlan) -> dict[str, Any]:
        return {"model": tagged(plan.model), "created_at": timestamp()}

    def _done(self, plan: ChatPlan, finish_reason: str | None, eval_count: int, timing: Timing) -> dict[str, Any]:
        return {"done": True, "done_reason": done_reason(finish_reason), "prompt_eval_count": len(plan.prompt),
                "eval_count": eval_count, **timing.durations()}

    async def _stream(self, plan: ChatPlan, handles: Sequence[ChoiceHandle], timing: Timing, chat: bool
                      ) -> AsyncIterator[Event]:
        calls: dict[int, dict[str, Any]] = {}
        output_ids: list[int] = []
        try:
            async for event in self.chat.events(plan, handles):
                timing.mark()
                out = event.output
                output_ids += out.token_ids
                if event.finish_reason == "error":
                    yield StreamError.of(out)
                    return
                _collect_calls(calls, event.delta)
                if event.delta.content or event.delta.reasoning:
                    yield {**self._head(plan), **_piece(event.delta, chat), "done": False}
                if event.finish_reason is not None:
                    final = {**self._head(plan), **_piece(ChatDelta(), chat)}
                    if calls and chat:
                        complete = tool_calls_json([calls[i] for i in sorted(calls)])
                        yield {**self._head(plan), "message": {
                            "role": "assistant", "content": "", "tool_calls": complete}, "done": False}
                    if not chat:
                        final["context"] = plan.prompt + output_ids
                    yield {**final, **self._done(plan, event.finish_reason, out.completion_tokens, timing)}
        except TimeoutError:
            yield StreamError(f"the request did not finish within {self.chat.request_timeout:g} seconds",
                              "timeout_error", "request_timeout")


def _piece(delta: ChatDelta, chat: bool) -> dict[str, Any]:
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": delta.content}
        if delta.reasoning:
            message["thinking"] = delta.reasoning
        return {"message": message}
    piece: dict[str, Any] = {"response": delta.content}
    if delta.reasoning:
        piece["thinking"] = delta.reasoning
    return piece


def _collect_calls(calls: dict[int, dict[str, Any]], delta: ChatDelta) -> None:
    for d in delta.tool_calls:
        if d.id is not None:
            calls[d.index] = {"function": {"name": d.name, "arguments": d.arguments}}
        else:
            calls[d.index]["function"]["arguments"] += d.arguments
