"""POST /v1/score/evaluation: LLaMA-Factory's reward scores. Each message string is tokenized as it is
(no chat template, no special tokens added), truncated to `max_length` tokens from the right, and scored by
the value head on the final hidden state of its last token."""
from __future__ import annotations

from engines.base import Engine, InvalidRequestError
from server.score.protocol import ScoreEvaluationRequest
from server.serving import encode, new_id, resolve_adapter


class ScoreServing:
    def __init__(self, engine: Engine):
        self.engine = engine

    async def tokenize(self, messages: list[str], max_length: int | None) -> list[list[int]]:
        limit = min(max_length or self.engine.info.max_model_len, self.engine.info.max_model_len)
        prompts = [(await encode(self.engine.tokenizer, m, add_special_tokens=False))[:limit] for m in messages]
        empty = [i for i, p in enumerate(prompts) if not p]
        if empty:
            raise InvalidRequestError(f"messages[{empty[0]}] is empty after tokenization", param="messages")
        return prompts

    async def create(self, req: ScoreEvaluationRequest) -> dict:
        adapter = resolve_adapter(self.engine, req.model)
        scores = await self.engine.score(await self.tokenize(req.messages, req.max_length), adapter)
        return {"id": new_id("scoreeval"), "object": "score.evaluation", "model": req.model or self.engine.info.id,
                "scores": scores}
