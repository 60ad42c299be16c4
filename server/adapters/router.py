"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, in vLLM's request shapes."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from server.adapters.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from server.json_body import CheckedJSONRoute

router = APIRouter(route_class=CheckedJSONRoute)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request):
    return PlainTextResponse(await request.app.state.adapters.load(body.lora_name, body.lora_path))


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request):
    return PlainTextResponse(await request.app.state.adapters.unload(body.lora_name))
