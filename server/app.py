"""The FastAPI application: routes, auth, error mapping, body limits, and the engine's lifetime.

The model loads in a worker thread after the server starts listening, so `/health` answers 503 while it
loads instead of the port being closed; a load failure is reported there and in the log. Shutdown drains
first (server/shutdown.py); the engine stops after the server has stopped."""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from engines.base import Engine
from server.adapters.router import router as adapters_router
from server.adapters.serving import AdapterServing
from server.auth import require_api_key
from server.batches.router import router as batches_router
from server.batches.serving import UPLOAD_OVERHEAD, BatchServing
from server.chat.router import router as chat_router
from server.chat.serving import ChatServing
from server.completions.router import router as completions_router
from server.completions.serving import CompletionServing
from server.embeddings.router import router as embeddings_router
from server.embeddings.serving import EmbeddingServing
from server.errors import RequestTooLarge, install_error_handlers, to_api_error, wire_error
from server.health import router as health_router
from server.metrics import Metrics
from server.metrics import router as metrics_router
from server.middleware import RequestTracking
from server.models.router import router as models_router
from server.native_output import stdout_to_log
from server.ollama.router import router as ollama_router
from server.ollama.serving import OllamaServing
from server.responses.router import router as responses_router
from server.responses.serving import ResponsesServing
from server.score.router import router as score_router
from server.score.serving import ScoreServing
from server.settings import Settings
from server.shutdown import Drain, refuse_while_draining
from server.tokenize.router import router as tokenize_router
from server.unmatched import unmatched_route
from server.worker.router import router as worker_router

log = logging.getLogger("ktserve.server")


class BodySizeLimit:
    """Refuse request bodies over `limit` bytes with 413, before they are read into memory; the paths in
    `paths` (file uploads) have limits of their own."""

    def __init__(self, app: ASGIApp, limit: int, paths: dict[str, int] | None = None):
        self.app, self.default, self.paths = app, limit, paths or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.paths.get(scope["path"], self.default)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(scope, send, limit)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise RequestTooLarge(limit)
            return message

        try:
            await self.app(scope, limited_receive, send)
        except RequestTooLarge:
            await self._refuse(scope, send, limit)

    async def _refuse(self, scope: Scope, send: Send, limit: int) -> None:
        import json
        error = RequestTooLarge(limit)
        content, status, _ = wire_error(scope["path"], to_api_error(error))
        body = json.dumps(content).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def create_app(settings: Settings, engine: Engine, *, load_engine: bool = True) -> FastAPI:
    """Build the app around an engine. With `load_engine`, the app starts the engine when it starts and
    stops it when it stops; tests that manage the engine themselves pass False."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = None
        if load_engine:
            task = asyncio.create_task(_load(app, engine))
        await app.state.batches.start(app)  # unfinished batches resume once the engine serves
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            await app.state.batches.stop()  # lines in flight stay pending: they run at the next start
            if load_engine:
                with stdout_to_log():  # kt-kernel says goodbye as its thread pool ends
                    await asyncio.to_thread(engine.stop)

    # With a key, the schema is served behind it (below) and the docs pages not at all: they fetch the
    # schema without a key.
    keyed_docs = {"openapi_url": None, "docs_url": None, "redoc_url": None} if settings.api_key else {}
    app = FastAPI(title="ktserve", description="OpenAI-compatible server for DeepSeek MoE models",
                  lifespan=lifespan, **keyed_docs)
    app.router.redirect_slashes = False  # server.unmatched redirects, with a relative Location
    app.state.settings = settings
    app.state.engine = engine
    app.state.load_error = None
    app.state.drain = Drain(settings.graceful_timeout)
    app.state.metrics = Metrics(engine)
    _add_serving(app, settings, engine)
    install_error_handlers(app, body_gate=require_api_key, unmatched=unmatched_route)
    key_required = [Depends(require_api_key)]
    if settings.api_key:
        app.add_api_route("/openapi.json", app.openapi, include_in_schema=False, dependencies=key_required)
    protected = [Depends(refuse_while_draining), *key_required]
    app.include_router(health_router)
    app.include_router(metrics_router, dependencies=[] if settings.metrics_public else key_required)
    for router in (models_router, chat_router, completions_router, responses_router, embeddings_router,
                   tokenize_router, ollama_router, adapters_router, score_router, batches_router):
        app.include_router(router, dependencies=protected)
    app.include_router(worker_router, dependencies=key_required)  # what a router in front asks (server/worker)
    # The last middleware added runs first: request tracking sees every answer, CORS and 413s included.
    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes,
                       paths={"/v1/files": settings.batch_max_file_bytes + UPLOAD_OVERHEAD})
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id", "Retry-After"])
    app.add_middleware(RequestTracking, metrics=app.state.metrics, drain=app.state.drain)
    return app


def _add_serving(app: FastAPI, settings: Settings, engine: Engine) -> None:
    """Each endpoint's serving object, built once: its router (server/<endpoint>/router.py) finds it on
    app.state under the endpoint's name."""
    state = app.state
    state.chat = ChatServing(engine, settings.request_timeout)
    state.completions = CompletionServing(engine, settings.request_timeout)
    state.responses = ResponsesServing(state.chat)
    state.ollama = OllamaServing(state.chat)
    state.embeddings = EmbeddingServing(engine)
    state.score = ScoreServing(engine)
    state.adapters = AdapterServing(engine, settings.adapter_roots)
    state.batches = BatchServing(settings, engine)


async def _load(app: FastAPI, engine: Engine) -> None:
    try:
        with stdout_to_log():  # kt-kernel's C++ prints while the model loads
            await asyncio.to_thread(engine.start)
        log.info("serving %s with the %s engine", engine.info.id, engine.name)
    except Exception as exc:  # reported on /health and in the log; the process stays up to say so
        log.exception("the engine failed to start")
        app.state.load_error = f"{type(exc).__name__}: {exc}"
        on_failure = getattr(app.state, "on_load_failure", None)
        if on_failure is not None:
            on_failure()
