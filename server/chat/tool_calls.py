"""DeepSeek-V3 tool calls: parse the model's tool-call text into OpenAI `tool_calls`, incrementally.

The format (V3, R1 and V3.1 write it; the deepseek3 / deepseekr1 templates show it to the model):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGS
    ```<｜tool▁call▁end｜>\\n<｜tool▁call▁begin｜>…<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The markers are added tokens that are not special, so they survive `skip_special_tokens`; the parser works
on text, so a marker spelt by ordinary tokens parses the same. Text before the calls is content. While
streaming, a call is announced (index, id, type, name) once its name line is complete and its arguments
follow as they arrive, the way OpenAI streams them; a tail that may still become a marker is held back.
Output that breaks the format from some point on is passed through as content from that point."""
from __future__ import annotations

import json

from engines.base import marker_prefix_tail
from server.chat.tool_call_parsing import IncrementalToolParser, ToolCall, ToolCallDelta, ToolDelta, new_call_id
from server.chat.tool_calls_dsml import DsmlToolParser

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
ARGS_OPEN = "```json\n"  # after the name line
ARGS_CLOSE = "\n```" + CALL_END
MAX_HEADER_CHARS = 512  # a name line longer than this is not a tool call


class DeepSeekV3ToolParser(IncrementalToolParser):
    def __init__(self) -> None:
        self._state = "content"  # content | between | header | args | after | broken
        self._buf = ""
        self._uncommitted = ""  # marker text consumed since the last call was announced or closed
        self.calls: list[ToolCall] = []

    @property
    def well_formed(self) -> bool:
        """Every call closed with JSON arguments, and the call block ended where it should."""
        return bool(self.calls) and self._state == "after" and all(
            c.complete and _is_json(c.arguments) for c in self.calls)

    def finish(self, cut: bool = False) -> ToolDelta:
        """The end of the output: what is still held back is argument text inside a call, else content.
        When the output was `cut` (max_tokens) inside the call block, the half-written markup of a call not
        yet announced is dropped rather than passed on as content: the reply is the calls so far."""
        out = ToolDelta()
        if self._state == "args":
            if self._buf:
                self.calls[-1].arguments += self._buf
                out.calls.append(ToolCallDelta(len(self.calls) - 1, arguments=self._buf))
        elif not (cut and self._state in ("between", "header")):
            out.content = self._uncommitted + self._buf
        self._buf = self._uncommitted = ""
        return out

    def _step(self, out: ToolDelta) -> bool:
        """One transition; False when it needs more text."""
        if self._state in ("content", "after", "broken"):
            return self._content(out)
        return {"between": self._between, "header": self._header, "args": self._args}[self._state](out)

    def _consume(self, n: int, state: str) -> bool:
        self._uncommitted += self._buf[:n]
        self._buf, self._state = self._buf[n:], state
        return True

    def _broken(self) -> bool:
        self._buf, self._uncommitted, self._state = self._uncommitted + self._buf, "", "broken"
        return True

    def _content(self, out: ToolDelta) -> bool:
        buf = self._buf
        at = buf.find(CALLS_BEGIN) if self._state == "content" else -1
        if at >= 0:
            out.content += buf[:at]
            self._buf = buf[at:]
            return self._consume(len(CALLS_BEGIN), "between")
        keep = marker_prefix_tail(buf, (CALLS_BEGIN,)) if self._state == "content" else 0
        out.content += buf[:len(buf) - keep]
        self._buf = buf[len(buf) - keep:]
        return False

    def _between(self, out: ToolDelta) -> bool:
        newlines = len(self._buf) - len(self._buf.lstrip("\n"))
        rest = self._buf[newlines:]
        for marker, state in ((CALL_BEGIN, "header"), (CALLS_END, "after")):
            if rest.startswith(marker):
                self._consume(newlines + len(marker), state)
                if state == "after":  # the block closed properly: its markers are not content
                    self._uncommitted = ""
                return True
        if CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest):
            return False
        return self._broken()

    def _header(self, out: ToolDelta) -> bool:
        head = "function" + SEP
        if not self._buf.startswith(head):
            return False if head.startswith(self._buf) else self._broken()
        name, newline, tail = self._buf[len(head):].partition("\n")
        if not newline:
            return self._broken() if len(name) > MAX_HEADER_CHARS else False
        if not tail.startswith(ARGS_OPEN):
            return False if ARGS_OPEN.startswith(tail) else self._broken()
        if not name.strip():
            return self._broken()
        call = ToolCall(id=new_call_id(), name=name.strip())
        self.calls.append(call)
        out.calls.append(ToolCallDelta(len(self.calls) - 1, id=call.id, name=call.name))
        self._buf, self._uncommitted, self._state = tail[len(ARGS_OPEN):], "", "args"
        return True

    def _args(self, out: ToolDelta) -> bool:
        call = self.calls[-1]
        end = self._buf.find(ARGS_CLOSE)
        piece = self._buf[:end] if end >= 0 else self._buf[:len(self._buf) - marker_prefix_tail(self._buf, (ARGS_CLOSE,))]
        if piece:
            call.arguments += piece
            out.calls.append(ToolCallDelta(len(self.calls) - 1, arguments=piece))
        if end < 0:
            self._buf = self._buf[len(piece):]
            return False
        call.complete = True
        self._buf, self._state = self._buf[end + len(ARGS_CLOSE):], "between"
        return True


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def tool_parser(markup: str):
    """A fresh parser for a model's tool-call markup: "deepseek_v3" (V3/R1/V3.1), "dsml" (V4) or
    "dsml_function_calls" (V3.2)."""
    if markup in ("dsml", "dsml_function_calls"):
        return DsmlToolParser("function_calls" if markup == "dsml_function_calls" else "tool_calls")
    return DeepSeekV3ToolParser()
