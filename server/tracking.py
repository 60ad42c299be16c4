"""Per-request accounting, done once: what the metrics and the request log line both read.

The middleware opens a `RequestTracker` for every HTTP request and puts it on the request (`tracker_of`
reads it back); endpoints hand it to the shared serving helpers (`submit_choices`, `collect`,
`stream_response`), which feed it. Engine handles are wrapped in `TrackedHandle`s, so every delta the
endpoints read is seen here on its way past and the endpoints themselves need no accounting code."""
from __future__ import annotations

import re
import time
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request

from engines.base import INTERACTIVE, GenerationOutput, RequestHandle, whole_output

MAX_REQUEST_ID_LENGTH = 128
PRIORITY_SCOPE_KEY = "ktserve.priority"
UNMATCHED = "unmatched"  # the route of requests no route served: one label value whatever the path
# A client's X-Request-Id goes into a response header and the log, so only plain token characters survive.
_UNSAFE_ID_CHARACTERS = re.compile(r"[^A-Za-z0-9._:/+=-]")


def request_id_from(sent: str | None) -> str:
    """The client's X-Request-Id, cleaned and cut to length, or a fresh one when it sent none (or nothing
    usable)."""
    cleaned = _UNSAFE_ID_CHARACTERS.sub("", sent or "")[:MAX_REQUEST_ID_LENGTH]
    return cleaned or uuid.uuid4().hex


class TrackedHandle:
    """An engine handle as the serving code sees it: the same deltas, each noted on its way past."""

    def __init__(self, handle: RequestHandle):
        self._handle = handle
        self.request_id = handle.request_id
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.server_shutdown = False  # the server's shutdown ended this choice

    def __aiter__(self) -> AsyncIterator[GenerationOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[GenerationOutput]:
        async for out in self._handle:
            self._note(out)
            yield out

    async def result(self) -> GenerationOutput:
        """The whole generation, read through this wrapper so every delta is noted."""
        return await whole_output(self.request_id, self)

    def cancel(self) -> None:
        self._handle.cancel()

    def abort(self, message: str) -> None:
        """The server is shutting down: end this choice now with an error delta its reader will see, and drop
        the engine's work on it."""
        self.server_shutdown = True
        self._handle.deliver(GenerationOutput(request_id=self.request_id, finish_reason="error", error=message,
                                              completion_tokens=self.completion_tokens, server_shutdown=True))
        self._handle.cancel()

    def _note(self, out: GenerationOutput) -> None:
        if out.token_ids:
            now = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
        self.completion_tokens = max(self.completion_tokens, out.completion_tokens)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
        self.server_shutdown = self.server_shutdown or out.server_shutdown

    def time_per_output_token(self) -> float | None:
        """Mean seconds between this choice's tokens after the first; None with fewer than two."""
        if self.first_token_at is None or self.last_token_at is None or self.completion_tokens < 2:
            return None
        return (self.last_token_at - self.first_token_at) / (self.completion_tokens - 1)


class RequestTracker:
    """One HTTP request's life: its id and route, the engine work it asked for, and how it ended."""

    def __init__(self, request_id: str, method: str, path: str):
        self.request_id, self.method, self.path = request_id, method, path
        self.route = UNMATCHED  # the route's path template, known once the request has been routed
        self.start = time.monotonic()
        self.end: float | None = None
        self.status: int | None = None  # the HTTP status sent
        self.error: str | None = None  # what ended it early: an error code, "client_disconnected", ...
        self.model: str | None = None
        self.prompt_tokens = 0
        self.handles: list[TrackedHandle] = []
        self.shutdown_message: str | None = None
        # engine admission order of what this request submits (GenerationRequest.priority): set from the
        # ASGI scope's PRIORITY_SCOPE_KEY, which only an in-process caller (the Batch API's runner) can set
        self.priority = INTERACTIVE

    def track(self, handles: list[RequestHandle], prompt_tokens: int) -> list[TrackedHandle]:
        tracked = [TrackedHandle(h) for h in handles]
        self.handles += tracked
        self.prompt_tokens += prompt_tokens
        if self.shutdown_message is not None:  # submitted after the shutdown ended this request
            for h in tracked:
                h.abort(self.shutdown_message)
        return tracked

    def abort(self, message: str) -> None:
        """The server is shutting down: end every unfinished choice with an error its client will receive."""
        self.shutdown_message = message
        self.error = "server_shutdown"
        for h in self.handles:
            if h.finish_reason is None:
                h.abort(message)

    def note_error(self, reason: str) -> None:
        """Note what ended the request early (an error code, "client_disconnected", ...); the first stands."""
        self.error = self.error or reason

    @property
    def output_tokens(self) -> int:
        return sum(h.completion_tokens for h in self.handles)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first token of any choice."""
        firsts = [h.first_token_at for h in self.handles if h.first_token_at is not None]
        return min(firsts) - self.start if firsts else None

    @property
    def duration(self) -> float:
        return (self.end if self.end is not None else time.monotonic()) - self.start

    def finish_reasons(self) -> list[str]:
        """Per choice: the engine's finish reason, or what cut it short."""
        return ["server_shutdown" if h.server_shutdown else h.finish_reason or self.error or "abort"
                for h in self.handles]

    def summary(self) -> dict[str, Any]:
        ttft = self.ttft
        fields: dict[str, Any] = {"request_id": self.request_id, "method": self.method, "path": self.path,
                                  "status": self.status, "duration_s": round(self.duration, 4)}
        if self.model is not None:
            fields.update(model=self.model, prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens,
                          ttft_s=None if ttft is None else round(ttft, 4), finish_reasons=self.finish_reasons())
        if self.error is not None:
            fields["error"] = self.error
        return fields


def tracker_of(request: Request) -> RequestTracker:
    """The tracker `RequestTracking` put on this request. A request without one was served by an app built
    without that middleware: a bug, never a request to serve untracked."""
    tracker = getattr(request.state, "tracker", None)
    if not isinstance(tracker, RequestTracker):
        raise RuntimeError(f"{request.method} {request.url.path} has no request tracker: "
                           "the app is missing its RequestTracking middleware")
    return tracker
