"""Ollama's HTTP routes. Bodies are validated here rather than by FastAPI so that every failure, bad input
included, answers in Ollama's error shape, `{"error": "..."}`."""
from __future__ import annotations

import functools
from datetime import datetime
from typing import Any, Awaitable, Callable, TypeVar

from fastapi import APIRouter, Request
from pydantic import BaseModel

from engines.base import NotFoundError
from server.errors import unparsable_body
from server.json_body import decode
from server.ollama.protocol import OLLAMA_API_VERSION, ChatRequest, GenerateRequest, ShowRequest, checked, tagged
from server.ollama.serving import OllamaServing, ollama_error

router = APIRouter(prefix="/api", tags=["ollama"])
Body = TypeVar("Body", bound=BaseModel)


async def parse(request: Request, model: type[Body]) -> Body:
    try:
        data = decode(await request.body() or b"{}")
    except (ValueError, RecursionError) as exc:  # not JSON, nested too deeply, not UTF-8
        raise unparsable_body(exc) from None
    return checked(lambda: model.model_validate(data))


def ollama_route(handler: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Awaitable[Any]]:
    """Answer every failure of `handler` in Ollama's error shape."""
    @functools.wraps(handler)
    async def route(request: Request) -> Any:
        try:
            return await handler(request)
        except Exception as exc:
            return ollama_error(exc)
    return route


def serving(request: Request) -> OllamaServing:
    return OllamaServing(request.app.state.chat)


@router.get("/version")
async def version():
    return {"version": OLLAMA_API_VERSION}


@router.get("/tags")
@ollama_route
async def tags(request: Request):
    return {"models": [model_entry(request, name) for name in served_names(request)]}


@router.post("/show")
@ollama_route
async def show(request: Request):
    body = await parse(request, ShowRequest)
    if body.model_name not in served_names(request):
        raise NotFoundError(f"model '{body.model_name}' not found")
    engine = request.app.state.engine
    info = engine.info
    return {"modelfile": "", "parameters": "", "template": engine.tokenizer.chat_template or "",
            "details": details(info.architecture), "capabilities": ["completion", "tools"],
            "model_info": {"general.architecture": info.architecture, "general.context_length": info.max_model_len,
                           "ktserve.engine": info.engine}}


@router.post("/chat")
@ollama_route
async def chat(request: Request):
    return await serving(request).chat_reply(await parse(request, ChatRequest), request)


@router.post("/generate")
@ollama_route
async def generate(request: Request):
    return await serving(request).generate(await parse(request, GenerateRequest), request)


def served_names(request: Request) -> list[str]:
    engine = request.app.state.engine
    return [engine.info.id] + [a.name for a in engine.list_adapters()]


def details(architecture: str) -> dict[str, Any]:
    return {"parent_model": "", "format": "safetensors", "family": architecture, "families": [architecture],
            "parameter_size": "", "quantization_level": ""}


def model_entry(request: Request, name: str) -> dict[str, Any]:
    info = request.app.state.engine.info
    modified = datetime.fromtimestamp(info.created).astimezone().isoformat()
    return {"name": tagged(name), "model": tagged(name), "modified_at": modified, "size": 0,
            "digest": "", "details": details(info.architecture)}
