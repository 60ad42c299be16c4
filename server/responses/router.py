from __future__ import annotations

from fastapi import APIRouter, Request

from server.json_body import CheckedJSONRoute
from server.responses.protocol import ResponsesRequest

router = APIRouter(route_class=CheckedJSONRoute)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    return await request.app.state.responses.create(body, request)
