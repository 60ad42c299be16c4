"""What every OpenAI endpoint does the same way: resolve the model name, submit one engine request per
choice, and either stream the deltas as SSE or collect them, cancelling the engine work when the client
goes away."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request
from sse_starlette.sse import EventSourceResponse

from engines.base import (
    Engine, GenerationOutput, GenerationRequest, InvalidRequestError, NotFoundError, RequestHandle, SamplingParams,
)
from server.tracking import current_tracker

DISCONNECT_POLL_SECONDS = 0.25
# Prompts at least this long are tokenized on a worker thread: the tokenizers library releases the GIL, so a
# megabyte-sized prompt (seconds of tokenizing) does not stall every other request on the event loop.
OFF_LOOP_CHARACTERS = 16_384


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def encode(tokenizer: Any, text: str, **kwargs: Any) -> list[int]:
    """`tokenizer.encode(text, **kwargs)`, off the event loop when the text is long."""
    if len(text) < OFF_LOOP_CHARACTERS:
        return tokenizer.encode(text, **kwargs)
    return await asyncio.to_thread(tokenizer.encode, text, **kwargs)


def resolve_adapter(engine: Engine, model: str | None) -> str | None:
    """The `model` field selects the base model (None or its id) or a loaded adapter by name — it is only
    ever a name, never a path that would be opened."""
    if model is None or model == engine.info.id:
        return None
    if any(a.name == model for a in engine.list_adapters()):
        return model
    known = [engine.info.id] + [a.name for a in engine.list_adapters()]
    raise NotFoundError(f"the model '{model}' does not exist; this server serves: {', '.join(known)}",
                        param="model")


def check_capacity(engine: Engine, choices: int, param: str = "n") -> None:
    """A request needs one engine slot per choice; more than the engine ever holds at once (generating plus
    waiting) can never be served, now or later: 400, not the 429 that says "retry"."""
    config = engine.config
    capacity = config.max_concurrent + config.max_queue
    if choices > capacity:
        raise InvalidRequestError(
            f"this request needs {choices} generations at once, but this server holds at most {capacity} "
            f"(max_concurrent {config.max_concurrent} + max_queue {config.max_queue})", param=param)


def submit_choices(engine: Engine, prompt: list[int], params: list[SamplingParams], adapter: str | None,
                   request_id: str) -> list[RequestHandle]:
    """Submit one engine request per choice; if one is refused, cancel the ones already queued. The handles
    come back wrapped so the request's tracker sees their deltas."""
    tracker = current_tracker()
    tracker.model = adapter or engine.info.id
    handles: list[RequestHandle] = []
    try:
        for i, p in enumerate(params):
            handles.append(engine.submit(GenerationRequest(
                prompt_token_ids=prompt, sampling=p, adapter=adapter, request_id=f"{request_id}-{i}")))
    except Exception:
        for h in handles:
            h.cancel()
        raise
    return tracker.track(handles, len(prompt))  # type: ignore[return-value]  # a RequestHandle in all but name


async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, GenerationOutput]]:
    """Deltas of several handles as they arrive, tagged with the handle's index."""
    if len(handles) == 1:
        async for out in handles[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, GenerationOutput]] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        async for out in handle:
            queue.put_nowait((index, out))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            index, out = await queue.get()
            yield index, out
            remaining -= out.finished
    finally:
        for t in tasks:
            t.cancel()


def cancel_all(handles: list[RequestHandle]) -> None:
    for h in handles:
        h.cancel()


async def collect(request: Request, handles: list[RequestHandle], timeout: float | None) -> list[GenerationOutput]:
    """Wait for every choice, cancelling the engine work if the client disconnects or time runs out."""
    from server.errors import APIError

    tracker = current_tracker()
    results = asyncio.gather(*(h.result() for h in handles))
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            done, _ = await asyncio.wait({results}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                outputs = results.result()
                if any(o.error is not None and o.error == tracker.shutdown_message for o in outputs):
                    raise APIError(503, tracker.shutdown_message, type="service_unavailable",
                                   code="server_shutdown", headers={"Retry-After": "5"})
                return outputs
            if await request.is_disconnected():
                # An answer nobody will read, logged as 499 (nginx's "client closed request"). Raising
                # CancelledError instead would make uvicorn log a traceback for every client that gives up.
                tracker.error = "client_disconnected"
                raise APIError(499, "the client closed the connection before the answer was ready",
                               code="client_disconnected")
            if deadline is not None and time.monotonic() > deadline:
                tracker.error = "request_timeout"
                raise APIError(408, f"the request did not finish within {timeout:g} seconds",
                               type="timeout_error", code="request_timeout")
    finally:
        if not results.done():
            results.cancel()
            results.add_done_callback(_retrieve)  # else asyncio logs the cancelled gather's exception
            cancel_all(handles)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def sse_response(events: AsyncIterator[dict[str, Any]], handles: list[RequestHandle],
                 headers: dict[str, str] | None = None, *, typed_events: bool = False) -> EventSourceResponse:
    """Stream JSON chunks as `data:` lines and end with `data: [DONE]` — or, with `typed_events` (the
    Responses API), give each an `event:` line naming its `type` and end without a marker. sse-starlette
    cancels the generator when the client disconnects; cancelling the handles then frees the engine's work."""
    tracker = current_tracker()

    async def body() -> AsyncIterator[dict[str, str]]:
        complete = False
        try:
            async for chunk in events:
                if "error" in chunk:
                    chunk = tracker.stream_error(chunk)
                message = {"data": json.dumps(chunk, ensure_ascii=False)}
                if typed_events:
                    message["event"] = chunk["type"]
                yield message
            if not typed_events:
                yield {"data": "[DONE]"}
            complete = True
        finally:
            if not complete:
                tracker.error = tracker.error or "client_disconnected"
            cancel_all(handles)

    return EventSourceResponse(body(), sep="\n", ping=15, headers=headers)


def error_chunk(message: str, type: str = "internal_error", code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


@dataclass
class Deadline:
    """A per-request time limit for streams (non-streaming uses `collect`'s timeout)."""

    seconds: float | None
    start: float = field(default_factory=time.monotonic)

    def remaining(self) -> float | None:
        return None if self.seconds is None else self.seconds - (time.monotonic() - self.start)


async def with_deadline(stream: AsyncIterator[tuple[int, GenerationOutput]], deadline: Deadline
                        ) -> AsyncIterator[tuple[int, GenerationOutput]]:
    """Pass deltas through until the deadline; then raise TimeoutError (the caller reports it)."""
    iterator = stream.__aiter__()
    while True:
        remaining = deadline.remaining()
        try:
            if remaining is None:
                item = await iterator.__anext__()
            else:
                item = await asyncio.wait_for(iterator.__anext__(), timeout=max(remaining, 0.001))
        except StopAsyncIteration:
            return
        yield item
