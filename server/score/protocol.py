"""Wire models of LLaMA-Factory's reward-score endpoint."""
from __future__ import annotations

from pydantic import Field

from server.protocol import Int, OpenAIRequest

MAX_MESSAGES = 256


class ScoreEvaluationRequest(OpenAIRequest):
    model: str | None = None
    messages: list[str] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_length: Int | None = Field(None, gt=0)
