"""Wire models of POST /v1/responses (OpenAI's Responses API) and their conversion into the chat request
the serving layer already runs: input items become chat messages, `instructions` a leading system message,
function tools chat tools, `text.format` a response_format.

Stateless: nothing is stored, so `previous_response_id` (which needs a stored response) is refused with a
400 naming it; `store` is accepted and the response says `"store": false`."""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from server.chat.protocol import FUNCTION_NAME_PATTERN, ChatCompletionRequest, OutputFormat
from server.errors import checked
from server.protocol import Int, OpenAIRequest


TEXT_PARTS = ("input_text", "output_text", "text")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class ContentPart(OpenAIRequest):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(OpenAIRequest):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(OpenAIRequest):
    """A call the model made earlier in the conversation (as a previous response's output carried it)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(OpenAIRequest):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(OpenAIRequest):
    """A previous response's reasoning, sent back by clients that replay output: not shown to the model again
    (DeepSeek's templates drop earlier turns' reasoning too)."""

    type: Literal["reasoning"]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(OpenAIRequest):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(OpenAIRequest):
    type: Literal["function"]
    name: str


class TextFormat(OutputFormat):
    schema_hint: ClassVar[str] = "a 'schema'"
    name: str = "response"
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(OpenAIRequest):
    format: TextFormat | None = None


class ResponsesRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        """Name what this server cannot take (images, files, hosted tools' items) before pydantic's union
        errors would bury it."""
        if not isinstance(value, list):
            return value
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                continue
            kind = item.get("type", "message")
            if kind not in ITEM_TYPES:
                raise ValueError(f"input[{i}] is a {kind!r} item; this server takes {', '.join(ITEM_TYPES)} items")
            for j, part in enumerate(item.get("content") if isinstance(item.get("content"), list) else []):
                if isinstance(part, dict) and part.get("type") not in TEXT_PARTS:
                    raise ValueError(f"input[{i}].content[{j}] is {part.get('type')!r}; this server takes text "
                                     f"only ({', '.join(TEXT_PARTS)})")
        return value

    def chat(self) -> ChatCompletionRequest:
        """The same request as a chat completion."""
        fields: dict[str, Any] = {"model": self.model, "messages": self.messages(), "n": 1,
                                  "max_tokens": self.max_output_tokens, "temperature": self.temperature,
                                  "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                               for t in self.tools]
        if isinstance(self.tool_choice, FunctionToolChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        format = self.text.format if self.text else None
        if format is not None and format.type != "text":
            fields["response_format"] = {"type": format.type} if format.type == "json_object" else {
                "type": "json_schema", "json_schema": {"name": format.name, "schema": format.json_schema,
                                                       "strict": format.strict}}
        return checked(lambda: ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}))

    def messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1].setdefault("tool_calls", []).append(call)  # text and calls: one turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return messages

    def echo(self) -> dict[str, Any]:
        """The request's settings as a response object repeats them."""
        tools = [{**t.model_dump(exclude_none=True), "strict": bool(t.strict)} for t in self.tools or []]
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, FunctionToolChoice) else \
            self.tool_choice or "auto"
        format = self.text.format.model_dump(by_alias=True, exclude_none=True) if self.text and self.text.format \
            else {"type": "text"}
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": self.parallel_tool_calls is not False, "previous_response_id": None,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p, "tool_choice": choice, "tools": tools,
                "text": {"format": format}, "truncation": "disabled", "store": False,
                "metadata": self.metadata or {}, "user": self.user, "reasoning": None, "error": None}

