"""report.json / report.md of `ktserve eval`, and `ktserve eval --compare`."""

import json
from pathlib import Path

import pytest

from evaluation.cli import main
from evaluation.datasets import Dataset, Sample
from evaluation.report import build_report, latency_percentiles, render_markdown, score_sample, throughput


def record(index, ok=True, session=100.0, finished_at=101.0, **fields):
    return {"index": index, "ok": ok, "session": session, "finished_at": finished_at, "latency_s": 1.0,
            "requests": 1, "attempts": 1} | fields


def choice_sample(index=0, answer="B"):
    return Sample(index=index, messages=[], reference=answer, options={"A": "x", "B": "y", "C": "z"})


def test_loglik_prediction_is_the_option_with_highest_logprob():
    result = record(0, option_logprobs={"A": -2.0, "B": -0.5, "C": -1.0})
    assert score_sample(choice_sample(answer="B"), result) == {"accuracy": 100.0}
    assert score_sample(choice_sample(answer="C"), result) == {"accuracy": 0.0}


def test_letter_prediction_is_read_from_the_answer_text():
    assert score_sample(choice_sample(answer="B"), record(0, text="The answer is (B).")) == {"accuracy": 100.0}


def test_latency_percentiles_interpolate_between_samples():
    # inclusive method on 1..5: position (n-1)*q -> p90 at 3.6 -> 4.6, p99 at 3.96 -> 4.96
    assert latency_percentiles([5.0, 1.0, 3.0, 2.0, 4.0]) == pytest.approx({"p50": 3.0, "p90": 4.6, "p99": 4.96})


def test_throughput_adds_up_the_wall_time_of_each_resumed_session():
    records = [
        record(0, session=100.0, finished_at=101.0, completion_tokens=10),
        record(1, session=100.0, finished_at=102.0, completion_tokens=30),
        record(2, session=200.0, finished_at=201.0, requests=4),       # a loglik sample: 4 requests
        record(3, ok=False, session=200.0, finished_at=200.5, error="HTTP 500"),
    ]
    # wall = (102 - 100) + (201 - 200) = 3 s; 6 successful requests; 40 output tokens
    assert throughput(records) == pytest.approx({"requests_per_s": 2.0, "output_tokens_per_s": 40 / 3})


def test_report_counts_failures_and_missing_and_uses_the_latest_record():
    samples = [Sample(index=i, messages=[], reference="the cat is on the mat") for i in range(4)]
    records = [
        record(0, text="the cat is on the mat", completion_tokens=6),
        record(1, ok=False, error="HTTP 503"),
        record(1, text="the cat sat on the mat", completion_tokens=6, session=200.0, finished_at=201.0),
        record(2, ok=False, error="HTTP 500"),
    ]
    report = build_report(Dataset(Path("d.jsonl"), "alpaca", samples), records, model="m", base_url="http://x")
    assert (report["samples"], report["evaluated"], report["failures"], report["missing"]) == (4, 2, 1, 1)
    assert report["metrics"]["bleu-1"] == {"mean": pytest.approx((100 + 500 / 6) / 2), "count": 2}
    assert set(report) >= {"model", "base_url", "dataset", "timestamp", "throughput", "latency_s"}


def test_markdown_report_is_a_metric_table():
    samples = [choice_sample(0, "B"), choice_sample(1, "A")]
    records = [record(0, text="B"), record(1, text="no idea")]
    report = build_report(Dataset(Path("c.jsonl"), "choice", samples), records, model="m", base_url="http://x",
                          mc_mode="letter")
    assert report["unanswered"] == 1
    assert "| metric | mean | count |\n|---|---:|---:|\n| accuracy | 50.00 | 2 |\n" in render_markdown(report)


def report(model, bleu4, rouge_l, failures, rps, p50):
    return {"model": model, "base_url": "http://127.0.0.1:8000/v1", "dataset": "data.jsonl", "failures": failures,
            "metrics": {"bleu-4": {"mean": bleu4, "count": 10}, "rouge-l": {"mean": rouge_l, "count": 10}},
            "throughput": {"requests_per_s": rps, "output_tokens_per_s": None},
            "latency_s": {"p50": p50, "p90": None, "p99": None}}


def test_compare_prints_both_reports_side_by_side_with_deltas(tmp_path, capsys):
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    before.write_text(json.dumps(report("base", 40.0, 50.0, 2, 4.0, 1.5)))
    after.write_text(json.dumps(report("tuned", 42.5, 49.0, 0, 3.5, 1.75)))
    assert main(["--compare", str(before), str(after)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"before: {before} (base at http://127.0.0.1:8000/v1, data.jsonl)")
    assert lines[1].startswith(f"after:  {after} (tuned at")
    assert lines[3:] == [
        "| metric | before | after | delta |",
        "|---|---:|---:|---:|",
        "| bleu-4 | 40.00 | 42.50 | +2.50 |",
        "| rouge-l | 50.00 | 49.00 | -1.00 |",
        "| failures | 2 | 0 | -2 |",
        "| requests/s | 4.00 | 3.50 | -0.50 |",
        "| output tokens/s | - | - | - |",
        "| latency p50 (s) | 1.50 | 1.75 | +0.25 |",
        "| latency p90 (s) | - | - | - |",
        "| latency p99 (s) | - | - | - |",
    ]


def test_compare_with_a_missing_report_names_it(tmp_path, capsys):
    assert main(["--compare", str(tmp_path / "nope.json"), str(tmp_path / "nope.json")]) == 2
    assert "nope.json: no such file" in capsys.readouterr().err
