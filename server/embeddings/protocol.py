"""Wire models of POST /v1/embeddings (OpenAI's shape)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator

from server.protocol import Int, OpenAIRequest, PromptBatch, check_prompt_batch, split_prompt_batch

MAX_INPUTS = 2048  # OpenAI's limit per request


class EmbeddingRequest(OpenAIRequest):
    model: str | None = None
    input: Annotated[PromptBatch, AfterValidator(lambda v: check_prompt_batch(v, "input", MAX_INPUTS))]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """Each input: a string or a list of token ids."""
        return split_prompt_batch(self.input)
