"""Send the samples that still lack an answer, `concurrency` at a time, and append each result to
`results.jsonl` the moment it arrives, so an interrupted run loses nothing and `--resume` sends only
what is missing (failed samples included).

One line of results.jsonl:
  {"index": 3, "ok": true, "text": "...", "completion_tokens": 41, "latency_s": 1.2, "requests": 1,
   "attempts": 1, "session": 1767225600.0, "finished_at": 1767225601.2}
loglik mode stores "option_logprobs" {"A": -1.3, ...} instead of "text"; a failure stores "error".
"session" is the wall-clock start of the invocation that produced the line; report.py uses it to
measure throughput across resumed runs.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from evaluation.client import OpenAIClient, RequestFailed
from evaluation.datasets import Sample

RESULTS_FILE = "results.jsonl"


@dataclass(slots=True)
class RunOptions:
    concurrency: int = 8
    max_tokens: int = 512
    temperature: float = 0.0
    mc_mode: str = "letter"     # "letter": generate and read the letter; "loglik": compare option logprobs
    progress: bool = True


def read_results(path: Path) -> list[dict]:
    """Every record in a results file, in file order (a later record for an index supersedes earlier ones)."""
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise ValueError(f"{path}, line {number}: not valid JSON") from None
    return records


def latest_by_index(records: list[dict]) -> dict[int, dict]:
    """The last record of each sample index."""
    return {record["index"]: record for record in records}


def missing_samples(samples: list[Sample], results_path: Path) -> list[Sample]:
    """The samples without a successful result in `results_path` (a partial last line cut off first)."""
    _drop_partial_last_line(results_path)
    done = {i for i, record in latest_by_index(read_results(results_path)).items() if record.get("ok")}
    return [sample for sample in samples if sample.index not in done]


async def run_samples(samples: list[Sample], client: OpenAIClient, results_path: Path,
                      options: RunOptions) -> int:
    """Evaluate the samples without a successful result in `results_path`; return how many were sent."""
    missing = missing_samples(samples, results_path)
    todo = len(missing)
    pending = iter(missing)
    session = time.time()
    failures = 0
    bar = tqdm(total=todo, desc="eval", unit="req", file=sys.stderr, dynamic_ncols=True,
               disable=not options.progress)

    async def worker(out) -> None:
        nonlocal failures
        # All workers share one iterator; next() is synchronous, so each sample is taken exactly once.
        for sample in pending:
            record = await _evaluate(sample, client, options)
            record |= {"session": session, "finished_at": time.time()}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            failures += not record["ok"]
            bar.set_postfix(failed=failures, refresh=False)
            bar.update(1)

    with results_path.open("a", encoding="utf-8") as out:
        try:
            await asyncio.gather(*(worker(out) for _ in range(max(1, min(options.concurrency, todo)))))
        finally:
            bar.close()
    return todo


async def _evaluate(sample: Sample, client: OpenAIClient, options: RunOptions) -> dict:
    started = time.monotonic()
    record: dict = {"index": sample.index}
    try:
        if options.mc_mode == "loglik":
            attempts = await _score_options(sample, client, record)
        else:
            answer = await client.chat(sample.messages, max_tokens=options.max_tokens,
                                       temperature=options.temperature)
            record |= {"text": answer.text, "completion_tokens": answer.completion_tokens, "requests": 1}
            attempts = answer.attempts
    except RequestFailed as err:
        return record | {"ok": False, "error": str(err), "attempts": err.attempts,
                         "latency_s": time.monotonic() - started}
    return record | {"ok": True, "attempts": attempts, "latency_s": time.monotonic() - started}


async def _score_options(sample: Sample, client: OpenAIClient, record: dict) -> int:
    # The continuation is the option letter, as in LLaMA-Factory's and lm-eval's MMLU-style scoring:
    # the options' texts are in the prompt, and letters keep long options from being penalised.
    logprobs, attempts = {}, 0
    for letter in sample.options:
        result = await client.continuation_logprob(sample.choice_prompt, f" {letter}")
        logprobs[letter] = result.logprob
        attempts += result.attempts
    record |= {"option_logprobs": logprobs, "requests": len(logprobs)}
    return attempts


def _drop_partial_last_line(path: Path) -> None:
    # A run killed mid-write leaves a line without its newline; appending after it would corrupt the
    # next record too, so cut the file back to the last complete line.
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
