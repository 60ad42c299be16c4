"""`ktserve eval`: evaluate a model behind an OpenAI-compatible server, or compare two reports.

  ktserve eval DATASET --base-url URL --model NAME --out DIR [--api-key K] [--concurrency N]
               [--max-tokens N] [--temperature T] [--resume] [--mc-mode letter|loglik] [--limit N]
               [--timeout S] [--retries N] [--batch]
  ktserve eval --compare BEFORE/report.json AFTER/report.json

Exit codes: 0 all samples answered, 1 some requests failed (the report is still written; rerun with
--resume to retry them), 2 bad arguments or data, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from pathlib import Path

from evaluation.batch import run_batch
from evaluation.client import OpenAIClient, RequestFailed, RetryPolicy
from evaluation.datasets import load_dataset
from evaluation.report import build_report, compare_reports, render_markdown, write_report
from evaluation.runner import RESULTS_FILE, RunOptions, read_results, run_samples

# Settings a resumed run must share with the run it continues, or its results would mix two experiments.
_RESUME_KEYS = ("dataset", "model", "mc_mode")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `ktserve eval` arguments to `parser`."""
    parser.add_argument("dataset", nargs="?", metavar="DATASET",
                        help="JSONL or JSON list: Alpaca, ShareGPT or multiple-choice records")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                        help="print two report.json files side by side with deltas, and exit")
    parser.add_argument("--base-url", metavar="URL", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", metavar="NAME", help="model name sent in each request")
    parser.add_argument("--out", metavar="DIR", help="directory for results.jsonl, report.json and report.md")
    parser.add_argument("--api-key", metavar="KEY", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--concurrency", metavar="N", type=_positive(int), default=8, help="requests in flight (default 8)")
    parser.add_argument("--max-tokens", metavar="N", type=_positive(int), default=512, help="answer length limit (default 512)")
    parser.add_argument("--temperature", metavar="T", type=float, default=0.0, help="sampling temperature (default 0)")
    parser.add_argument("--resume", action="store_true",
                        help="continue DIR/results.jsonl, sending only samples without a successful result")
    parser.add_argument("--mc-mode", choices=("letter", "loglik"), default="letter",
                        help="multiple choice: read the letter from a generated answer (letter), or pick the "
                             "option with the highest log-likelihood via /v1/completions echo+logprobs, "
                             "which needs a server returning prompt logprobs (loglik)")
    parser.add_argument("--limit", metavar="N", type=_positive(int), help="evaluate only the first N samples")
    parser.add_argument("--timeout", metavar="S", type=_positive(float), default=120.0,
                        help="seconds per request attempt (default 120)")
    parser.add_argument("--retries", metavar="N", type=_non_negative_int, default=3,
                        help="retries after a 408/429/5xx, timeout or connection error (default 3)")
    parser.add_argument("--batch", action="store_true",
                        help="send the samples as one OpenAI batch (/files, /batches) and read the answers from "
                             "its output file; --concurrency and --retries do not apply")


def run(args: argparse.Namespace) -> int:
    """Run `ktserve eval` with parsed `args`; returns the exit code."""
    try:
        if args.compare:
            return _compare(*args.compare)
        return _evaluate(args)
    except ValueError as err:
        print(f"ktserve eval: error: {err}", file=sys.stderr)
        return 2
    except RequestFailed as err:  # --batch: the server refused the upload or the batch
        print(f"ktserve eval: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"ktserve eval: interrupted; finished samples are in {Path(args.out or '.') / RESULTS_FILE}, "
              "rerun with --resume to send the rest", file=sys.stderr)
        return 130


def _evaluate(args: argparse.Namespace) -> int:
    for flag in ("dataset", "base_url", "model", "out"):
        if not getattr(args, flag):
            name = "DATASET" if flag == "dataset" else "--" + flag.replace("_", "-")
            raise ValueError(f"{name} is required (unless --compare is given)")
    dataset = load_dataset(args.dataset)
    dataset = dataclasses.replace(dataset, samples=dataset.samples[:args.limit])
    if args.mc_mode == "loglik" and dataset.form != "choice":
        raise ValueError(f"--mc-mode loglik needs a multiple-choice dataset; {dataset.path} is {dataset.form}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / RESULTS_FILE
    _check_resume(out, results_path, args)

    options = RunOptions(concurrency=args.concurrency, max_tokens=args.max_tokens, temperature=args.temperature,
                         mc_mode=args.mc_mode)

    async def send() -> None:
        if args.batch:
            await run_batch(dataset.samples, args.base_url, args.model, args.api_key, results_path, options,
                            timeout_s=args.timeout)
            return
        async with OpenAIClient(args.base_url, args.model, args.api_key, timeout_s=args.timeout,
                                retry=RetryPolicy(retries=args.retries),
                                max_connections=args.concurrency) as client:
            await run_samples(dataset.samples, client, results_path, options)

    asyncio.run(send())
    report = build_report(dataset, read_results(results_path), model=args.model, base_url=args.base_url,
                          mc_mode=args.mc_mode)
    write_report(report, out)
    print(render_markdown(report), end="")
    if report["failures"]:
        print(f"ktserve eval: {report['failures']} samples failed (see 'error' in {results_path}); "
              "rerun with --resume to retry them", file=sys.stderr)
        return 1
    return 0


def _check_resume(out: Path, results_path: Path, args: argparse.Namespace) -> None:
    run_file = out / "run.json"
    settings = {"dataset": str(Path(args.dataset).resolve()), "model": args.model, "mc_mode": args.mc_mode}
    if results_path.exists() and not args.resume:
        raise ValueError(f"{results_path} already exists; pass --resume to continue it, or choose another --out")
    if args.resume and run_file.exists():
        previous = json.loads(run_file.read_text(encoding="utf-8"))
        for key in _RESUME_KEYS:
            if previous.get(key) != settings[key]:
                raise ValueError(f"--resume: {run_file} records {key} {previous.get(key)!r}, this run has "
                                 f"{settings[key]!r}; use another --out")
    run_file.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


def _compare(before_path: str, after_path: str) -> int:
    before, after = _load_report(before_path), _load_report(after_path)
    print(compare_reports(before, after, before_path, after_path), end="")
    return 0


def _load_report(path: str) -> dict:
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--compare: {path}: no such file") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--compare: {path}: not valid JSON ({err.msg})") from None
    if not isinstance(report, dict) or "metrics" not in report:
        raise ValueError(f"--compare: {path} is not a ktserve eval report.json (no 'metrics')")
    return report


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: `python -m evaluation ...`."""
    parser = argparse.ArgumentParser(prog="ktserve eval", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
