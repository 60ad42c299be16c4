"""uvicorn's HTTP/1.1 protocol with a read timeout: a client gets `read_timeout` seconds from the moment
the connection is ready for a request until that request — headers and body — has fully arrived.

uvicorn (0.54, h11) has no such timeout: its keep-alive timer only runs after a response and is cancelled
by the first byte of the next request, so a client that connects and sends nothing, trickles its headers a
byte at a time, or declares a body and never sends it (slowloris) holds its connection, and in the last
case a request task, forever. Time spent generating the answer is not limited here; that is
`request_timeout`'s job."""
from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("ktserve.server")

DEFAULT_READ_TIMEOUT = 30.0


def _timeout_response() -> bytes:
    body = json.dumps({"error": {"message": "the request was not received in time", "type": "timeout_error",
                                 "param": None, "code": "request_read_timeout"}}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    return head + body


_TIMEOUT_RESPONSE = _timeout_response()


class ReadTimeoutH11Protocol(H11Protocol):
    read_timeout: float = DEFAULT_READ_TIMEOUT

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._read_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """Run the timer while a request is awaited or arriving; stop it once the request is complete."""
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            if self._read_timer is None:
                self._read_timer = self.loop.call_later(self.read_timeout, self._read_timed_out)
        else:
            self._stop_timer()

    def _stop_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            return
        partial = self.conn.their_state is h11.SEND_BODY or bool(self.conn.trailing_data[0])
        if partial:
            log.info("closed a connection from %s that did not send its request within %gs",
                     self.client[0] if self.client else "?", self.read_timeout)
        if partial and (self.cycle is None or not self.cycle.response_started):
            self.transport.write(_TIMEOUT_RESPONSE)  # a request had begun: say why before closing
        self.transport.close()


def http_protocol(read_timeout: float = DEFAULT_READ_TIMEOUT) -> type[H11Protocol]:
    """The protocol class to pass as uvicorn's `http=`, with this read timeout."""
    return type("ReadTimeoutH11Protocol", (ReadTimeoutH11Protocol,), {"read_timeout": read_timeout})
