"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, in vLLM's request shapes."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from server.adapters.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from server.adapters.serving import AdapterServing
from server.json_body import CheckedJSONRoute

router = APIRouter(route_class=CheckedJSONRoute)


def _serving(request: Request) -> AdapterServing:
    app = request.app
    if getattr(app.state, "adapters", None) is None:
        app.state.adapters = AdapterServing(app.state.engine, app.state.settings.adapter_roots)
    return app.state.adapters


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request):
    return PlainTextResponse(await _serving(request).load(body.lora_name, body.lora_path))


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request):
    return PlainTextResponse(await _serving(request).unload(body.lora_name))

# Reward scoring comes with the adapters: a reward adapter carries the value head it is scored with.
from server.score.router import router as score_router  # noqa: E402

router.include_router(score_router)
