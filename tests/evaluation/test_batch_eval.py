"""`ktserve eval --batch` against a real server on the demo model: the dataset goes through the Batch API and
the report equals the one built from concurrent requests, in both multiple-choice modes' worth of endpoints."""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import start_server
from .test_eval_live import DATA, eval_command


@pytest.fixture(scope="module")
def live(demo_model_dir, tmp_path_factory):
    running = start_server(demo_model_dir, engine="huggingface", max_concurrent=4,
                           data_dir=str(tmp_path_factory.mktemp("eval-batch-data")))
    yield running
    running.stop()


def results(out) -> dict[int, dict]:
    return {r["index"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}


@pytest.mark.parametrize("dataset, extra, answer", [
    ("alpaca.jsonl", (), "text"),
    ("choice.jsonl", ("--mc-mode", "loglik"), "option_logprobs"),
])
def test_a_batch_evaluation_reports_what_concurrent_requests_report(live, tmp_path, dataset, extra, answer):
    runs = {}
    for mode in ("requests", "batch"):
        out = tmp_path / mode
        flags = (*extra, "--batch") if mode == "batch" else extra
        done = subprocess.run(eval_command(live, dataset, out, *flags), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[mode] = out
    by_requests, by_batch = results(runs["requests"]), results(runs["batch"])
    assert sorted(by_batch) == sorted(by_requests) and all(r["ok"] for r in by_batch.values())
    for index, record in by_requests.items():
        assert by_batch[index][answer] == pytest.approx(record[answer], abs=1e-4)
    reports = {mode: json.loads((out / "report.json").read_text()) for mode, out in runs.items()}
    means = {mode: {name: m["mean"] for name, m in report["metrics"].items()} for mode, report in reports.items()}
    assert means["batch"] == pytest.approx(means["requests"])
    assert len(DATA.joinpath(dataset).read_text().splitlines()) == len(by_batch)
