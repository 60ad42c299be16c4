"""POST /tokenize and /detokenize: what the server would feed the model, and back — evaluation scripts use
them to count and cut prompts."""
from __future__ import annotations

from fastapi import APIRouter, Request

from engines.base import check_token_ids
from server.chat.prompt import render_prompt
from server.chat.protocol import ChatCompletionRequest
from server.json_body import CheckedJSONRoute
from server.serving import encode, resolve_adapter
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
        tokens = await encode(tokenizer, text, add_special_tokens=bool(body.add_special_tokens))
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = await encode(tokenizer, body.prompt or "", add_special_tokens=add_special)
    return {"count": len(tokens), "max_model_len": engine.info.max_model_len, "tokens": tokens,
            "token_strs": tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    engine = request.app.state.engine
    resolve_adapter(engine, body.model)
    check_token_ids(body.tokens, len(engine.tokenizer), "tokens")  # what the tokenizer can decode
    return {"prompt": engine.tokenizer.decode(body.tokens)}


def _template_kwargs(body: TokenizeRequest) -> dict | None:
    if not body.continue_final_message:
        return body.chat_template_kwargs
    return {**(body.chat_template_kwargs or {}), "continue_final_message": True}
