"""Graceful shutdown: what happens between SIGTERM (or Ctrl+C) and the process exiting 0.

1. Drain: the port stays open; /health and every new request answer 503, so a load balancer takes the
   instance out of rotation while requests in flight — streaming, collecting, or still queued in the
   engine — run to their end.
2. When none are left, or `graceful_timeout` seconds have passed, the rest are ended with an error their
   clients receive (a 503 body, or an error event and `[DONE]` on a stream), given a moment to be sent,
   and only then does uvicorn close the connections and the app stop the engine.

A second signal skips the rest of the grace period (step 2 at once); a third exits without waiting.
uvicorn alone would close the listening socket at the first signal, cut streams after its own timeout,
and re-raise the signal when done, ending the process by SIGTERM rather than with status 0."""
from __future__ import annotations

import logging
import time
from types import FrameType

import uvicorn
from fastapi import Request

from server.errors import APIError
from server.tracking import RequestTracker

log = logging.getLogger("ktserve.server")

# After the grace period: how long the error answers get to reach their clients before connections close.
FLUSH_SECONDS = 5.0
SHUTDOWN_MESSAGE = "the server is shutting down and this request did not finish within its graceful_timeout"


async def refuse_while_draining(request: Request) -> None:
    """Dependency of the API routes: no new work once the drain has begun (probes and scrapes still answer)."""
    if request.app.state.drain.draining:
        raise APIError(503, "the server is shutting down; retry on another instance", type="service_unavailable",
                       code="server_shutting_down", headers={"Retry-After": "5", "Connection": "close"})


class Drain:
    """The requests in flight, and the drain's progress. Polled on the event loop by `DrainingServer`."""

    def __init__(self, grace_seconds: float):
        self.grace_seconds = grace_seconds
        self.in_flight: set[RequestTracker] = set()
        self.started: float | None = None
        self.aborted_at: float | None = None

    @property
    def draining(self) -> bool:
        return self.started is not None

    def begin(self) -> None:
        if self.started is None:
            self.started = time.monotonic()

    def hurry(self) -> None:
        self.begin()
        self.grace_seconds = 0.0

    def finished(self) -> bool:
        """True once the server may close its connections: nothing in flight, or the answers of what was
        ended after the grace period have had their time to be sent."""
        if self.started is None:
            return False
        if not self.in_flight:
            return True
        now = time.monotonic()
        if self.aborted_at is None and now - self.started >= self.grace_seconds:
            self.aborted_at = now
            log.warning("graceful_timeout reached: ending %d request(s) still in flight", len(self.in_flight))
            for tracker in list(self.in_flight):
                tracker.abort(SHUTDOWN_MESSAGE)
        return self.aborted_at is not None and now - self.aborted_at >= FLUSH_SECONDS


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain before its own shutdown (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        self._signals = 0
        self._announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread between two bytecodes of the event loop: set flags only.
        self._signals += 1
        if self._signals == 1:
            self.drain.begin()
        elif self._signals == 2:
            self.drain.hurry()
        else:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain.draining and not self.should_exit:
            if not self._announced:
                self._announced = True
                log.info("shutting down: new requests get 503; waiting up to %gs for %d in flight",
                         self.drain.grace_seconds, len(self.drain.in_flight))
            if self.drain.finished():
                self.should_exit = True
        return await super().on_tick(counter)
