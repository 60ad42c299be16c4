"""POST /v1/responses through the chat path: the request becomes a chat completion (protocol.py), runs as
one, and its reply — whole, or delta by delta — becomes the response's output items (output.py)."""
from __future__ import annotations

import re
import time
from typing import Any, AsyncIterator, Sequence

from fastapi import Request

from engines.base import InvalidRequestError
from server.chat.output import ChatDelta
from server.chat.serving import ChatOptions, ChatPlan, ChatServing
from server.chat.tool_call_parsing import ToolCallDelta
from server.responses.output import OutputBuilder, item_id
from server.responses.protocol import ResponsesRequest
from server.serving import ChoiceHandle, Event, StreamError, stream_response, typed_sse
from server.tracking import tracker_of


def refuse_unsupported(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise InvalidRequestError("previous_response_id is not supported: this server stores no responses; send "
                                  "the whole conversation in 'input'", param="previous_response_id")
    if req.background:
        raise InvalidRequestError("background responses are not supported: this server stores no responses",
                                  param="background")


# A request runs as a chat completion; what the chat path refuses is worded in this API's field names.
RESPONSES_NAMES = {"messages": "input", "max_tokens": "max_output_tokens"}
_CHAT_NAME = re.compile(r"\b(" + "|".join(RESPONSES_NAMES) + r")\b")


def in_responses_terms(exc: InvalidRequestError) -> InvalidRequestError:
    def rename(text: str) -> str:
        return _CHAT_NAME.sub(lambda m: RESPONSES_NAMES[m.group(1)], text)
    return InvalidRequestError(rename(str(exc)), param=None if exc.param is None else rename(exc.param))


class ResponsesServing:
    def __init__(self, chat: ChatServing):
        self.chat = chat

    async def create(self, req: ResponsesRequest, raw: Request):
        refuse_unsupported(req)
        tracker = tracker_of(raw)
        try:
            plan = await self.chat.plan(req.chat(), ChatOptions.of(raw))
        except InvalidRequestError as exc:
            raise in_responses_terms(exc) from None
        handles = self.chat.submit(plan, tracker)
        response = Response(plan, req)
        if req.stream:
            return stream_response(tracker, self._stream(response, handles), handles, typed_sse(response.failed))
        [(out, reply)] = await self.chat.replies(raw, tracker, plan, handles)
        calls = [ToolCallDelta(i, c["id"], c["function"]["name"], c["function"]["arguments"])
                 for i, c in enumerate(reply.tool_calls or [])]
        response.builder.add(ChatDelta(reply.reasoning or "", reply.content or "", calls))
        return response.finish(out.finish_reason, out.completion_tokens)

    async def _stream(self, response: "Response", handles: Sequence[ChoiceHandle]) -> AsyncIterator[Event]:
        builder = response.builder
        yield builder.event("response.created", response=response.body("in_progress"))
        yield builder.event("response.in_progress", response=response.body("in_progress"))
        try:
            async for event in self.chat.events(response.plan, handles):
                out = event.output
                if event.finish_reason == "error":
                    yield StreamError(out.error or "generation failed", code="server_error")
                    return
                for item_event in builder.add(event.delta):
                    yield item_event
                if event.finish_reason is not None:
                    final = response.finish(out.finish_reason, out.completion_tokens)
                    for item_event in response.closing_events:
                        yield item_event
                    kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
                    yield builder.event(kind, response=final)
        except TimeoutError:
            yield StreamError(f"the request did not finish within {self.chat.request_timeout:g} seconds",
                              code="request_timeout")


class Response:
    """The response object being built for one request."""

    def __init__(self, plan: ChatPlan, req: ResponsesRequest):
        self.plan, self.req = plan, req
        self.id = item_id("resp")
        self.created_at = int(time.time())
        self.builder = OutputBuilder()
        self.closing_events: list[dict[str, Any]] = []

    def body(self, status: str, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.plan.model, "output": self.builder.items, "incomplete_details": None,
                "usage": None, **self.req.echo(), **extra}

    def finish(self, finish_reason: str | None, output_tokens: int) -> dict[str, Any]:
        """The final object: "incomplete" when max_output_tokens cut the output."""
        cut = finish_reason == "length"
        self.closing_events = self.builder.close("incomplete" if cut else "completed")
        input_tokens = len(self.plan.prompt)
        usage = {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": input_tokens + output_tokens}
        details = {"reason": "max_output_tokens"} if cut else None
        return self.body("incomplete" if cut else "completed", incomplete_details=details, usage=usage)

    def failed(self, error: StreamError) -> dict[str, Any]:
        """The event that ends a stream that failed: the response, "failed", with the error's code."""
        return self.builder.event("response.failed", response=self.body(
            "failed", error={"code": error.code, "message": error.message}))
