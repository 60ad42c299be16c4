"""Wire models of POST /v1/chat/completions."""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from server.protocol import Int, OpenAIRequest, SamplingRequest

# OpenAI's rule for function names; it also keeps them safe to splice into a grammar.
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"


class TextPart(OpenAIRequest):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """Said plainly here: otherwise the union's first complaint ("should be a valid string") is all a
        client sees for an image part."""
        if isinstance(value, list):
            if not value:
                raise ValueError("an empty list of content parts")
            for k, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"part {k} is of type {kind!r}; this server takes text parts only")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _calls_name_a_function(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for k, call in enumerate(value or []):
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError(f"call {k} needs a 'function' object with a 'name'")
        return value

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs 'content'")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(OpenAIRequest):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _a_json_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """Checked whatever `tool_choice` is: a schema the server cannot read is refused before the model
        sees it, not only when a forced call would compile it."""
        if value is not None:
            from jsonschema import Draft202012Validator, SchemaError
            try:
                Draft202012Validator.check_schema(value)
            except SchemaError as exc:
                raise ValueError(f"not a valid JSON schema: {exc.message}") from None
            except RecursionError:
                raise ValueError("the JSON schema is nested too deeply") from None
        return value


class Tool(OpenAIRequest):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(OpenAIRequest):
    name: str


class NamedToolChoice(OpenAIRequest):
    type: Literal["function"] = "function"
    function: FunctionName


class JsonSchemaFormat(OpenAIRequest):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class OutputFormat(OpenAIRequest):
    """What the output must be: free text, a JSON object, or JSON matching a schema, which a `json_schema`
    format must then carry (`schema_hint` says where, for the error)."""
    schema_hint: ClassVar[str] = "a 'json_schema' object with a 'schema'"
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Any = None

    @model_validator(mode="after")
    def _schema_given(self) -> "OutputFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError(f"type 'json_schema' needs {self.schema_hint}")
        return self


class ResponseFormat(OutputFormat):
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # how hard a thinking model reasons, for chat formats that take it (DeepSeek-V4: "high" / "max"; "low" and
    # "medium" are its default); passed to the chat format as the `reasoning_effort` keyword
    reasoning_effort: Literal["low", "medium", "high", "max"] | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("at least one message is required")
        return v

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("'top_logprobs' requires 'logprobs': true")
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice if self.tools or self.tool_choice == "none" else "none"
        return "auto" if self.tools else "none"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
