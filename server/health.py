"""GET /health (open; 503 while the model loads or the server drains) and GET /version."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server import __version__

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    state = request.app.state
    if state.drain.draining:
        # the instance is going away: a client (or balancer) should not keep this connection for its next probe
        return JSONResponse({"status": "draining"}, status_code=503, headers={"Connection": "close"})
    if state.load_error is not None:
        return JSONResponse({"status": "failed", "error": state.load_error}, status_code=503)
    if not state.engine.ready:
        return JSONResponse({"status": "loading"}, status_code=503)
    return {"status": "ok", "model": state.engine.info.id}


@router.get("/version")
async def version(request: Request):
    engine = request.app.state.engine
    details = engine.info.details if engine.ready else {}
    checkpoint = engine.info.checkpoint if engine.ready else None
    return {"version": __version__, "engine": engine.name, **({"engine_details": details} if details else {}),
            **({"checkpoint": checkpoint.as_dict()} if checkpoint is not None else {})}
