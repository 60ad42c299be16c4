"""Wire models of POST /v1/completions (the legacy text API that evaluation harnesses use)."""
from __future__ import annotations

from pydantic import Field, field_validator

from server.protocol import SamplingRequest

MAX_PROMPTS = 128
MAX_BEST_OF = 20  # OpenAI's bound: each candidate is a whole generation


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_BEST_OF)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("the prompt list is empty")
            if len(v) > MAX_PROMPTS and not isinstance(v[0], int):
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            if isinstance(v[0], list) and any(not p for p in v):
                raise ValueError("a token-id prompt is empty")
            token_prompts = [v] if isinstance(v[0], int) else [p for p in v if isinstance(p, list)]
            if any(t < 0 for p in token_prompts for t in p):
                raise ValueError("token ids must be non-negative")
        return v

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the batch: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]
