"""Wire models of POST /tokenize and /detokenize (vLLM's shapes): a prompt as /v1/completions sends it, or
chat messages with the chat template applied as /v1/chat/completions renders them."""
from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from server.chat.protocol import ChatMessage, Tool
from server.protocol import OpenAIRequest, TokenIds


class TokenizeRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_of(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either 'prompt' or 'messages'")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("'continue_final_message' needs 'add_generation_prompt': false")
        return self


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: TokenIds
