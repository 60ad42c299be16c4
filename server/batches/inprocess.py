"""One request through the app itself, in process: the batch runner's way to run a line through exactly the
code its HTTP route runs (validation, serving, errors, auth, metrics) without a socket.

The scope says the request is background work (`PRIORITY_SCOPE_KEY`), which only an in-process caller can
say. Setting `gone` is the client going away: the route sees a disconnect and cancels its engine work."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

from engines.base import BACKGROUND
from server.tracking import PRIORITY_SCOPE_KEY


@dataclass(slots=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return self.body.decode(errors="replace")


async def post(app: ASGIApp, path: str, body: bytes, headers: dict[str, str], gone: asyncio.Event) -> Answer:
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": b"", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
        "headers": [(k.lower().encode(), v.encode()) for k, v in
                    {"content-type": "application/json", "content-length": str(len(body)), **headers}.items()],
        PRIORITY_SCOPE_KEY: BACKGROUND,
    }
    sent = False
    status, answer_headers, chunks = 500, {}, []

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, answer_headers
        if message["type"] == "http.response.start":
            status = message["status"]
            answer_headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return Answer(status, answer_headers, b"".join(chunks))
