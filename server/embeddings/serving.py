"""Embeddings for the OpenAI route (POST /v1/embeddings) and Ollama's (/api/embed, /api/embeddings): inputs
-> token ids -> `engine.embed()` (mean-pooled, unit-length final hidden states; see
engines/runtime/embeddings.py)."""
from __future__ import annotations

import array
import base64
import sys

from starlette.responses import Response

from engines.base import Engine, InvalidRequestError
from server.embeddings.protocol import EmbeddingRequest
from server.errors import APIError
from server.json_body import json_answer
from server.serving import encode_all, resolve_adapter


def base64_floats(vector: list[float]) -> str:
    """The vector as little-endian float32 bytes in base64, as OpenAI sends `encoding_format: base64`."""
    floats = array.array("f", vector)
    if sys.byteorder != "little":
        floats.byteswap()
    return base64.b64encode(floats.tobytes()).decode()


class EmbeddingServing:
    def __init__(self, engine: Engine):
        self.engine = engine

    async def token_ids(self, inputs: list[str | list[int]], *, truncate: bool = False) -> list[list[int]]:
        """Token ids of each input (text is tokenized as /v1/completions tokenizes a prompt). With
        `truncate` (Ollama's default), inputs longer than the context are cut to it; else the engine refuses
        them naming the input."""
        tokenizer = self.engine.tokenizer
        for i, item in enumerate(inputs):
            if not item:
                kind = "an empty string" if isinstance(item, str) else "an empty list of token ids"
                raise InvalidRequestError(f"input {i} is {kind}", param="input")
            if not isinstance(item, str):
                self.engine.check_token_ids(item, "input", f"input {i}")
        texts = [item for item in inputs if isinstance(item, str)]
        encoded = iter(await encode_all(tokenizer, texts))
        out = [next(encoded) if isinstance(item, str) else item for item in inputs]
        return [ids[:self.engine.info.max_model_len] for ids in out] if truncate else out

    async def embed(self, model: str | None, inputs: list[str | list[int]], *, truncate: bool = False
                    ) -> tuple[list[list[float]], int]:
        """(one vector per input, prompt tokens)."""
        adapter = resolve_adapter(self.engine, model)
        prompts = await self.token_ids(inputs, truncate=truncate)
        return await self.engine.embed(prompts, adapter), sum(map(len, prompts))

    async def create(self, req: EmbeddingRequest) -> Response:
        if req.dimensions is not None:
            raise APIError(400, "'dimensions' is not supported: this server returns the model's full-size "
                                "embeddings (its hidden size); leave it out", param="dimensions", code="unsupported")
        vectors, tokens = await self.embed(req.model, req.inputs())
        as_base64 = req.encoding_format == "base64"
        data = [{"object": "embedding", "index": i, "embedding": base64_floats(v) if as_base64 else v}
                for i, v in enumerate(vectors)]
        return await json_answer({"object": "list", "data": data, "model": req.model or self.engine.info.id,
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
