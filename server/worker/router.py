"""The endpoints a router (sglang-router, vllm-router) probes on each replica, beside the open /health:

- GET /server_info, /model_info: what this replica serves, read when the router registers it
  (`/get_server_info`, `/get_model_info`: the older names, still tried by older routers);
- GET /get_load: running and queued requests, polled by the power-of-two policy;
- GET /health_generate: a deep health check — 200 only while the engine thread really makes progress.

They sit behind the API key, which the router sends to its workers as a bearer token when started with
`--api-key`. docs/scaling-out.md says how a router is set up in front of ktserve."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from engines.base import Engine
from server.errors import APIError
from server.health import health
from server.worker import serving

router = APIRouter(tags=["worker"])


def loaded_engine(request: Request) -> Engine:
    engine = request.app.state.engine
    if not engine.ready:
        raise APIError(503, "the model is not loaded yet; /health says when it is", type="service_unavailable",
                       code="model_not_loaded", headers={"Retry-After": "5"})
    return engine

# Longer than any single engine step (a long chunked prefill of a large model on CPU experts).
PROGRESS_TIMEOUT_SECONDS = 30.0


@router.get("/server_info")
@router.get("/get_server_info", include_in_schema=False)
async def server_info(request: Request, engine: Engine = Depends(loaded_engine)):
    return serving.server_info(request.app.state.settings, engine)


@router.get("/model_info")
@router.get("/get_model_info", include_in_schema=False)
async def model_info(engine: Engine = Depends(loaded_engine)):
    return serving.model_info(engine)


@router.get("/get_load")
async def get_load(engine: Engine = Depends(loaded_engine)):
    return serving.load(engine)


@router.get("/health_generate")
async def health_generate(request: Request):
    answer = await health(request)
    if isinstance(answer, JSONResponse):  # loading, failed or draining: /health's own 503
        return answer
    problem = await serving.engine_makes_progress(request.app.state.engine, PROGRESS_TIMEOUT_SECONDS)
    if problem is not None:
        return JSONResponse({"status": "stalled", "error": problem}, status_code=503)
    return answer
