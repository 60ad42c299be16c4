"""Turn a dataset and its results into `report.json` / `report.md`, and compare two reports.

report.json:
  {"model", "base_url", "dataset", "form", "mc_mode" (multiple choice only), "timestamp",
   "samples", "evaluated", "failures", "missing", "unanswered" (letter mode only),
   "metrics": {"bleu-4": {"mean": 41.2, "count": 118}, ...},
   "throughput": {"requests_per_s", "output_tokens_per_s"},
   "latency_s": {"p50", "p90", "p99"}}
Means are over successfully answered samples; "failures" counts samples whose requests failed and
"missing" samples never sent (an interrupted run). Throughput counts HTTP requests (a loglik sample
sends one per option) over the wall time of the invocations that produced the results.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

from evaluation.datasets import Dataset, Sample
from evaluation.metrics import extract_choice, text_scores
from evaluation.runner import latest_by_index

_PERFORMANCE_ROWS = (
    ("requests/s", ("throughput", "requests_per_s")),
    ("output tokens/s", ("throughput", "output_tokens_per_s")),
    ("latency p50 (s)", ("latency_s", "p50")),
    ("latency p90 (s)", ("latency_s", "p90")),
    ("latency p99 (s)", ("latency_s", "p99")),
)


def score_sample(sample: Sample, record: dict) -> dict[str, float]:
    """Scores of one successful result: accuracy for multiple choice, BLEU/ROUGE otherwise."""
    if sample.options is None:
        return text_scores(record["text"], sample.reference)
    if "option_logprobs" in record:
        logprobs = record["option_logprobs"]
        predicted = max(logprobs, key=logprobs.get)
    else:
        predicted = extract_choice(record["text"], "".join(sample.options))
    return {"accuracy": 100.0 if predicted == sample.reference else 0.0}


def build_report(dataset: Dataset, records: list[dict], *, model: str, base_url: str,
                 mc_mode: str | None = None) -> dict:
    """Aggregate per-sample scores, failures, throughput and latency into the report dict."""
    latest = latest_by_index(records)
    scores: dict[str, list[float]] = defaultdict(list)
    latencies, failures, missing, unanswered = [], 0, 0, 0
    for sample in dataset.samples:
        record = latest.get(sample.index)
        if record is None:
            missing += 1
        elif not record["ok"]:
            failures += 1
        else:
            latencies.append(record["latency_s"])
            for name, value in score_sample(sample, record).items():
                scores[name].append(value)
            if sample.options is not None and "text" in record:
                unanswered += extract_choice(record["text"], "".join(sample.options)) is None
    report = {
        "model": model, "base_url": base_url, "dataset": str(dataset.path), "form": dataset.form,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "samples": len(dataset.samples), "evaluated": len(latencies), "failures": failures, "missing": missing,
        "metrics": {name: {"mean": statistics.fmean(values), "count": len(values)}
                    for name, values in scores.items()},
        "throughput": throughput(records),
        "latency_s": latency_percentiles(latencies),
    }
    if dataset.form == "choice":
        report["mc_mode"] = mc_mode
        if mc_mode == "letter":
            report["unanswered"] = unanswered
    return report


def throughput(records: list[dict]) -> dict[str, float | None]:
    """Requests/s and output tokens/s over the invocations ("sessions") that wrote `records`."""
    session_end: dict[float, float] = {}
    for record in records:
        session_end[record["session"]] = max(session_end.get(record["session"], 0.0), record["finished_at"])
    wall = sum(end - start for start, end in session_end.items())
    ok = [record for record in records if record["ok"]]
    tokens = [record["completion_tokens"] for record in ok if record.get("completion_tokens") is not None]
    if wall <= 0:
        return {"requests_per_s": None, "output_tokens_per_s": None}
    return {"requests_per_s": sum(record["requests"] for record in ok) / wall,
            "output_tokens_per_s": sum(tokens) / wall if tokens else None}


def latency_percentiles(latencies: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 of per-sample latency (seconds), interpolated between samples."""
    if not latencies:
        return dict.fromkeys(("p50", "p90", "p99"))
    if len(latencies) == 1:
        return dict.fromkeys(("p50", "p90", "p99"), latencies[0])
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98]}


def write_report(report: dict, out_dir: Path) -> None:
    """Write `report.json` and `report.md` into `out_dir`."""
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n",
                                         encoding="utf-8")
    (out_dir / "report.md").write_text(render_markdown(report), encoding="utf-8")


def render_markdown(report: dict) -> str:
    """The report as Markdown tables: run details, metrics, performance."""
    lines = [f"# Evaluation of {report['model']}", "",
             f"- dataset: `{report['dataset']}` ({report['form']}"
             + (f", {report['mc_mode']} mode)" if report.get("mc_mode") else ")"),
             f"- server: {report['base_url']}",
             f"- time: {report['timestamp']}",
             f"- samples: {report['samples']} (evaluated {report['evaluated']}, failures {report['failures']}, "
             f"missing {report['missing']})", "",
             "| metric | mean | count |", "|---|---:|---:|"]
    lines += [f"| {name} | {_fmt(m['mean'])} | {m['count']} |" for name, m in report["metrics"].items()]
    lines += ["", "| performance | value |", "|---|---:|"]
    lines += [f"| {label} | {_fmt(value)} |" for label, value in _performance(report).items()]
    return "\n".join(lines) + "\n"


def compare_reports(before: dict, after: dict, before_name: str = "before", after_name: str = "after") -> str:
    """A Markdown table of two reports side by side, with after - before deltas."""
    names = list(before["metrics"]) + [name for name in after["metrics"] if name not in before["metrics"]]
    rows = {name: (_mean(before, name), _mean(after, name)) for name in names}
    rows["failures"] = (before["failures"], after["failures"])
    perf_before, perf_after = _performance(before), _performance(after)
    rows |= {label: (perf_before[label], perf_after[label]) for label in perf_before}
    lines = [f"before: {before_name} ({before['model']} at {before['base_url']}, {before['dataset']})",
             f"after:  {after_name} ({after['model']} at {after['base_url']}, {after['dataset']})", "",
             "| metric | before | after | delta |", "|---|---:|---:|---:|"]
    for name, (a, b) in rows.items():
        if a is None or b is None:
            delta = "-"
        else:
            delta = f"{b - a:+d}" if isinstance(a, int) and isinstance(b, int) else f"{b - a:+.2f}"
        lines.append(f"| {name} | {_fmt(a)} | {_fmt(b)} | {delta} |")
    return "\n".join(lines) + "\n"


def _mean(report: dict, metric: str) -> float | None:
    return report["metrics"].get(metric, {}).get("mean")


def _performance(report: dict) -> dict[str, float | None]:
    return {label: report[section][key] for label, (section, key) in _PERFORMANCE_ROWS}


def _fmt(value: float | int | None) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.2f}"
