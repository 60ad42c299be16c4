"""GET /v1/models: the base model and every loaded adapter (its `parent` is the base model's id);
GET /v1/models/{model}: one of them (`client.models.retrieve`)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from engines.base import AdapterInfo, Engine, NotFoundError

router = APIRouter()


def model_cards(engine: Engine) -> list[dict[str, Any]]:
    info = engine.info
    cards = [{"id": info.id, "object": "model", "created": info.created, "owned_by": "ktserve",
              "root": info.id, "parent": None, "max_model_len": info.max_model_len}]
    cards += [adapter_card(engine, adapter) for adapter in engine.list_adapters()]
    return cards


def adapter_card(engine: Engine, adapter: AdapterInfo) -> dict[str, Any]:
    info = engine.info
    card = {"id": adapter.name, "object": "model", "created": adapter.created, "owned_by": "ktserve",
            "root": adapter.path, "parent": info.id, "max_model_len": info.max_model_len}
    if adapter.expert_lora:
        card["expert_lora"] = adapter.expert_lora
    return card


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": model_cards(request.app.state.engine)}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request):
    cards = model_cards(request.app.state.engine)
    for card in cards:
        if card["id"] == model:
            return card
    raise NotFoundError(f"the model '{model}' does not exist; this server serves: "
                        f"{', '.join(c['id'] for c in cards)}", param="model")
