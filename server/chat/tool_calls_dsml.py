"""DeepSeek-V3.2 and V4 tool calls ("DSML" markup): parse the model's tool-call block into OpenAI `tool_calls`.

The format (the conversation formats show it to the model; engines/kt/families/dsml_chat.py), V4's block being
`tool_calls` and V3.2's `function_calls`:

    CONTENT

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">text value</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY2" string="false">JSON value</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

Same interface as DeepSeekV3ToolParser (`feed`, `finish`, `calls`, `well_formed`). Content before the block
streams as it arrives; each call is announced whole (index, id, name and its JSON arguments in one delta)
once its `</｜DSML｜invoke>` is in. Output that breaks the format is passed through as content."""
from __future__ import annotations

import json
import re

from engines.base import marker_prefix_tail
from server.chat.tool_call_parsing import IncrementalToolParser, ToolCall, ToolCallDelta, ToolDelta, new_call_id

DSML = "｜DSML｜"
INVOKE_END = f"</{DSML}invoke>"
_INVOKE = re.compile(rf'^\s*<{DSML}invoke name="([^"<>\n]+)">\n?(.*?)</{DSML}invoke>', re.S)
_PARAM = re.compile(rf'<{DSML}parameter name="([^"<>\n]+)" string="(true|false)">(.*?)</{DSML}parameter>', re.S)
MAX_INVOKE_CHARS = 1 << 20


class DsmlToolParser(IncrementalToolParser):
    def __init__(self, block: str = "tool_calls") -> None:
        self.block_begin, self.block_end = f"<{DSML}{block}>", f"</{DSML}{block}>"
        self._state = "content"  # content | block | after | broken
        self._buf = ""
        self._raw = ""  # the block's text so far, returned as content if it breaks
        self.calls: list[ToolCall] = []

    @property
    def well_formed(self) -> bool:
        return bool(self.calls) and self._state == "after"

    def finish(self, cut: bool = False) -> ToolDelta:
        out = ToolDelta()
        if self._state == "block" and not cut:
            out.content = self._raw + self._buf
        elif self._state != "block":
            out.content = self._buf
        self._buf = self._raw = ""
        return out

    def _step(self, out: ToolDelta) -> bool:
        if self._state == "block":
            return self._invoke(out)
        buf = self._buf
        at = buf.find(self.block_begin) if self._state == "content" else -1
        if at >= 0:
            out.content += buf[:at].rstrip("\n")
            begin = at + len(self.block_begin)
            self._raw, self._buf, self._state = buf[at:begin], buf[begin:], "block"
            return True
        keep = 0
        if self._state == "content":  # a tail that may become the block's start, and the blank lines before it
            body = buf[:len(buf) - marker_prefix_tail(buf, (self.block_begin,))]
            keep = len(buf) - len(body.rstrip("\n"))
        out.content += buf[:len(buf) - keep]
        self._buf = buf[len(buf) - keep:]
        return False

    def _invoke(self, out: ToolDelta) -> bool:
        stripped = self._buf.lstrip("\n")
        if stripped.startswith(self.block_end):
            self._buf, self._raw, self._state = stripped[len(self.block_end):], "", "after"
            return True
        if INVOKE_END not in self._buf:
            if len(self._buf) > MAX_INVOKE_CHARS or not (stripped.startswith(f"<{DSML}invoke")
                                                          or f"<{DSML}invoke".startswith(stripped)
                                                          or self.block_end.startswith(stripped)):
                return self._broken()
            return False
        match = _INVOKE.match(self._buf)
        arguments = _arguments(match.group(2)) if match else None
        if arguments is None:
            return self._broken()
        call = ToolCall(id=new_call_id(), name=match.group(1), arguments=arguments, complete=True)
        self.calls.append(call)
        out.calls.append(ToolCallDelta(len(self.calls) - 1, id=call.id, name=call.name, arguments=arguments))
        self._raw += self._buf[:match.end()]
        self._buf = self._buf[match.end():]
        return True

    def _broken(self) -> bool:
        self._buf, self._raw, self._state = self._raw + self._buf, "", "broken"
        return True


def _arguments(body: str) -> str | None:
    """The parameters of one invoke as a JSON object text; None when one of them is not well formed."""
    values: dict[str, object] = {}
    for name, is_string, raw in _PARAM.findall(body):
        if is_string == "true":
            values[name] = raw
            continue
        try:
            values[name] = json.loads(raw)
        except ValueError:
            return None
    if _PARAM.sub("", body).strip():
        return None
    return json.dumps(values, ensure_ascii=False)
