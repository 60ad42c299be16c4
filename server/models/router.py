"""GET /v1/models: the base model and every loaded adapter (its `parent` is the base model's id)."""
from __future__ import annotations

from fastapi import APIRouter, Request

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request):
    engine = request.app.state.engine
    info = engine.info
    data = [{"id": info.id, "object": "model", "created": info.created, "owned_by": "ktserve",
             "root": info.id, "parent": None, "max_model_len": info.max_model_len}]
    for adapter in engine.list_adapters():
        data.append({"id": adapter.name, "object": "model", "created": adapter.created, "owned_by": "ktserve",
                     "root": adapter.path, "parent": info.id, "max_model_len": info.max_model_len})
    return {"object": "list", "data": data}
