from __future__ import annotations

from fastapi import APIRouter, Request

from server.completions.protocol import CompletionRequest
from server.json_body import CheckedJSONRoute

router = APIRouter(route_class=CheckedJSONRoute)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    return await request.app.state.completions.create(body, request)
