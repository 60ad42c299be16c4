from __future__ import annotations

from fastapi import APIRouter, Request

from server.json_body import CheckedJSONRoute
from server.responses.protocol import ResponsesRequest
from server.responses.serving import ResponsesServing

router = APIRouter(route_class=CheckedJSONRoute)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    return await ResponsesServing(request.app.state.chat).create(body, request)
