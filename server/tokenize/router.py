"""POST /tokenize and /detokenize: what the server would feed the model, and back — evaluation scripts use
them to count and cut prompts."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from engines.base import check_token_ids
from server.chat.prompt import render_prompt
from server.chat.protocol import ChatCompletionRequest
from server.json_body import CheckedJSONRoute, json_answer
from server.serving import decode_releasing_the_lock, resolve_adapter
from server.tokenize.protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter(route_class=CheckedJSONRoute)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    engine = request.app.state.engine
    resolve_adapter(engine, body.model)
    tokenizer = engine.tokenizer
    if body.messages is not None:
        chat = ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                     add_generation_prompt=body.add_generation_prompt,
                                     chat_template_kwargs=_template_kwargs(body))
        text = (await render_prompt(engine, chat, request.app.state.settings.kt_force_think)).text
        add_special = bool(body.add_special_tokens)
    else:
        text = body.prompt or ""
        add_special = True if body.add_special_tokens is None else body.add_special_tokens

    def answer() -> dict:  # a worker thread's work: megabytes of text give a million tokens
        tokens = tokenizer.encode(text, add_special_tokens=add_special)
        return {"count": len(tokens), "max_model_len": engine.info.max_model_len, "tokens": tokens,
                "token_strs": tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None}
    return await json_answer(await asyncio.to_thread(answer))


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    engine = request.app.state.engine
    resolve_adapter(engine, body.model)
    tokenizer = engine.tokenizer

    def answer() -> dict:  # a worker thread's work: up to a million ids
        check_token_ids(body.tokens, len(tokenizer), "tokens")  # what the tokenizer can decode
        return {"prompt": decode_releasing_the_lock(tokenizer, body.tokens)}
    return await json_answer(await asyncio.to_thread(answer))


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    """The tokenizer's configuration as vLLM's GET /tokenizer_info serves it (tokenizer_config.json's
    fields): what evaluation clients such as lm-eval's remote tokenizer read instead of fetching the
    tokenizer from a model hub."""
    engine = request.app.state.engine
    tokenizer = engine.tokenizer
    config = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items() if _shown(k, v)}
    special = {name: getattr(tokenizer, name, None) for name in
               ("bos_token", "eos_token", "pad_token", "unk_token")}
    return {**config, **{k: v for k, v in special.items() if isinstance(v, str) or v is None},
            "tokenizer_class": type(tokenizer).__name__, "chat_template": tokenizer.chat_template,
            "model_max_length": engine.info.max_model_len}


def _shown(key: str, value: object) -> bool:
    """Plain values only, and no file system paths: the init arguments also hold objects and where the
    tokenizer was read from."""
    return isinstance(value, (str, int, float, bool)) and key != "name_or_path" and not key.endswith("_file")


def _template_kwargs(body: TokenizeRequest) -> dict | None:
    if not body.continue_final_message:
        return body.chat_template_kwargs
    return {**(body.chat_template_kwargs or {}), "continue_final_message": True}
