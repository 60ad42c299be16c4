"""One choice's model text -> what a chat reply carries: reasoning, content and tool calls.

The text goes through the reasoning parser (when one is configured), then what is content goes through the
tool-call parser (when tools are offered). Streaming and non-streaming share this path: streaming sends each
`ChatDelta` as it comes; a whole reply is the same deltas joined by `reply()`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from server.chat.tool_call_parsing import ToolCallDelta
from server.chat.tool_calls import DeepSeekV3ToolParser
from server.reasoning import DeepSeekR1ReasoningParser, ReasoningDelta


@dataclass(slots=True)
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass(slots=True)
class ChatReply:
    """A finished choice, as the non-streaming response carries it."""

    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str | None


class ChatOutputParser:
    def __init__(self, reasoning: DeepSeekR1ReasoningParser | None, tools: DeepSeekV3ToolParser | None,
                 prefix: str = "", calls_finish: str = "tool_calls"):
        self._reasoning = reasoning
        self._tools = tools
        self._calls_finish = calls_finish  # a reply of complete calls ends with this reason
        self._prefix = prefix  # text the reply starts with that the model did not write (kt_force_think)
        self._content_text: list[str] = []  # content as it was before tool-call parsing

    def feed(self, text: str) -> ChatDelta:
        text, self._prefix = self._prefix + text, ""
        split = self._reasoning.feed(text) if self._reasoning else ReasoningDelta(content=text)
        return self._split_tools(split)

    def finish(self, engine_reason: str | None = None) -> ChatDelta:
        """The end of the text: release what the parsers held back."""
        tail = self.feed("") if self._prefix else ChatDelta()
        split = self._reasoning.finish() if self._reasoning else ReasoningDelta()
        last = self._split_tools(split)
        if self._tools is not None:
            held = self._tools.finish(cut=engine_reason == "length")
            last.content += held.content
            last.tool_calls += held.calls
        return join_deltas([tail, last])

    def _split_tools(self, split: ReasoningDelta) -> ChatDelta:
        self._content_text.append(split.content)
        if self._tools is None or not split.content:
            return ChatDelta(split.reasoning, split.content)
        out = self._tools.feed(split.content)
        return ChatDelta(split.reasoning, out.content, out.calls)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """`calls_finish` ("tool_calls") when the model ended its turn after complete calls; the engine's
        reason otherwise."""
        calls = self._tools.calls if self._tools is not None else []
        if engine_reason == "stop" and calls and all(c.complete for c in calls):
            return self._calls_finish
        return engine_reason

    def reply(self, text: str, engine_reason: str | None) -> ChatReply:
        """Parse a whole generation. Tool calls that are not well formed leave the text as plain content —
        except when max_tokens cut the output inside the calls: then the reply holds the calls as far as they
        got (the last one's arguments unfinished) with finish_reason "length", exactly what the stream sent."""
        whole = join_deltas([self.feed(text), self.finish(engine_reason)])
        reasoning = whole.reasoning or None
        if self._tools is None or not self._tools.calls:
            return ChatReply(whole.content, reasoning, None, engine_reason)
        if engine_reason == "length" and not self._tools.well_formed:
            calls = [c.openai() for c in self._tools.calls]
            return ChatReply(whole.content or None, reasoning, calls, engine_reason)
        if not self._tools.well_formed:
            return ChatReply("".join(self._content_text), reasoning, None, engine_reason)
        calls = [c.openai() for c in self._tools.calls]
        return ChatReply(whole.content or None, reasoning, calls, self.finish_reason(engine_reason))


def join_deltas(deltas: list[ChatDelta]) -> ChatDelta:
    return ChatDelta("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas),
                     [c for d in deltas for c in d.tool_calls])
