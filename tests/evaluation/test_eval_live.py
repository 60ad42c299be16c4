"""`ktserve eval` against a real server on the demo model: every dataset form, resume, log-likelihood choice."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import start_server
from tests.helpers import forward_logprobs

DATA = Path(__file__).parents[1] / "data" / "eval"
GENERATION_METRICS = {"bleu-1", "bleu-2", "bleu-3", "bleu-4", "rouge-1", "rouge-2", "rouge-l"}


@pytest.fixture(scope="module")
def live(demo_model_dir):
    running = start_server(demo_model_dir, engine="huggingface", max_concurrent=4)
    yield running
    running.stop()


def eval_command(live, dataset: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "server.cli", "eval", str(DATA / dataset), "--base-url", live.base_url + "/v1",
            "--model", live.engine.info.id, "--out", str(out), "--max-tokens", "8", "--concurrency", "2", *extra]


def records(dataset: str) -> int:
    path = DATA / dataset
    return len(json.loads(path.read_text())) if path.suffix == ".json" else len(path.read_text().splitlines())


def chat_requests(live) -> int:
    """Chat completions the server has answered so far, read from its own metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with live.http() as http:
        text = http.get("/metrics").text
    return int(sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "ktserve_requests_total" and s.labels.get("route") == "/v1/chat/completions"))


@pytest.mark.parametrize("dataset", ["alpaca.jsonl", "sharegpt.json", "choice.jsonl"])
def test_eval_reports_every_metric_for_each_dataset_form(live, dataset, tmp_path):
    done = subprocess.run(eval_command(live, dataset, tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    expected = {"accuracy"} if dataset.startswith("choice") else GENERATION_METRICS
    assert expected <= set(report["metrics"])
    assert all(report["metrics"][m]["count"] == records(dataset) for m in expected)


def test_resume_after_a_kill_sends_only_the_missing_requests(live, tmp_path):
    total = records("alpaca.jsonl")
    before = chat_requests(live)
    # one request at a time with longer answers, so the kill lands half way
    proc = subprocess.Popen(eval_command(live, "alpaca.jsonl", tmp_path, "--concurrency", "1", "--max-tokens", "48"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = tmp_path / "results.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (not results.exists() or len(results.read_text().splitlines()) < 2):
        time.sleep(0.05)
    proc.kill()
    proc.wait(timeout=30)
    live.wait_idle()
    answered = len([line for line in results.read_text().splitlines() if line.strip()])
    assert 2 <= answered < total
    sent_first = chat_requests(live) - before
    done = subprocess.run(eval_command(live, "alpaca.jsonl", tmp_path, "--resume", "--concurrency", "1",
                                       "--max-tokens", "48"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert chat_requests(live) - before - sent_first == total - answered
    assert json.loads((tmp_path / "report.json").read_text())["metrics"]["bleu-4"]["count"] == total


def test_loglik_choice_is_the_option_a_direct_forward_pass_scores_highest(live, tmp_path, tokenizer,
                                                                            reference_model):
    from evaluation.datasets import load_dataset

    done = subprocess.run(eval_command(live, "choice.jsonl", tmp_path, "--mc-mode", "loglik"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    served = {r["index"]: r["option_logprobs"] for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    for sample in load_dataset(DATA / "choice.jsonl").samples[:3]:
        scores = {}
        for letter in served[sample.index]:
            prompt_ids = tokenizer.encode(sample.choice_prompt)
            full_ids = tokenizer.encode(sample.choice_prompt + " " + letter)
            logprobs = forward_logprobs(reference_model, full_ids)
            scores[letter] = sum(float(logprobs[i - 1, full_ids[i]]) for i in range(len(prompt_ids), len(full_ids)))
        assert max(served[sample.index], key=served[sample.index].get) == max(scores, key=scores.get)
