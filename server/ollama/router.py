"""Ollama's HTTP routes. Bodies are validated here rather than by FastAPI so that every failure, bad input
included, answers in Ollama's error shape, `{"error": "..."}`; each POST route still describes its body in
the OpenAPI document (`body_schema`), so schema-driven clients and fuzzers know what to send."""
from __future__ import annotations

import functools
import time
from datetime import datetime
from typing import Any, Awaitable, Callable, TypeVar

from fastapi import APIRouter, Request
from pydantic import BaseModel

from engines.base import ModelInfo, NotFoundError
from server.errors import unparsable_body
from server.json_body import decode_body, json_answer
from server.errors import APIError
from server.ollama.protocol import (
    OLLAMA_API_VERSION, ChatRequest, EmbeddingsRequest, EmbedRequest, GenerateRequest, ShowRequest, checked,
    model_name, tagged,
)
from server.ollama.serving import ollama_error

router = APIRouter(prefix="/api", tags=["ollama"])
Body = TypeVar("Body", bound=BaseModel)
NEVER_EXPIRES = "2318-11-23T00:00:00Z"  # models are never unloaded while the server runs: a date far ahead


async def parse(request: Request, model: type[Body]) -> Body:
    try:
        data = await decode_body(await request.body() or b"{}")
    except (ValueError, RecursionError) as exc:  # not JSON, nested too deeply, not UTF-8
        raise unparsable_body(exc) from None
    return checked(lambda: model.model_validate(data))


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The `openapi_extra` that documents `model` as a route's JSON body, which FastAPI leaves out for a body
    the route parses itself. Nested models are written in place: a `$ref` would point into the document's
    components, which FastAPI fills only with the models of bodies it parses."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, list):
            return [inline(item) for item in node]
        if not isinstance(node, dict):
            return node
        named = inline(defs[node["$ref"].rsplit("/", 1)[-1]]) if "$ref" in node else {}
        return {**named, **{key: inline(value) for key, value in node.items() if key != "$ref"}}

    return {"requestBody": {"required": bool(schema.get("required")),
                            "content": {"application/json": {"schema": inline(schema)}}}}


def ollama_route(handler: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Awaitable[Any]]:
    """Answer every failure of `handler` in Ollama's error shape."""
    @functools.wraps(handler)
    async def route(request: Request) -> Any:
        try:
            return await handler(request)
        except Exception as exc:
            return ollama_error(exc)
    return route


@router.get("/version")
async def version():
    return {"version": OLLAMA_API_VERSION}


@router.get("/tags")
@ollama_route
async def tags(request: Request):
    return {"models": [model_entry(request, name) for name in served_names(request)]}


@router.get("/ps")
@ollama_route
async def ps(request: Request):
    """The models in memory: the base model, and each adapter (its parent the base model). They stay loaded
    for as long as the server runs."""
    engine = request.app.state.engine
    info = engine.info
    base = {**model_entry(request, info.id), "size_vram": info.gpu_bytes, "expires_at": NEVER_EXPIRES,
            "context_length": info.max_model_len}
    adapters = [{**model_entry(request, a.name), "size_vram": 0, "expires_at": NEVER_EXPIRES,
                 "context_length": info.max_model_len} for a in engine.list_adapters()]
    return {"models": [base, *adapters]}


@router.post("/show", openapi_extra=body_schema(ShowRequest))
@ollama_route
async def show(request: Request):
    body = await parse(request, ShowRequest)
    if body.model_name not in served_names(request):
        raise NotFoundError(f"model '{body.model_name}' not found")
    engine = request.app.state.engine
    info = engine.info
    return {"modelfile": "", "parameters": "", "template": engine.tokenizer.chat_template or "",
            "details": details(info), "capabilities": ["completion", "tools"],
            "model_info": {"general.architecture": info.architecture, "general.context_length": info.max_model_len,
                           "ktserve.engine": info.engine}}


@router.post("/chat", openapi_extra=body_schema(ChatRequest))
@ollama_route
async def chat(request: Request):
    return await request.app.state.ollama.chat_reply(await parse(request, ChatRequest), request)


@router.post("/generate", openapi_extra=body_schema(GenerateRequest))
@ollama_route
async def generate(request: Request):
    return await request.app.state.ollama.generate(await parse(request, GenerateRequest), request)


@router.post("/embed", openapi_extra=body_schema(EmbedRequest))
@ollama_route
async def embed(request: Request):
    body = await parse(request, EmbedRequest)
    if body.dimensions is not None:
        raise APIError(400, "'dimensions' is not supported: this server returns the model's full-size embeddings",
                       param="dimensions")
    started = time.perf_counter_ns()
    vectors, tokens = await request.app.state.embeddings.embed(
        model_name(body.model), list(body.inputs()), truncate=body.truncate)
    return await json_answer({"model": tagged(body.model), "embeddings": vectors, "load_duration": 0,
                              "total_duration": time.perf_counter_ns() - started, "prompt_eval_count": tokens})


@router.post("/embeddings", openapi_extra=body_schema(EmbeddingsRequest))
@ollama_route
async def embeddings(request: Request):
    body = await parse(request, EmbeddingsRequest)
    if not body.prompt:
        return {"embedding": []}  # as Ollama answers an empty prompt
    vectors, _ = await request.app.state.embeddings.embed(model_name(body.model), [body.prompt], truncate=True)
    return {"embedding": vectors[0]}


def served_names(request: Request) -> list[str]:
    engine = request.app.state.engine
    return [engine.info.id] + [a.name for a in engine.list_adapters()]


def details(info: ModelInfo) -> dict[str, Any]:
    return {"parent_model": "", "format": "safetensors", "family": info.architecture,
            "families": [info.architecture], "parameter_size": human_number(info.parameter_count),
            "quantization_level": ""}


def human_number(n: int) -> str:
    """A parameter count as Ollama writes it: 16B, 15.7B, 494.03M, 12K ("" when not known)."""
    if n <= 0:
        return ""
    for scale, suffix, decimals in ((10**9, "B", 1), (10**6, "M", 2), (10**3, "K", 0)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{suffix}" if value == int(value) or suffix == "K" else f"{value:.{decimals}f}{suffix}"
    return str(n)


def model_entry(request: Request, name: str) -> dict[str, Any]:
    """A served model as /api/tags and /api/ps list it: the base model, or an adapter (its parent the base
    model, its size the adapter's own)."""
    engine = request.app.state.engine
    info = engine.info
    modified = datetime.fromtimestamp(info.created).astimezone().isoformat()
    entry = {"name": tagged(name), "model": tagged(name), "modified_at": modified, "size": info.size_bytes,
             "digest": "", "details": details(info)}
    adapter = next((a for a in engine.list_adapters() if a.name == name and name != info.id), None)
    if adapter is not None:
        entry["size"] = adapter.size_bytes
        entry["details"] = {**entry["details"], "parent_model": tagged(info.id), "format": "lora"}
    return entry
