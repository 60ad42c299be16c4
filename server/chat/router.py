from __future__ import annotations

from fastapi import APIRouter, Request

from server.chat.protocol import ChatCompletionRequest
from server.json_body import CheckedJSONRoute

router = APIRouter(route_class=CheckedJSONRoute)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    return await request.app.state.chat.create(body, request)
