"""Request bodies as JSON: the one decoding every API route's body goes through.

A lone surrogate escape (`"\\ud800"`) is valid JSON but not valid Unicode: no tokenizer can encode it, and
nothing downstream should have to care. `decode()` refuses it with a 400 naming the field that holds it.
FastAPI decodes bodies itself with `request.json()`; `CheckedJSONRoute` hands its routes a request whose
`json()` is `decode()`. The Ollama routes, which read their own bodies, call `decode_body()` directly.

Large bodies are decoded, and large answers encoded, on a worker thread (`decode_body`, `json_answer`):
parsing and walking megabytes of JSON is pure Python, and on the event loop it would hold up every other
request — `/health` included — for as long as it takes."""
from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.responses import JSONResponse, Response

from server.errors import APIError


def lone_surrogate_at(data: Any) -> str | None:
    """The path (`messages[0].content`) of the first string in `data`, key or value, that is not valid
    Unicode; None when there is none. Iterative: the parser's nesting limit is the only depth bound."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _valid(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else str(key)
                if not _valid(key):
                    return path or "body"
                stack.append((item, child))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
    return None


def _valid(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def decode(body: bytes) -> Any:
    """`json.loads(body)`, refusing text that is not valid Unicode (APIError 400 naming the field). Other
    failures (ValueError, RecursionError) propagate for the caller to word."""
    data = json.loads(body)
    path = lone_surrogate_at(data)
    if path is not None:
        raise APIError(400, f"'{path}' holds a lone UTF-16 surrogate (e.g. \\ud800), which is not valid Unicode",
                       param=path, code="invalid_unicode")
    return data


# Bodies of at least this many bytes are decoded on a worker thread (a 64 KiB body decodes in about 1 ms).
OFF_LOOP_BYTES = 65_536


async def decode_body(body: bytes) -> Any:
    """`decode(body)`, on a worker thread when the body is large."""
    if len(body) < OFF_LOOP_BYTES:
        return decode(body)
    return await asyncio.to_thread(decode, body)


async def json_answer(content: Any, status_code: int = 200) -> Response:
    """`content` (plain JSON values) as a JSON response rendered on a worker thread: for answers that can be
    megabytes (token lists, embeddings), which FastAPI would otherwise encode on the event loop."""
    return await asyncio.to_thread(JSONResponse, content, status_code)


class CheckedJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = await decode_body(await self.body())
        return self._json


class CheckedJSONRoute(APIRoute):
    """An API route whose JSON body is read with `decode()`."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(CheckedJSONRequest(request.scope, request.receive))

        return route
