"""Ollama's wire format: requests, and their conversion into the OpenAI chat request the serving layer
already understands. Unknown fields (keep_alive, images, ...) are accepted and ignored."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from server.chat.protocol import ChatCompletionRequest
from server.embeddings.protocol import MAX_INPUTS
from server.errors import checked
from server.protocol import Int, check_prompt_batch

# The Ollama API level these routes follow; clients compare it against the features they need.
OLLAMA_API_VERSION = "0.6.2"


def _a_number(value: Any) -> Any:
    if isinstance(value, (bool, str)):
        raise ValueError(f"expected an integer, got a {'boolean' if isinstance(value, bool) else 'string'}")
    return value


# An integer option: Ollama reads `options` as JSON numbers, so 69.0 is 69, but a boolean or a string is
# refused. The request's own integer fields (`context`, `dimensions`) are strict, as Ollama's typed fields are.
OptionInt = Annotated[int, BeforeValidator(_a_number)]


class OllamaModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, protected_namespaces=())


class Options(OllamaModel):
    """Ollama's runtime options that mean something here; the rest (num_ctx, num_gpu, ...) are ignored."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: OptionInt | None = None
    min_p: float | None = None
    num_predict: OptionInt | None = None  # -1: until the context is full
    seed: OptionInt | None = None
    stop: str | list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def openai(self) -> dict[str, Any]:
        fields = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "min_p": self.min_p, "seed": self.seed, "stop": self.stop,
                  "repetition_penalty": self.repeat_penalty, "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty,
                  "max_tokens": self.num_predict if self.num_predict is not None and self.num_predict > 0 else None}
        return {k: v for k, v in fields.items() if v is not None}


class ToolCallFunction(OllamaModel):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class ToolCall(OllamaModel):
    function: ToolCallFunction


class Message(OllamaModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None

    def openai(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [{"type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments if isinstance(c.function.arguments, str)
                else json.dumps(c.function.arguments, ensure_ascii=False)}} for c in self.tool_calls]
        if self.tool_name:
            msg["name"] = self.tool_name
        return msg


class GenerationFields(OllamaModel):
    model: str
    stream: bool = True
    format: Literal["json", ""] | dict[str, Any] | None = None
    options: Options = Field(default_factory=Options)
    think: bool | None = None

    def openai_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"model": model_name(self.model), **self.options.openai()}
        if self.format == "json":
            fields["response_format"] = {"type": "json_object"}
        elif isinstance(self.format, dict):
            fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": self.format}}
        return fields


class ChatRequest(GenerationFields):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    def openai(self) -> ChatCompletionRequest:
        return checked(lambda: ChatCompletionRequest.model_validate({
            **self.openai_fields(), "messages": [m.openai() for m in self.messages], "tools": self.tools or None}))


class GenerateRequest(GenerationFields):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    context: list[Int] | None = None
    suffix: str | None = None

    def openai(self) -> ChatCompletionRequest:
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": self.prompt}]
        return checked(lambda: ChatCompletionRequest.model_validate({**self.openai_fields(), "messages": messages}))


class EmbedRequest(OllamaModel):
    model: str
    input: Annotated[str | list[str], AfterValidator(lambda v: check_prompt_batch(v, "input", MAX_INPUTS))]
    truncate: bool = True  # cut inputs longer than the context to it (Ollama's default), else refuse them
    dimensions: Int | None = None

    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class EmbeddingsRequest(OllamaModel):
    """The older /api/embeddings: one prompt, one vector."""

    model: str
    prompt: str = ""


class ShowRequest(OllamaModel):
    model: str | None = None
    name: str | None = None  # the older spelling of `model`

    @property
    def model_name(self) -> str:
        return model_name(self.model or self.name or "")


def model_name(name: str) -> str:
    """Ollama names carry a tag (`name:latest`); the served model and adapters are known without it."""
    return name[:-len(":latest")] if name.endswith(":latest") else name


def tagged(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


def timestamp() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
