"""The outermost middleware: every HTTP request gets an id and a tracker (on `request.state`, where
`server.tracking.tracker_of` finds it), and on its way out is recorded once — in the metrics and in one log
line. It also keeps the set of requests in flight that a drain waits for, and is where an exception nothing
else handled (a bug) ends: logged once with its traceback and answered with one OpenAI-shaped 500 that
carries the request id and closes the connection cleanly.

The log line carries no headers and no query string, so an API key never reaches the log."""
from __future__ import annotations

import asyncio
import json
import logging
import time

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engines.base import INTERACTIVE
from server.metrics import Metrics
from server.shutdown import Drain
from server.tracking import PRIORITY_SCOPE_KEY, UNMATCHED, RequestTracker, request_id_from

log = logging.getLogger("ktserve.requests")
errors_log = logging.getLogger("ktserve.server")

# Probes and scrapes are logged at debug level, so a probe every few seconds does not bury the requests.
SERVICE_ROUTES = frozenset({"/health", "/version", "/metrics"})


class RequestTracking:
    def __init__(self, app: ASGIApp, *, metrics: Metrics, drain: Drain):
        self.app, self.metrics, self.drain = app, metrics, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        tracker = RequestTracker(request_id_from(Headers(scope=scope).get("x-request-id")), scope["method"],
                                 scope["path"])
        tracker.priority = scope.get(PRIORITY_SCOPE_KEY, tracker.priority)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                tracker.status = message["status"]
                MutableHeaders(scope=message).append("X-Request-Id", tracker.request_id)
            await send(message)

        # a new dict for this request, never a change to one the server may share between requests
        scope["state"] = {**scope.get("state", {}), "tracker": tracker}
        self.drain.in_flight.add(tracker)
        try:
            await self.app(scope, receive, send_with_id)
        except asyncio.CancelledError:
            if self.drain.draining and tracker.status is None:
                # uvicorn cancels what is left once the drain is over: answer in our shape, not its plain text
                tracker.error = tracker.error or "server_shutdown"
                await send_with_id(json_response_start(503, SHUTDOWN_BODY))
                await send_with_id({"type": "http.response.body", "body": SHUTDOWN_BODY})
                return
            tracker.status = tracker.status or 499  # the client went away before an answer began
            tracker.error = tracker.error or "client_disconnected"
            raise
        except Exception as exc:
            if tracker.status is not None:  # the answer had begun: nothing to do but let uvicorn cut it
                raise
            errors_log.error("unexpected error in %s %s (id=%s)", tracker.method, tracker.path,
                             tracker.request_id, exc_info=exc)
            tracker.error = tracker.error or "internal_error"
            await send_with_id(json_response_start(500, INTERNAL_ERROR_BODY))
            await send_with_id({"type": "http.response.body", "body": INTERNAL_ERROR_BODY})
        finally:
            self.drain.in_flight.discard(tracker)
            tracker.end = time.monotonic()
            tracker.route = route_template(scope)
            self.metrics.observe(tracker)
            log_request(tracker)


INTERNAL_ERROR_BODY = json.dumps({"error": {"message": "internal server error", "type": "internal_error",
                                            "param": None, "code": None}}).encode()
SHUTDOWN_BODY = json.dumps({"error": {"message": "the server shut down before this request finished",
                                      "type": "service_unavailable", "param": None,
                                      "code": "server_shutdown"}}).encode()


def json_response_start(status: int, body: bytes) -> Message:
    """The start of an answer after which the server closes the connection, and says so."""
    return {"type": "http.response.start", "status": status,
            "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                        (b"content-length", str(len(body)).encode())]}


def route_template(scope: Scope) -> str:
    """The path template of the route that served the request (`/v1/models`), never the raw path, so the
    metrics' label values stay few whatever paths clients try."""
    return getattr(scope.get("route"), "path", None) or UNMATCHED


def log_request(t: RequestTracker) -> None:
    fields = t.summary()
    text = f"{t.method} {t.path} {t.status} {t.duration:.3f}s id={t.request_id}"
    if t.model is not None:
        ttft = "-" if fields["ttft_s"] is None else f"{fields['ttft_s']:.3f}s"
        text += (f" model={t.model} prompt_tokens={t.prompt_tokens} output_tokens={t.output_tokens} ttft={ttft}"
                 f" finish={','.join(fields['finish_reasons'])}")
    if t.error is not None:
        text += f" error={t.error}"
    # background work (a batch's lines) logs at debug level too: a 50,000-line batch is not 50,000 log lines
    level = logging.DEBUG if t.route in SERVICE_ROUTES or t.priority != INTERACTIVE else logging.INFO
    log.log(level, "%s", text, extra={"fields": fields})
