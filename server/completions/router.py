from __future__ import annotations

from fastapi import APIRouter, Request

from server.completions.protocol import CompletionRequest

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    return await request.app.state.completions.create(body, request)
