"""Reasoning parsers: split a thinking model's text into `reasoning_content` and `content`.

`deepseek_r1` (`--reasoning-parser deepseek_r1`): DeepSeek-R1 thinks between `<think>` and `</think>`, then
answers. As DeepSeek's API and vLLM do, the text inside goes to `reasoning_content`, the rest to `content`
(without the blank lines R1 writes after `</think>`). When the prompt already opened the thinking (R1's
template ends with `<think>\\n`, as does every prompt under `kt_force_think`), the output starts inside it;
otherwise a `<think>` at the very start of the output opens it. A thinking that never closes is all
reasoning. The parser is incremental: each `feed` returns only text that can no longer turn into a tag,
so a `</think>` split across deltas never leaks into either field."""
from __future__ import annotations

from dataclasses import dataclass

from engines.base import marker_prefix_tail

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("deepseek_r1",)


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: {name!r} is not a known parser; known: {', '.join(REASONING_PARSERS)}")


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether the prompt ends by opening a `<think>` block, so the model's output starts in its reasoning."""
    return prompt_text.rstrip().endswith(THINK_START)


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class DeepSeekR1ReasoningParser:
    def __init__(self, starts_in_reasoning: bool):
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._pending = ""  # text held back: it may still become a tag
        self._strip_newlines = False  # drop the newlines that follow </think>
        self._strip_newline = False  # drop the newline that follows an opening <think>

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        buf, self._pending = self._pending + text, ""
        while buf:
            if self._state == "start":
                head = buf.lstrip()
                if head.startswith(THINK_START):  # the newline R1 writes after <think> is not reasoning
                    buf, self._state, self._strip_newline = head[len(THINK_START):], "reasoning", True
                elif THINK_START.startswith(head):
                    self._pending, buf = buf, ""
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                if self._strip_newline:
                    buf, self._strip_newline = buf.removeprefix("\n"), False
                    continue
                end = buf.find(THINK_END)
                if end >= 0:
                    out.reasoning += buf[:end]
                    buf, self._state, self._strip_newlines = buf[end + len(THINK_END):], "content", True
                else:
                    keep = marker_prefix_tail(buf, (THINK_END,))
                    out.reasoning += buf[:len(buf) - keep]
                    self._pending, buf = buf[len(buf) - keep:], ""
            else:
                if self._strip_newlines:
                    buf = buf.lstrip("\n")
                    self._strip_newlines = not buf
                out.content += buf
                buf = ""
        return out

    def finish(self) -> ReasoningDelta:
        """Release what was held back at the end of the output."""
        pending, self._pending = self._pending, ""
        if self._state == "reasoning":
            return ReasoningDelta(reasoning=pending)
        return ReasoningDelta(content=pending)


def reasoning_parser(name: str | None, starts_in_reasoning: bool) -> DeepSeekR1ReasoningParser | None:
    """The parser named by the `reasoning_parser` setting, or None when none is configured."""
    check_reasoning_parser(name)
    return None if name is None else DeepSeekR1ReasoningParser(starts_in_reasoning)
