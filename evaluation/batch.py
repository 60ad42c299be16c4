"""`ktserve eval --batch`: send the samples still lacking an answer as one OpenAI batch (upload a JSONL file
to /files, create a batch at /batches, poll it, read its output and error files) instead of as concurrent
requests, and append each sample's result to results.jsonl as `runner.run_samples` does.

Any server that speaks OpenAI's Batch API works; on ktserve the batch runs as background work that yields
to interactive requests, and survives a server restart. A sample's `latency_s` is the batch's: from the
upload to the output file. Lines are `sample-<index>` (letter mode) or `sample-<index>-<letter>` (loglik mode,
one /completions line per option)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

from evaluation.client import (
    RequestFailed, api_base, chat_answer, chat_payload, continuation_loglik, loglik_payload,
)
from evaluation.datasets import Sample
from evaluation.runner import RunOptions, missing_samples

FINISHED = ("completed", "failed", "cancelled", "expired")
POLL_S = 1.0
WINDOW = "24h"
WINDOW_S = 24 * 3600 + 300  # the server ends the batch at its window; past that, stop waiting


class BatchFailed(ValueError):
    """The batch as a whole did not run (its input failed validation); the message has its errors."""


def batch_lines(samples: list[Sample], model: str, options: RunOptions) -> tuple[str, list[dict]]:
    """(the endpoint, the batch's lines) for `samples`."""
    if options.mc_mode == "loglik":
        return "/v1/completions", [
            {"custom_id": f"sample-{s.index}-{letter}", "method": "POST", "url": "/v1/completions",
             "body": loglik_payload(model, s.choice_prompt, f" {letter}")}
            for s in samples for letter in s.options or {}]
    return "/v1/chat/completions", [
        {"custom_id": f"sample-{s.index}", "method": "POST", "url": "/v1/chat/completions",
         "body": chat_payload(model, s.messages, options.max_tokens, options.temperature)} for s in samples]


async def run_batch(samples: list[Sample], base_url: str, model: str, api_key: str | None, results_path: Path,
                    options: RunOptions, timeout_s: float = 120.0) -> int:
    """Evaluate the samples without a successful result in `results_path` as one batch; how many were sent."""
    missing = missing_samples(samples, results_path)
    if not missing:
        return 0
    endpoint, lines = batch_lines(missing, model, options)
    session = time.time()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=api_base(base_url), headers=headers, timeout=timeout_s) as http:
        batch = await _submit(http, endpoint, lines)
        _say(f"batch {batch['id']}: {len(lines)} requests")
        batch = await _wait(http, batch)
        if batch["status"] == "failed":
            errors = (batch.get("errors") or {}).get("data") or []
            raise BatchFailed(f"batch {batch['id']} failed validation: " + "; ".join(
                f"line {e.get('line')}: {e.get('message')}" for e in errors[:5]))
        answers = {**await _lines(http, batch.get("error_file_id")), **await _lines(http, batch.get("output_file_id"))}
    finished = time.time()
    with results_path.open("a", encoding="utf-8") as out:
        for sample in missing:
            record = _record(sample, answers, options, batch["status"])
            record |= {"latency_s": finished - session, "session": session, "finished_at": finished}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    return len(missing)


async def _submit(http: httpx.AsyncClient, endpoint: str, lines: list[dict]) -> dict:
    data = b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in lines)
    uploaded = _ok(await http.post("files", files={"file": ("eval.jsonl", data, "application/jsonl")},
                                   data={"purpose": "batch"}))
    return _ok(await http.post("batches", json={"input_file_id": uploaded["id"], "endpoint": endpoint,
                                                "completion_window": WINDOW,
                                                "metadata": {"source": "ktserve eval"}}))


async def _wait(http: httpx.AsyncClient, batch: dict) -> dict:
    deadline = time.monotonic() + WINDOW_S
    shown = None
    while batch["status"] not in FINISHED and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        batch = _ok(await http.get(f"batches/{batch['id']}"))
        counts = batch.get("request_counts") or {}
        progress = (batch["status"], counts.get("completed"), counts.get("failed"))
        if progress != shown:
            _say(f"batch {batch['id']}: {batch['status']}, {counts.get('completed', 0)} done, "
                 f"{counts.get('failed', 0)} failed of {counts.get('total', 0)}")
            shown = progress
    return batch


async def _lines(http: httpx.AsyncClient, file_id: str | None) -> dict[str, dict]:
    """custom_id -> the output or error line, of the file `file_id` (none: {})."""
    if not file_id:
        return {}
    response = await http.get(f"files/{file_id}/content")
    if response.status_code != 200:
        raise RequestFailed(f"HTTP {response.status_code} reading file {file_id}: {response.text[:300]}", 1)
    found = {}
    for text in response.text.splitlines():
        if text.strip():
            line = json.loads(text)
            found[line["custom_id"]] = line
    return found


def _record(sample: Sample, answers: dict[str, dict], options: RunOptions, status: str) -> dict:
    record: dict = {"index": sample.index, "attempts": 1}
    try:
        if options.mc_mode == "loglik":
            logprobs = {letter: continuation_loglik(_body(answers, f"sample-{sample.index}-{letter}", status),
                                                    f" {letter}", 1).logprob for letter in sample.options or {}}
            record |= {"option_logprobs": logprobs, "requests": len(logprobs)}
        else:
            answer = chat_answer(_body(answers, f"sample-{sample.index}", status), 1)
            record |= {"text": answer.text, "completion_tokens": answer.completion_tokens, "requests": 1}
    except RequestFailed as err:
        return record | {"ok": False, "error": str(err)}
    return record | {"ok": True}


def _body(answers: dict[str, dict], custom_id: str, status: str) -> dict:
    """The 2xx body answered for `custom_id`, else RequestFailed saying what happened to it."""
    line = answers.get(custom_id)
    if line is None:
        raise RequestFailed(f"the batch ended {status} before this request ran", 1)
    response = line.get("response") or {}
    if line.get("error") or not 200 <= response.get("status_code", 0) < 300:
        detail = line.get("error") or response.get("body")
        raise RequestFailed(f"HTTP {response.get('status_code')}: {json.dumps(detail)[:300]}", 1)
    return response["body"]


def _ok(response: httpx.Response) -> dict:
    if response.status_code != 200:
        raise RequestFailed(f"HTTP {response.status_code} from {response.request.url.path}: {response.text[:300]}", 1)
    return response.json()


def _say(message: str) -> None:
    print(f"ktserve eval: {message}", file=sys.stderr)
