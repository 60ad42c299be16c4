"""Request bodies as JSON: the one decoding every API route's body goes through.

A lone surrogate escape (`"\\ud800"`) is valid JSON but not valid Unicode: no tokenizer can encode it, and
nothing downstream should have to care. `decode()` refuses it with a 400 naming the field that holds it.
FastAPI decodes bodies itself with `request.json()`; `CheckedJSONRoute` hands its routes a request whose
`json()` is `decode()`. The Ollama routes, which read their own bodies, call `decode_body()` directly.

Large bodies are decoded and validated, and large answers encoded, on a worker thread (`decode_body`,
`CheckedJSONRoute`, `json_answer`): on the event loop they would hold up every other request — `/health`
included — for as long as they take. A worker thread alone is not enough: a C call holds the interpreter
lock until it returns (`json.loads` of 7 MB: 0.2 s, `json.dumps` of 2,048 embeddings: 1 s on two loaded
cores), and the loop waits for it. So the work is done in pieces that each hold the lock briefly: bodies of
a megabyte or more are parsed by the scanner written in Python (its strings still in C), answers are
encoded a slice of a list at a time (`render_json`)."""
from __future__ import annotations

import asyncio
import json
import json.scanner
from typing import Any, Callable

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.responses import Response

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
    data = json.loads(body) if len(body) < IN_PIECES_BYTES else _PIECEWISE.decode(_text(body))
    path = lone_surrogate_at(data)
    if path is not None:
        raise APIError(400, f"'{path}' holds a lone UTF-16 surrogate (e.g. \\ud800), which is not valid Unicode",
                       param=path, code="invalid_unicode")
    return data


def _text(body: bytes) -> str:
    return body.decode(json.detect_encoding(body), "surrogatepass")  # as json.loads reads bytes


def _piecewise_decoder() -> json.JSONDecoder:
    """A decoder whose scanner is the Python one: arrays and objects are walked in Python (which lets other
    threads run between elements), each string still parsed in C. Same results and errors as json.loads."""
    decoder = json.JSONDecoder()
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    return decoder


_PIECEWISE = _piecewise_decoder()

# Bodies of at least this many bytes are decoded on a worker thread (a 64 KiB body decodes in about 1 ms)...
OFF_LOOP_BYTES = 65_536
# ...and from this size in pieces: json.loads of a megabyte holds the interpreter lock for 30-40 ms here.
IN_PIECES_BYTES = 1 << 20


async def decode_body(body: bytes) -> Any:
    """`decode(body)`, on a worker thread when the body is large."""
    if len(body) < OFF_LOOP_BYTES:
        return decode(body)
    return await asyncio.to_thread(decode, body)


# The most values one `json.dumps` call encodes in `render_json` (4,096 floats: a few milliseconds).
SLICE = 4096
_SCALARS = (str, int, float, bool, type(None))


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def render_json(content: Any) -> bytes:
    """`content` as JSONResponse renders it, byte for byte, encoded a slice of each list at a time."""
    parts: list[str] = []
    _render(content, parts)
    return "".join(parts).encode("utf-8")


def _render(value: Any, parts: list[str]) -> None:
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        parts.append("{")
        for i, (key, item) in enumerate(value.items()):
            parts.append(("," if i else "") + _dumps(key) + ":")
            _render(item, parts)
        parts.append("}")
    elif isinstance(value, (list, tuple)):
        parts.append("[")
        for start in range(0, len(value), SLICE):
            chunk = value[start:start + SLICE]
            if start:
                parts.append(",")
            if all(isinstance(v, _SCALARS) for v in chunk):
                parts.append(_dumps(list(chunk))[1:-1])
            else:
                for i, item in enumerate(chunk):
                    if i:
                        parts.append(",")
                    _render(item, parts)
        parts.append("]")
    else:
        parts.append(_dumps(value))


async def json_answer(content: Any, status_code: int = 200) -> Response:
    """`content` (plain JSON values) as a JSON response rendered on a worker thread, in slices: for answers
    that can be megabytes (token lists, embeddings)."""
    return Response(await asyncio.to_thread(render_json, content), status_code, media_type="application/json")


class CheckedJSONRequest(Request):
    """A request whose `json()` is `decode()`. A large body is also validated on the worker thread, against
    `body_field` (the route's one body model): FastAPI would validate it again on the loop, where a model
    instance passes at once."""

    body_field: Any = None

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = decode(body) if len(body) < OFF_LOOP_BYTES else await asyncio.to_thread(self._parse, body)
        return self._json

    def _parse(self, body: bytes) -> Any:
        data = decode(body)
        if self.body_field is None:
            return data
        value, errors = self.body_field.validate(data, loc=("body",))
        if errors:
            raise RequestValidationError(errors, body=data)  # answered as FastAPI's own validation errors
        return value


class CheckedJSONRoute(APIRoute):
    """An API route whose JSON body is read with `decode()` (and validated off the loop when large)."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()
        params = self.dependant.body_params
        # FastAPI validates a lone body parameter against the whole body (unless it is embedded)
        field = params[0] if len(params) == 1 and self.body_field is params[0] else None

        async def route(request: Request) -> Response:
            checked_request = CheckedJSONRequest(request.scope, request.receive)
            checked_request.body_field = field
            return await handler(checked_request)

        return route
