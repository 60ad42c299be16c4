"""Errors on the wire: every failure leaves as OpenAI error JSON with one status, decided here only.

Engines raise typed errors (engines.base); handlers below map each type to its status. Validation errors
from pydantic become 400s that name the field — FastAPI's own 422 body never reaches a client."""
from __future__ import annotations

import json
import logging
from typing import Any, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engines.base import (
    EngineUnavailableError, InvalidRequestError, NotFoundError, QueueFullError, UnsupportedError,
)

log = logging.getLogger("ktserve.server")
T = TypeVar("T")


class APIError(Exception):
    """An error raised in the HTTP layer itself, with its status, type and offending parameter."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


class RequestTooLarge(StarletteHTTPException):
    """A request body found over the size limit while it is read. It is an HTTPException because FastAPI's
    body parsing lets only those through (it turns any other exception there into a 400)."""

    code = "request_too_large"

    def __init__(self, limit: int):
        super().__init__(413, f"request body larger than {limit} bytes")


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Ollama's routes live under this prefix; everything they answer, errors included, is in Ollama's shape.
OLLAMA_PREFIX = "/api/"


def wire_error(path: str, err: APIError) -> tuple[dict[str, Any], int, dict[str, str] | None]:
    """(body, status, headers) of `err` as the API at `path` words errors: Ollama's `{"error": "..."}` under
    /api/, OpenAI's error object everywhere else."""
    if path.startswith(OLLAMA_PREFIX):
        return {"error": err.message}, err.status, err.headers
    return error_body(err.message, err.type, err.param, err.code), err.status, err.headers


def error_answer(request: Request, err: APIError) -> JSONResponse:
    body, status, headers = wire_error(request.url.path, err)
    return JSONResponse(body, status_code=status, headers=headers)


def to_api_error(exc: Exception) -> APIError:
    """Map an engine (or our own) exception to its wire form."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, NotFoundError):
        return APIError(404, str(exc), type="not_found_error", param=exc.param, code="model_not_found")
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, EngineUnavailableError):
        return APIError(503, str(exc), type="service_unavailable", headers={"Retry-After": "5"})
    if isinstance(exc, UnsupportedError):
        return APIError(400, str(exc), code="unsupported")
    if isinstance(exc, StarletteHTTPException) and exc.status_code < 500:  # e.g. RequestTooLarge, read in a route
        return APIError(exc.status_code, str(exc.detail), code=getattr(exc, "code", None), headers=exc.headers)
    log.exception("unexpected error", exc_info=exc)
    return APIError(500, "internal server error", type="internal_error")


def checked(build: Callable[[], T]) -> T:
    """Run a pydantic validation inside a route; a failure is a 400 naming the field, as a body's is."""
    try:
        return build()
    except ValidationError as exc:
        message, param = _validation_message(RequestValidationError(exc.errors()))
        raise InvalidRequestError(message, param=param) from None


def _field_name(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    name = ""
    for part in parts:
        name += f"[{part}]" if part.isdigit() else (f".{part}" if name else part)
    return name


def _validation_message(exc: RequestValidationError, body_model: Any = None) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "missing" and loc == ("body",):
        return _empty_body_message(body_model)
    # pydantic tags union members in the location (e.g. "str", "list[...]"); drop those for the name
    loc = tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "function-after"))))
    field = _field_name(loc) or None
    msg = _integer_expected(first) if first.get("type") == "int_type" else first.get("msg", "invalid value")
    if first.get("type") == "missing":
        return f"'{field}' is required", field
    if field is None:
        return f"invalid request body: {msg}", None
    return f"invalid value for '{field}': {msg}", field


def _integer_expected(error: dict[str, Any]) -> str:
    """OpenAI's wording for a strict integer field given something else: what was sent, as JSON spells it."""
    value = error.get("input")
    shown = json.dumps(value) if isinstance(value, (bool, float, str)) and len(str(value)) <= 40 else \
        type(value).__name__
    return f"expected an integer, got {shown}"


def _empty_body_message(body_model: Any) -> tuple[str, str | None]:
    """No body at all: name the first field the route requires."""
    fields = getattr(body_model, "model_fields", {})
    required = [name for name, f in fields.items() if f.is_required()]
    if not required:
        return "the request body is empty; send a JSON object", None
    return f"the request body is empty; '{required[0]}' is required", required[0]


def _body_model(request: Request) -> Any:
    body_field = getattr(request.scope.get("route"), "body_field", None)
    return getattr(getattr(body_field, "field_info", None), "annotation", None)


# FastAPI answers any exception raised while it reads and decodes a JSON body (other than a JSON syntax
# error) with this 400. The cause says whether the client sent something unparsable or we have a bug.
BODY_PARSE_FAILED = "There was an error parsing the body"


def unparsable_body(cause: BaseException | None) -> APIError:
    if isinstance(cause, APIError):  # refused by server.json_body.decode
        return cause
    if isinstance(cause, RequestValidationError):  # a large body, validated off the loop (server.json_body)
        message, param = _validation_message(cause)
        return APIError(400, message, param=param)
    if isinstance(cause, RecursionError):
        return APIError(400, "the request body is nested too deeply to parse", code="invalid_json")
    if isinstance(cause, UnicodeDecodeError):
        return APIError(400, "the request body is not valid UTF-8", code="invalid_json")
    if isinstance(cause, ValueError):  # e.g. an integer beyond Python's digit limit
        return APIError(400, f"the request body is not valid JSON: {cause}", code="invalid_json")
    if isinstance(cause, ClientDisconnect):
        return APIError(400, "the client went away while sending the body")  # nobody reads this answer
    raise cause or RuntimeError("the request body could not be read")  # a bug: answered as one 500


def install_error_handlers(app: FastAPI, body_gate: Callable[[Request], None] | None = None,
                           unmatched: Callable[[Request], Response | None] | None = None) -> None:
    """`body_gate` (the API-key check) runs before a body's parse error is reported: FastAPI reads the body
    before it runs a route's dependencies, and a client without the key learns nothing about the body.
    `unmatched` (server/unmatched.py) answers a request no route serves, or returns None for the plain 404/405."""

    def gated(request: Request, err: APIError) -> JSONResponse:
        if body_gate is not None:
            try:
                body_gate(request)
            except APIError as refused:
                return error_answer(request, refused)
        return error_answer(request, err)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc, _body_model(request))
        return gated(request, APIError(400, message, param=param))

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return error_answer(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == BODY_PARSE_FAILED:
            return gated(request, unparsable_body(exc.__cause__))
        kind = {404: "not_found_error", 405: "invalid_request_error", 401: "authentication_error"}
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if unmatched is not None and (exc.status_code, message) in ((404, "Not Found"), (405, "Method Not Allowed")):
            answer = unmatched(request)
            if answer is not None:
                return answer
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        return error_answer(request, APIError(exc.status_code, message, type=kind.get(exc.status_code,
                                              "invalid_request_error"), code=getattr(exc, "code", None),
                                              headers=getattr(exc, "headers", None)))

    async def _engine(request: Request, exc: Exception) -> JSONResponse:
        return error_answer(request, to_api_error(exc))

    # Any other exception is a bug: server.middleware.RequestTracking answers it, once, as a 500.
    for engine_error in (InvalidRequestError, NotFoundError, QueueFullError, EngineUnavailableError,
                         UnsupportedError):
        app.add_exception_handler(engine_error, _engine)
