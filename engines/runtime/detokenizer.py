"""Incremental detokenization with stop strings.

Text is released only when it is final: a token that ends inside a multi-byte UTF-8 character is held until
the character completes (so no delta ever carries a broken character), and a tail that could still grow into
a stop string is held until it can't (so a stop string split across tokens never leaks)."""
from __future__ import annotations

from typing import Any

from engines.base import marker_prefix_tail

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True, stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window (its text is already in self.text)
        self._read_offset = 0  # tokens before this are in self.text
        self.text = ""  # all text decoded so far, up to a stop string when one matched
        self._emitted = 0  # characters of self.text already released
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add_token(self, token_id: int) -> None:
        """Append one generated token; extend `text` if it completes new characters, then look for stops."""
        if self.stopped_by is not None:
            return
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            self._append(new_text[len(prefix_text):])
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)

    def flush(self) -> None:
        """At the end: release whatever the window still holds, even an incomplete character."""
        if self.stopped_by is None and self._read_offset < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset:])
            self._read_offset = len(self._ids)
            if len(new_text) > len(prefix_text):
                self._append(new_text[len(prefix_text):])

    def _append(self, delta: str) -> None:
        search_from = max(0, len(self.text) - self._max_stop + 1)
        self.text += delta
        if not self._stop:
            return
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, search_from)) != -1]
        if hits:
            index, stop = min(hits)
            self.text = self.text[:index + len(stop)] if self._include_stop else self.text[:index]
            self.stopped_by = stop

    def _holdback(self) -> int:
        """Length of the longest tail of the unreleased text that is a proper prefix of a stop string."""
        return marker_prefix_tail(self.text[self._emitted:], self._stop)

    def take_delta(self, final: bool = False) -> str:
        """The text that became final since the last call."""
        end = len(self.text) if final or self.stopped_by is not None else len(self.text) - self._holdback()
        delta = self.text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return delta
