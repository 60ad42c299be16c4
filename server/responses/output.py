"""A response's output items, built from the chat deltas of one choice — the same way whether they arrive
one step at a time (streaming: each call returns the events to send) or as one whole reply.

Items in the order the model writes them: reasoning (`reasoning_text`), the message (`output_text`), then a
`function_call` item per call. The event names and fields are the Responses API's."""
from __future__ import annotations

import copy
import uuid
from typing import Any

from server.chat.output import ChatDelta


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._sequence = 0

    def event(self, type: str, **fields: Any) -> dict[str, Any]:
        """One event; the items and parts it carries are copied as they are now (they keep growing)."""
        for key in ("item", "part", "response"):
            if key in fields:
                fields[key] = copy.deepcopy(fields[key])
        event = {"type": type, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def add(self, delta: ChatDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls:
            if call.id is not None:
                events += self._open_item({"id": item_id("fc"), "type": "function_call", "call_id": call.id,
                                           "name": call.name, "arguments": "", "status": "in_progress"})
            if call.arguments:
                item = self._open
                assert item is not None and item["type"] == "function_call"
                item["arguments"] += call.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=len(self.items) - 1, delta=call.arguments))
        return events

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """End the item being written; `status` "incomplete" when the output was cut off."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        index = len(self.items) - 1
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=[]),
                       self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)]
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=item["content"][0]["text"]))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))
        return events + [self.event("response.output_item.done", output_index=index, item=item)]

    def _open_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.items.append(item)
        self._open = item
        return events + [self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            if kind == "message":
                events += self._open_item({"id": item_id("msg"), "type": "message", "status": "in_progress",
                                           "role": "assistant", "content": []})
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                events.append(self.event("response.content_part.added", item_id=self._open["id"],
                                         output_index=len(self.items) - 1, content_index=0, part=part))
                self._open["content"].append(part)
            else:
                events += self._open_item({"id": item_id("rs"), "type": "reasoning", "summary": [],
                                           "content": [{"type": "reasoning_text", "text": ""}],
                                           "status": "in_progress"})
        item = self._open
        item["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self.event(name, item_id=item["id"], output_index=len(self.items) - 1, content_index=0,
                                 delta=text, **extra))
        return events
