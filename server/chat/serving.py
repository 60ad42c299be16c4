"""POST /v1/chat/completions: messages -> prompt ids (the model's chat template) -> engine -> OpenAI JSON."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import Request

from engines.base import Engine, GenerationOutput, InvalidRequestError, TokenLogprob
from server.chat.protocol import ChatCompletionRequest
from server.protocol import check_max_tokens, usage
from server.serving import (
    Deadline, collect, error_chunk, merged, new_id, resolve_adapter, sse_response, submit_choices, with_deadline,
)


def render_prompt(engine: Engine, req: ChatCompletionRequest) -> list[int]:
    """Apply the chat template. Template errors (e.g. roles out of order) are the client's to fix: 400."""
    tokenizer = engine.tokenizer
    messages = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        messages.append(msg)
    try:
        text = tokenizer.apply_chat_template(messages, tools=req.tools, tokenize=False,
                                             add_generation_prompt=req.add_generation_prompt,
                                             **(req.chat_template_kwargs or {}))
    except Exception as exc:  # jinja raises TemplateError (and others) for conversations it rejects
        raise InvalidRequestError(f"the chat template cannot render these messages: {exc}",
                                  param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if entries is None:
        return None
    return {"content": [{
        "token": e.token, "logprob": e.logprob, "bytes": e.bytes,
        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in e.top],
    } for e in entries]}


class ChatServing:
    def __init__(self, engine: Engine, request_timeout: float | None = None):
        self.engine = engine
        self.request_timeout = request_timeout

    async def create(self, req: ChatCompletionRequest, raw: Request):
        engine = self.engine
        adapter = resolve_adapter(engine, req.model)
        prompt = render_prompt(engine, req)
        limit = engine.info.max_model_len
        max_tokens = check_max_tokens(req.requested_max_tokens, limit, len(prompt), limit, "messages")
        top = (req.top_logprobs or 0) if req.logprobs else None
        vocab = len(engine.tokenizer)
        params = [req.sampling_params(max_tokens=max_tokens, logprobs=top, vocab_size=vocab, choice=i)
                  for i in range(req.n)]
        request_id = new_id("chatcmpl")
        handles = submit_choices(engine, prompt, params, adapter, request_id)
        model = req.model or engine.info.id
        if req.stream:
            return sse_response(self._stream(req, request_id, model, handles, len(prompt)), handles)
        outputs = await collect(raw, handles, self.request_timeout)
        return self._response(request_id, model, outputs, len(prompt))

    def _response(self, request_id: str, model: str, outputs: list[GenerationOutput], n_prompt: int) -> dict:
        choices = []
        for i, out in enumerate(outputs):
            if out.finish_reason == "error":
                from server.errors import APIError
                raise APIError(500, out.error or "generation failed", type="internal_error")
            choices.append({"index": i, "message": {"role": "assistant", "content": out.text},
                            "logprobs": chat_logprobs(out.logprobs), "finish_reason": out.finish_reason,
                            "stop_reason": out.stop_reason})
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": usage(n_prompt, sum(o.completion_tokens for o in outputs))}

    async def _stream(self, req: ChatCompletionRequest, request_id: str, model: str, handles, n_prompt: int
                      ) -> AsyncIterator[dict[str, Any]]:
        created = int(time.time())
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        include_usage = req.include_usage

        def chunk(choices: list[dict], usage_value: Any = None) -> dict[str, Any]:
            body = {**base, "choices": choices}
            if include_usage:
                body["usage"] = usage_value
            return body

        for i in range(len(handles)):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        completion_tokens = [0] * len(handles)
        try:
            async for i, out in with_deadline(merged(handles), Deadline(self.request_timeout)):
                completion_tokens[i] = out.completion_tokens
                if out.finish_reason == "error":
                    yield error_chunk(out.error or "generation failed")
                    return
                if out.text or out.logprobs:
                    yield chunk([{"index": i, "delta": {"content": out.text}, "logprobs": chat_logprobs(out.logprobs),
                                  "finish_reason": None}])
                if out.finished:
                    yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": out.finish_reason,
                                  "stop_reason": out.stop_reason}])
        except TimeoutError:
            yield error_chunk(f"the request did not finish within {self.request_timeout:g} seconds",
                              "timeout_error", "request_timeout")
            return
        if include_usage:
            yield chunk([], usage(n_prompt, sum(completion_tokens)))
