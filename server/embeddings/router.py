from __future__ import annotations

from fastapi import APIRouter, Request

from server.embeddings.protocol import EmbeddingRequest
from server.json_body import CheckedJSONRoute

router = APIRouter(route_class=CheckedJSONRoute)


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request):
    return await request.app.state.embeddings.create(body)
