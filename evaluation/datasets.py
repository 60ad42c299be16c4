"""Evaluation datasets: one file, one form, a list of `Sample`s.

Three record forms are accepted, detected per file from the keys of each record:

- **alpaca**: `instruction`, `output`, optional `input`, `system`, `history` ([[user, assistant], ...]).
  The prompt is `instruction` and `input` joined by a newline, as LLaMA-Factory builds it.
- **sharegpt**: `conversations` ([{"from": "human"|"gpt"|"system", "value": ...}]) or OpenAI-style
  `messages` ([{"role": "user"|"assistant"|"system", "content": ...}]), optional top-level `system`.
  The last assistant turn is the reference; the turns before it are the prompt.
- **choice** (multiple choice): `question`, `options` (a list, lettered A, B, ... or a dict
  {"A": ...}), `answer` (a letter), optional `system`.

A file is JSONL (one record a line) or JSON (a list of records); the first non-blank character tells
which, whatever the extension. Errors name the file and the line of the offending record.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

FORMS = ("alpaca", "sharegpt", "choice")

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system"}


@dataclass(slots=True)
class Sample:
    """One evaluation item: what to send and what to compare the answer with."""

    index: int                          # position in the file; the key of results.jsonl
    messages: list[dict[str, str]]      # the chat prompt
    reference: str                      # expected answer; for multiple choice, the answer letter
    options: dict[str, str] | None = None   # letter -> option text, multiple choice only
    choice_prompt: str = ""             # question + lettered options + "Answer:", multiple choice only


@dataclass(slots=True)
class Dataset:
    path: Path
    form: str
    samples: list[Sample]


def load_dataset(path: str | Path) -> Dataset:
    """Read a dataset file and turn every record into a `Sample`.

    Raises ValueError naming the file and line when a record fits no form, mixes forms with the rest
    of the file, or has a malformed field.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset {path}: no such file")
    form = None
    samples = []
    for line, record in _read_records(path):
        where = f"{path}, line {line}"
        record_form = detect_form(record, where)
        if form is None:
            form = record_form
        elif record_form != form:
            raise ValueError(f"{where}: record is {record_form} but the file's first record is {form}; "
                             "put each form in its own file")
        samples.append(_PARSERS[form](record, len(samples), where))
    if not samples:
        raise ValueError(f"dataset {path}: no records")
    return Dataset(path=path, form=form, samples=samples)


def detect_form(record: object, where: str) -> str:
    """Return the form ("alpaca", "sharegpt" or "choice") that `record`'s keys describe."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if "conversations" in record or "messages" in record:
        return "sharegpt"
    if "question" in record and "options" in record:
        return "choice"
    if "instruction" in record and "output" in record:
        return "alpaca"
    raise ValueError(
        f"{where}: record fits no dataset form (keys: {sorted(record)}); expected Alpaca "
        "(instruction, output), ShareGPT (conversations or messages) or multiple choice "
        "(question, options, answer)")


def format_choice_prompt(question: str, options: dict[str, str]) -> str:
    """The multiple-choice prompt, shared by letter mode (as the user turn) and loglik mode."""
    lines = [question] + [f"{letter}. {text}" for letter, text in options.items()] + ["Answer:"]
    return "\n".join(lines)


def _read_records(path: Path):
    """Yield (line number, record) for a JSONL file or a JSON list."""
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        yield from _json_list_records(text, path)
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {number}: not valid JSON ({err.msg})") from None


def _json_list_records(text: str, path: Path):
    try:
        json.loads(text)  # validate first, so the walk below only meets well-formed input
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}, line {err.lineno}: not valid JSON ({err.msg})") from None
    # Decode item by item to learn where each record starts, so errors can name its line.
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        pos = _skip_separators(text, pos)
        if text[pos] == "]":
            return
        record, end = decoder.raw_decode(text, pos)
        yield text.count("\n", 0, pos) + 1, record
        pos = end


def _skip_separators(text: str, pos: int) -> int:
    while text[pos] in " \t\r\n,":
        pos += 1
    return pos


def _text(record: dict, key: str, where: str, default: str | None = None) -> str:
    value = record.get(key, default)
    if value is None:
        raise ValueError(f"{where}: field '{key}' is missing")
    if not isinstance(value, str):
        raise ValueError(f"{where}: field '{key}' must be a string, got {type(value).__name__}")
    return value


def _system(record: dict, where: str) -> list[dict[str, str]]:
    system = _text(record, "system", where, default="")
    return [{"role": "system", "content": system}] if system else []


def _parse_alpaca(record: dict, index: int, where: str) -> Sample:
    prompt = _text(record, "instruction", where)
    extra = _text(record, "input", where, default="")
    if extra:
        prompt = f"{prompt}\n{extra}"
    messages = _system(record, where)
    history = record.get("history") or []
    if not isinstance(history, list):
        raise ValueError(f"{where}: field 'history' must be a list of [user, assistant] pairs")
    for turn, pair in enumerate(history):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise ValueError(f"{where}: field 'history[{turn}]' must be a [user, assistant] pair of strings")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    messages.append({"role": "user", "content": prompt})
    return Sample(index=index, messages=messages, reference=_text(record, "output", where))


def _parse_sharegpt(record: dict, index: int, where: str) -> Sample:
    if "conversations" in record:
        field, role_key, content_key = "conversations", "from", "value"
    else:
        field, role_key, content_key = "messages", "role", "content"
    turns = record[field]
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: field '{field}' must be a non-empty list of turns")
    messages = _system(record, where)
    for turn, item in enumerate(turns):
        name = f"{field}[{turn}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: field '{name}' must be an object with '{role_key}' and '{content_key}'")
        role = _SHAREGPT_ROLES.get(item.get(role_key))
        if role is None:
            raise ValueError(f"{where}: field '{name}.{role_key}' is {item.get(role_key)!r}; "
                             f"expected one of {sorted(_SHAREGPT_ROLES)}")
        messages.append({"role": role, "content": _text(item, content_key, f"{where}, {name}")})
    last_answer = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last_answer is None:
        raise ValueError(f"{where}: field '{field}' has no assistant turn to use as the reference")
    return Sample(index=index, messages=messages[:last_answer], reference=messages[last_answer]["content"])


def _parse_choice(record: dict, index: int, where: str) -> Sample:
    question = _text(record, "question", where)
    raw = record["options"]
    if isinstance(raw, list):
        if len(raw) > len(string.ascii_uppercase):
            raise ValueError(f"{where}: field 'options' has more than 26 options")
        options = dict(zip(string.ascii_uppercase, raw))
    elif isinstance(raw, dict):
        options = {str(letter).strip().upper(): text for letter, text in raw.items()}
    else:
        raise ValueError(f"{where}: field 'options' must be a list or an object {{\"A\": ...}}")
    if len(options) < 2:
        raise ValueError(f"{where}: field 'options' needs at least two options")
    for letter, text in options.items():
        if len(letter) != 1 or letter not in string.ascii_uppercase or not isinstance(text, str):
            raise ValueError(f"{where}: field 'options' must map single letters A-Z to strings "
                             f"(bad entry {letter!r})")
    answer = _text(record, "answer", where).strip().upper()
    if answer not in options:
        raise ValueError(f"{where}: field 'answer' is {record['answer']!r}; expected one of {list(options)}")
    prompt = format_choice_prompt(question, options)
    messages = _system(record, where) + [{"role": "user", "content": prompt}]
    return Sample(index=index, messages=messages, reference=answer, options=options, choice_prompt=prompt)


_PARSERS = {"alpaca": _parse_alpaca, "sharegpt": _parse_sharegpt, "choice": _parse_choice}
