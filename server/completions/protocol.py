"""Wire models of POST /v1/completions (the legacy text API that evaluation harnesses use)."""
from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from server.protocol import Int, PromptBatch, SamplingRequest, check_prompt_batch, split_prompt_batch

MAX_PROMPTS = 128
MAX_BEST_OF = 20  # OpenAI's bound: each candidate is a whole generation


class CompletionRequest(SamplingRequest):
    prompt: Annotated[PromptBatch, AfterValidator(lambda v: check_prompt_batch(v, "prompt", MAX_PROMPTS))]
    max_tokens: Int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: Int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: Int | None = Field(None, ge=1, le=MAX_BEST_OF)

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the batch: a string or a list of token ids."""
        return split_prompt_batch(self.prompt)
