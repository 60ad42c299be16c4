"""Wire models of vLLM's runtime adapter endpoints."""
from __future__ import annotations

from pydantic import Field

from server.protocol import Int, OpenAIRequest


class LoadLoraAdapterRequest(OpenAIRequest):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(OpenAIRequest):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: Int | None = None  # vLLM sends it; names are what identify adapters here
