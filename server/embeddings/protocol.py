"""Wire models of POST /v1/embeddings (OpenAI's shape)."""
from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from server.protocol import OpenAIRequest

MAX_INPUTS = 2048  # OpenAI's limit per request


class EmbeddingRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("the input list is empty")
            if len(v) > MAX_INPUTS and not isinstance(v[0], int):
                raise ValueError(f"at most {MAX_INPUTS} inputs per request")
            if isinstance(v[0], int) and any(t < 0 for t in v):
                raise ValueError("token ids must be non-negative")
            if isinstance(v[0], list) and any(t < 0 for ids in v for t in ids):
                raise ValueError("token ids must be non-negative")
        return v

    def inputs(self) -> list[str | list[int]]:
        """Each input: a string or a list of token ids."""
        v = self.input
        if isinstance(v, str):
            return [v]
        if isinstance(v[0], int):
            return [list(v)]  # type: ignore[arg-type]
        return list(v)  # type: ignore[arg-type]
