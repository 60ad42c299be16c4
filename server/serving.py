"""What every generating endpoint does the same way: resolve the model name, submit one engine request per
choice, and either stream the deltas (SSE or NDJSON, one helper) or collect them, cancelling the engine work
when the client goes away. The request's tracker is handed to each helper that feeds it."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol, Sequence, TypeVar

from fastapi import Request
from sse_starlette.sse import EventSourceResponse
from starlette.responses import Response

from engines.base import (
    Engine, GenerationOutput, GenerationRequest, InvalidRequestError, NotFoundError, RequestHandle, SamplingParams,
)
from server.errors import APIError
from server.tracking import RequestTracker, TrackedHandle

T = TypeVar("T")
DISCONNECT_POLL_SECONDS = 0.25
SHUTTING_DOWN = "the server is shutting down"  # said when a shutdown output carries no message of its own
# Prompts at least this long are tokenized on a worker thread: the tokenizers library releases the GIL, so a
# megabyte-sized prompt (seconds of tokenizing) does not stall every other request on the event loop.
OFF_LOOP_CHARACTERS = 16_384
# ...and so are this many texts or more, short or not: each costs a tenth of a millisecond of Python.
OFF_LOOP_TEXTS = 32


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def encode(tokenizer: Any, text: str, **kwargs: Any) -> list[int]:
    """`tokenizer.encode(text, **kwargs)`, off the event loop when the text is long."""
    if len(text) < OFF_LOOP_CHARACTERS:
        return tokenizer.encode(text, **kwargs)
    return await asyncio.to_thread(tokenizer.encode, text, **kwargs)


async def encode_all(tokenizer: Any, texts: list[str], **kwargs: Any) -> list[list[int]]:
    """`encode()` of each text; off the event loop, in one go, when they are long together (thousands of
    short texts block the loop as long as one long one)."""
    if len(texts) < OFF_LOOP_TEXTS and sum(map(len, texts)) < OFF_LOOP_CHARACTERS:
        return [tokenizer.encode(t, **kwargs) for t in texts]
    return await asyncio.to_thread(lambda: [tokenizer.encode(t, **kwargs) for t in texts])


def decode_releasing_the_lock(tokenizer: Any, ids: list[int]) -> str:
    """`tokenizer.decode(ids)` for a worker thread. The tokenizers library's `decode` holds the interpreter
    lock while it runs (a million ids: about a second, the event loop stopped all along); its `decode_batch`
    releases it. transformers adds only its space clean-up to the library's text, which is off for the
    byte-level BPE tokenizers DeepSeek's models use; a tokenizer with it on keeps `decode`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode(ids)
    return backend.decode_batch([ids], skip_special_tokens=False)[0]


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


class ChoiceHandle(Protocol):
    """One submitted choice as the serving code uses it: its deltas, its whole output, and a way to abandon
    it. `submit_choices` hands out `TrackedHandle`s; an engine's `RequestHandle` is one too."""

    def __aiter__(self) -> AsyncIterator[GenerationOutput]: ...

    async def result(self) -> GenerationOutput: ...

    def cancel(self) -> None: ...


def submit_choices(engine: Engine, tracker: RequestTracker, prompt: list[int], params: list[SamplingParams],
                   adapter: str | None, request_id: str) -> list[TrackedHandle]:
    """Submit one engine request per choice; if one is refused, cancel the ones already queued. The handles
    come back wrapped so the request's tracker sees their deltas."""
    tracker.model = adapter or engine.info.id
    handles: list[RequestHandle] = []
    try:
        for i, p in enumerate(params):
            handles.append(engine.submit(GenerationRequest(
                prompt_token_ids=prompt, sampling=p, adapter=adapter, request_id=f"{request_id}-{i}",
                priority=tracker.priority)))
    except Exception:
        for h in handles:
            h.cancel()
        raise
    return tracker.track(handles, len(prompt))


async def merged(handles: Sequence[ChoiceHandle]) -> AsyncIterator[tuple[int, GenerationOutput]]:
    """Deltas of several handles as they arrive, tagged with the handle's index."""
    if len(handles) == 1:
        async for out in handles[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, GenerationOutput]] = asyncio.Queue()

    async def pump(index: int, handle: ChoiceHandle) -> None:
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


def cancel_all(handles: Sequence[ChoiceHandle]) -> None:
    for h in handles:
        h.cancel()


async def collect(request: Request, tracker: RequestTracker, handles: Sequence[ChoiceHandle],
                  timeout: float | None) -> list[GenerationOutput]:
    """Wait for every choice, cancelling the engine work if the client disconnects or time runs out."""
    try:
        outputs = await while_connected(request, tracker, asyncio.gather(*(h.result() for h in handles)), timeout)
    except BaseException:
        cancel_all(handles)
        raise
    shutdown = next((o for o in outputs if o.server_shutdown), None)
    if shutdown is not None:
        raise APIError(503, shutdown.error or SHUTTING_DOWN, type="service_unavailable",
                       code="server_shutdown", headers={"Retry-After": "5"})
    return outputs


async def while_connected(request: Request, tracker: RequestTracker, work: Awaitable[T],
                          timeout: float | None) -> T:
    """The result of `work`, for as long as the client waits for it: 499 once the client has gone (polled
    every DISCONNECT_POLL_SECONDS), 408 past `timeout`. Either way `work` is cancelled, and whatever it
    submitted to the engine should be cancelled by it (or by the caller)."""
    task = asyncio.ensure_future(work)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
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
        if not task.done():
            task.cancel()
            task.add_done_callback(_retrieve)  # else asyncio logs the cancelled task's exception


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


@dataclass(frozen=True, slots=True)
class StreamError:
    """The error that ends a stream: noted by the request's tracker, sent in the endpoint's own shape."""

    message: str
    type: str = "internal_error"
    code: str | None = None

    @classmethod
    def of(cls, out: GenerationOutput) -> StreamError:
        """What a choice that ended in error ends its stream with; a shutdown is labelled as one."""
        if out.server_shutdown:
            return cls(out.error or SHUTTING_DOWN, "service_unavailable", "server_shutdown")
        return cls(out.error or "generation failed")

    def openai(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": None, "code": self.code}}


Event = dict[str, Any] | StreamError  # what an endpoint's event generator yields


@dataclass(frozen=True, slots=True)
class Framing:
    """How a streaming endpoint puts its JSON events on the wire: `frame` turns one into what the response
    body yields, `error` turns a `StreamError` into the endpoint's error event, `end` follows the last event
    of a stream that ran to its end, and `respond` wraps the body in the response."""

    frame: Callable[[dict[str, Any]], Any]
    error: Callable[[StreamError], dict[str, Any]]
    respond: Callable[[AsyncIterator[Any], dict[str, str] | None], Response]
    end: tuple[Any, ...] = ()


def _json(event: dict[str, Any]) -> str:
    return json.dumps(event, ensure_ascii=False)


def _event_source(body: AsyncIterator[Any], headers: dict[str, str] | None) -> Response:
    # sse-starlette cancels the body when the client disconnects
    return EventSourceResponse(body, sep="\n", ping=15, headers=headers)


# OpenAI's chat and completion streams: `data: {...}` lines, OpenAI error objects, `data: [DONE]` at the end.
SSE = Framing(frame=lambda event: {"data": _json(event)}, error=StreamError.openai, respond=_event_source,
              end=({"data": "[DONE]"},))


def typed_sse(error: Callable[[StreamError], dict[str, Any]]) -> Framing:
    """The Responses API's stream: an `event:` line naming each event's `type`, errors as the endpoint's own
    events, and no end marker."""
    return Framing(frame=lambda event: {"event": event["type"], "data": _json(event)}, error=error,
                   respond=_event_source)


def stream_response(tracker: RequestTracker, events: AsyncIterator[Event], handles: Sequence[ChoiceHandle],
                    framing: Framing, headers: dict[str, str] | None = None) -> Response:
    """Stream an endpoint's events in its framing. The tracker notes a `StreamError`, or a stream cut short
    (the client went away: the response cancels the body); either way the engine work is cancelled at the
    end."""

    async def body() -> AsyncIterator[Any]:
        complete = False
        try:
            async for event in events:
                if isinstance(event, StreamError):
                    tracker.note_error(event.code or event.type)
                    event = framing.error(event)
                yield framing.frame(event)
                # Let the loop run between events: a step's deltas for n choices arrive at once, and written
                # in one go, every write after the client's reset is one more "socket.send() raised
                # exception." from asyncio (past the fifth), as uvicorn learns of the lost connection only
                # from a callback of the loop. Yielding here runs it after the first failed write; uvicorn
                # then drops what follows and the response sees the disconnect and ends the stream.
                await asyncio.sleep(0)
            for marker in framing.end:
                yield marker
            complete = True
        finally:
            if not complete:
                tracker.note_error("client_disconnected")
            cancel_all(handles)

    return framing.respond(body(), headers)


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
