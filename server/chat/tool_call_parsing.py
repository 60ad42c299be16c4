"""What the tool-call parsers share (tool_calls.py: DeepSeek-V3's markup, tool_calls_dsml.py: V3.2's and V4's):
the call and delta types the chat output is built from, and the text-in state machine each parser steps."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCallDelta:
    """One streamed piece of a call: the first carries id and name, later ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def openai(self) -> dict:
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ToolDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class IncrementalToolParser:
    """What the tool-call parsers share: text in, a state machine stepping over it until it needs more."""

    _buf: str

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        self._buf += text
        while self._step(out):
            pass
        return out

    def _step(self, out: ToolDelta) -> bool:
        raise NotImplementedError
