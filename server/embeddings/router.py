from __future__ import annotations

from fastapi import APIRouter, Request

from server.embeddings.protocol import EmbeddingRequest
from server.embeddings.serving import EmbeddingServing
from server.json_body import CheckedJSONRoute

router = APIRouter(route_class=CheckedJSONRoute)


def embedding_serving(request: Request) -> EmbeddingServing:
    return EmbeddingServing(request.app.state.engine)


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request):
    return await embedding_serving(request).create(body)
