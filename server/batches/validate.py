"""A batch's input file read into its lines, or the reasons it cannot run.

As OpenAI's Batch API does, a file with any malformed line fails validation as a whole (the batch's status
`failed`, each bad line named in its `errors`) rather than running the lines around it: a line that is not
JSON, lacks a `custom_id` or repeats one, targets a route batches do not serve, or is larger than a request
body may be. Whether a line's `model` exists is the route's answer when the line runs (models and adapters
come and go), and lands in the error file."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from server.batches.protocol import BATCH_ENDPOINTS

MAX_REPORTED_ERRORS = 100  # a million-line file of garbage need not be a million-entry answer


@dataclass(frozen=True, slots=True)
class Line:
    number: int  # 1-based, as editors count
    custom_id: str
    url: str
    body: str  # the request body as JSON text


def count_lines(data: bytes) -> int:
    return sum(1 for raw in data.split(b"\n") if raw.strip())


def read_lines(data: bytes, max_line_bytes: int) -> tuple[list[Line], list[dict[str, Any]]]:
    """(the lines, []) or ([], the errors, OpenAI's `{code, message, param, line}` objects)."""
    lines: list[Line] = []
    errors: list[dict[str, Any]] = []
    seen: dict[str, int] = {}

    def fail(number: int, code: str, message: str, param: str | None = None) -> None:
        errors.append({"code": code, "message": message, "param": param, "line": number})

    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(raw) > max_line_bytes:
            fail(number, "line_too_large", f"line {number} is {len(raw)} bytes; a request body may be at most "
                                           f"{max_line_bytes} (max_body_bytes)")
            continue
        try:
            record = json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            fail(number, "invalid_json_line", f"line {number} is not valid JSON: {exc}")
            continue
        problem = _problem(record)
        if problem is not None:
            fail(number, *problem)
            continue
        custom_id = record["custom_id"]
        if custom_id in seen:
            fail(number, "duplicate_custom_id", f"line {number} repeats the custom_id {custom_id!r} of line "
                                                f"{seen[custom_id]}; each line needs its own", "custom_id")
            continue
        seen[custom_id] = number
        lines.append(Line(number, custom_id, record["url"], json.dumps(record["body"], ensure_ascii=False)))
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "the input file holds no requests", "param": None,
                       "line": None})
    if errors:
        return [], _capped(errors)
    return lines, []


def _problem(record: Any) -> tuple[str, str, str | None] | None:
    if not isinstance(record, dict):
        return "invalid_request", "each line must be a JSON object", None
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_custom_id", "each line needs a 'custom_id' string", "custom_id"
    if record.get("method", "POST") != "POST":
        return "invalid_method", f"'method' must be POST, got {record.get('method')!r}", "method"
    url = record.get("url")
    if url not in BATCH_ENDPOINTS:
        return ("invalid_url", f"'url' {url!r} is not a route batches can target; these are: "
                               f"{', '.join(BATCH_ENDPOINTS)}", "url")
    body = record.get("body")
    if not isinstance(body, dict):
        return "invalid_request", "'body' must be a JSON object (the request the route receives)", "body"
    if body.get("stream"):
        return "invalid_request", "'stream' is not supported in a batch: each line's answer is one body", "body.stream"
    return None


def _capped(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if len(errors) <= MAX_REPORTED_ERRORS:
        return errors
    more = len(errors) - MAX_REPORTED_ERRORS
    return errors[:MAX_REPORTED_ERRORS] + [{"code": "too_many_errors", "message": f"{more} more lines have errors",
                                            "param": None, "line": None}]
