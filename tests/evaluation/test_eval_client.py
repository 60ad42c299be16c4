"""`ktserve eval` against a stub OpenAI-compatible server: concurrency, retries, resume, loglik scoring.

The stub is a small FastAPI app served by uvicorn on 127.0.0.1 (a free port, one server for the
module). It answers /v1/chat/completions and /v1/completions in OpenAI shape and records every request.
"""

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from evaluation.cli import main
from evaluation.client import OpenAIClient, RetryPolicy, api_base, parse_retry_after, sum_continuation_logprobs
from evaluation.datasets import load_dataset

DATA = Path(__file__).parents[1] / "data" / "eval"
PROMPT_LOGPROB = -1.0


class Stub:
    """What the stub server answers, and what it was asked."""

    def __init__(self):
        self.answers: dict[str, str] = {}              # last user message -> answer
        self.failures: dict[str, list[tuple[int, str]]] = {}   # last user message -> (status, Retry-After) to send first
        self.delay_s = 0.0
        self.chat_prompts: list[str] = []               # last user message of each chat request
        self.chat_headers: list[dict] = []
        self.completion_payloads: list[dict] = []
        self.continuation_logprobs: dict[str, tuple[float, float]] = {}  # letter -> (" ", letter) logprobs
        self.in_flight = 0
        self.max_in_flight = 0


def make_app(stub_ref: list) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        stub = stub_ref[0]
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        stub.chat_prompts.append(prompt)
        stub.chat_headers.append(dict(request.headers))
        stub.in_flight += 1
        stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
        try:
            await asyncio.sleep(stub.delay_s)
        finally:
            stub.in_flight -= 1
        if stub.failures.get(prompt):
            status, retry_after = stub.failures[prompt].pop(0)
            return JSONResponse({"error": {"message": "stub failure", "code": status}}, status_code=status,
                                headers={"Retry-After": retry_after})
        answer = stub.answers.get(prompt, "I do not know.")
        return {"id": "chatcmpl-1", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": answer}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": len(answer.split()),
                          "total_tokens": 10 + len(answer.split())}}

    @app.post("/v1/completions")
    async def completions(request: Request):
        stub = stub_ref[0]
        body = await request.json()
        stub.completion_payloads.append(body)
        prompt = body["prompt"]
        tokens = list(prompt)  # one character a token, so the continuation " B" is two tokens
        logprobs = [None] + [PROMPT_LOGPROB] * (len(tokens) - 1)
        logprobs[-2:] = stub.continuation_logprobs[prompt[-1]]
        return {"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                "choices": [{"index": 0, "text": prompt, "finish_reason": "length", "logprobs": {
                    "tokens": tokens, "token_logprobs": logprobs, "text_offset": list(range(len(tokens))),
                    "top_logprobs": [None] + [{t: lp} for t, lp in zip(tokens[1:], logprobs[1:])]}}],
                "usage": {"prompt_tokens": len(tokens), "completion_tokens": 0, "total_tokens": len(tokens)}}

    return app


@pytest.fixture(scope="module")
def server():
    stub_ref = [Stub()]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(make_app(stub_ref), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline, "stub server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", stub_ref
    uv.should_exit = True
    thread.join(timeout=5)


@pytest.fixture
def stub_url(server):
    url, stub_ref = server
    stub_ref[0] = Stub()
    return url, stub_ref[0]


def write_alpaca(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"instruction": f"question {i}", "output": f"answer {i}"}) + "\n"
                            for i in range(n)))
    return path


def evaluate(url: str, dataset: Path, out: Path, *extra: str) -> int:
    return main([str(dataset), "--base-url", url, "--model", "demo", "--out", str(out), "--timeout", "5", *extra])


def results(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_requests_in_flight_never_exceed_concurrency(stub_url, tmp_path):
    url, stub = stub_url
    stub.delay_s = 0.1
    assert evaluate(url, write_alpaca(tmp_path / "d.jsonl", 12), tmp_path / "out", "--concurrency", "3") == 0
    assert len(stub.chat_prompts) == 12
    assert stub.max_in_flight == 3


def test_each_result_is_appended_keyed_by_sample_index(stub_url, tmp_path):
    url, stub = stub_url
    stub.answers = {"question 2": "answer two"}
    assert evaluate(url, write_alpaca(tmp_path / "d.jsonl", 4), tmp_path / "out") == 0
    by_index = {r["index"]: r for r in results(tmp_path / "out")}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert by_index[2]["ok"] and by_index[2]["text"] == "answer two"


def test_429_is_retried_until_success(stub_url, tmp_path):
    url, stub = stub_url
    stub.failures = {"question 1": [(429, "0"), (429, "0")]}
    assert evaluate(url, write_alpaca(tmp_path / "d.jsonl", 3), tmp_path / "out") == 0
    assert stub.chat_prompts.count("question 1") == 3
    assert {r["index"]: r["attempts"] for r in results(tmp_path / "out")}[1] == 3


def test_retry_waits_as_long_as_retry_after_says(stub_url, tmp_path):
    url, stub = stub_url
    stub.failures = {"question 0": [(503, "1")]}
    started = time.monotonic()
    assert evaluate(url, write_alpaca(tmp_path / "d.jsonl", 1), tmp_path / "out") == 0
    assert time.monotonic() - started >= 1.0


def test_retries_are_bounded_and_the_failure_is_recorded(stub_url, tmp_path):
    url, stub = stub_url
    stub.failures = {"question 0": [(500, "0")] * 10}
    assert evaluate(url, write_alpaca(tmp_path / "d.jsonl", 2), tmp_path / "out", "--retries", "2") == 1
    assert stub.chat_prompts.count("question 0") == 3
    failed = {r["index"]: r for r in results(tmp_path / "out")}[0]
    assert not failed["ok"] and failed["error"].startswith("HTTP 500")
    assert json.loads((tmp_path / "out" / "report.json").read_text())["failures"] == 1


def test_client_errors_are_not_retried(stub_url, tmp_path):
    url, stub = stub_url
    stub.failures = {"question 0": [(400, "0")] * 3}
    assert evaluate(url, write_alpaca(tmp_path / "d.jsonl", 1), tmp_path / "out") == 1
    assert stub.chat_prompts.count("question 0") == 1


def test_connection_errors_and_timeouts_are_retried():
    calls = []

    def handler(request):
        calls.append(request)
        if len(calls) == 1:
            raise httpx.ConnectError("refused")
        if len(calls) == 2:
            raise httpx.ReadTimeout("slow")
        return httpx.Response(200, json={"choices": [{"message": {"content": "ok"}}]})

    async def ask():
        async with OpenAIClient("http://stub", "m", retry=RetryPolicy(retries=2, base_delay_s=0.0),
                                transport=httpx.MockTransport(handler)) as client:
            return await client.chat([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0)

    answer = asyncio.run(ask())
    assert (answer.text, answer.attempts, len(calls)) == ("ok", 3, 3)


def test_resume_sends_only_missing_requests(stub_url, tmp_path):
    url, stub = stub_url
    dataset, out = write_alpaca(tmp_path / "d.jsonl", 6), tmp_path / "out"
    assert evaluate(url, dataset, out, "--limit", "3") == 0
    assert evaluate(url, dataset, out, "--resume") == 0
    assert stub.chat_prompts[3:] and sorted(stub.chat_prompts[3:]) == ["question 3", "question 4", "question 5"]
    assert json.loads((out / "report.json").read_text())["evaluated"] == 6


def test_resume_resends_failed_samples(stub_url, tmp_path):
    url, stub = stub_url
    dataset, out = write_alpaca(tmp_path / "d.jsonl", 3), tmp_path / "out"
    stub.failures = {"question 1": [(400, "0")]}
    assert evaluate(url, dataset, out) == 1
    assert evaluate(url, dataset, out, "--resume") == 0
    assert stub.chat_prompts[3:] == ["question 1"]


def test_resume_discards_a_partially_written_last_line(stub_url, tmp_path):
    url, stub = stub_url
    dataset, out = write_alpaca(tmp_path / "d.jsonl", 3), tmp_path / "out"
    assert evaluate(url, dataset, out) == 0
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    (out / "results.jsonl").write_text(lines[0] + lines[1] + lines[2][:10])  # killed mid-write
    assert evaluate(url, dataset, out, "--resume") == 0
    assert len(stub.chat_prompts) == 4
    assert sorted(r["index"] for r in results(out)) == [0, 1, 2]


def test_existing_results_without_resume_are_left_alone(stub_url, tmp_path, capsys):
    url, stub = stub_url
    dataset, out = write_alpaca(tmp_path / "d.jsonl", 2), tmp_path / "out"
    assert evaluate(url, dataset, out) == 0
    assert evaluate(url, dataset, out) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert len(stub.chat_prompts) == 2


def test_resume_with_another_model_is_refused(stub_url, tmp_path, capsys):
    url, stub = stub_url
    dataset, out = write_alpaca(tmp_path / "d.jsonl", 2), tmp_path / "out"
    assert evaluate(url, dataset, out, "--limit", "1") == 0
    assert main([str(dataset), "--base-url", url, "--model", "other", "--out", str(out), "--resume"]) == 2
    assert "model 'demo'" in capsys.readouterr().err


def test_api_key_is_sent_as_bearer_token(stub_url, tmp_path):
    url, stub = stub_url
    assert evaluate(url, write_alpaca(tmp_path / "d.jsonl", 1), tmp_path / "out", "--api-key", "sk-test") == 0
    assert stub.chat_headers[0]["authorization"] == "Bearer sk-test"


def test_answers_equal_to_the_references_score_100(stub_url, tmp_path):
    url, stub = stub_url
    dataset = load_dataset(DATA / "alpaca.jsonl")
    stub.answers = {s.messages[-1]["content"]: s.reference for s in dataset.samples}
    assert evaluate(url, DATA / "alpaca.jsonl", tmp_path / "out") == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert {name: m["mean"] for name, m in report["metrics"].items()} == pytest.approx(
        dict.fromkeys(["bleu-1", "bleu-2", "bleu-3", "bleu-4", "rouge-1", "rouge-2", "rouge-l"], 100.0))
    assert report["model"] == "demo" and report["base_url"] == url and report["evaluated"] == 6
    assert report["throughput"]["requests_per_s"] > 0 and report["latency_s"]["p50"] > 0
    assert "| bleu-4 | 100.00 | 6 |" in (tmp_path / "out" / "report.md").read_text()


def test_letter_mode_accuracy_reads_letters_from_answers(stub_url, tmp_path):
    url, stub = stub_url
    dataset = load_dataset(DATA / "choice.jsonl")
    # Four right answers in assorted phrasings, one wrong, one without a letter.
    replies = ["The answer is B", "答案：C", "(B)", "A.", "The answer is A", "I am not sure."]
    stub.answers = {s.messages[-1]["content"]: reply for s, reply in zip(dataset.samples, replies)}
    assert evaluate(url, DATA / "choice.jsonl", tmp_path / "out") == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["metrics"]["accuracy"] == {"mean": pytest.approx(400 / 6), "count": 6}
    assert report["unanswered"] == 1


def test_loglik_picks_the_option_with_highest_summed_logprob(stub_url, tmp_path):
    url, stub = stub_url
    # B has the likeliest letter token but A the likeliest continuation " A" as a whole.
    stub.continuation_logprobs = {"A": (-0.1, -1.0), "B": (-2.0, -0.5), "C": (-1.5, -1.5), "D": (-3.0, -3.0)}
    assert evaluate(url, DATA / "choice.jsonl", tmp_path / "out", "--mc-mode", "loglik") == 0
    first = {r["index"]: r for r in results(tmp_path / "out")}[0]
    assert first["option_logprobs"] == pytest.approx({"A": -1.1, "B": -2.5, "C": -3.0, "D": -6.0})
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["metrics"]["accuracy"]["mean"] == pytest.approx(100 / 6)  # only sample 3's answer is A


def test_loglik_requests_echo_prompt_logprobs_without_generating(stub_url, tmp_path):
    url, stub = stub_url
    stub.continuation_logprobs = dict.fromkeys("ABCD", (-1.0, -1.0))
    assert evaluate(url, DATA / "choice.jsonl", tmp_path / "out", "--mc-mode", "loglik", "--limit", "1") == 0
    assert [p["prompt"][-len("Answer: A"):] for p in stub.completion_payloads] == [
        "Answer: A", "Answer: B", "Answer: C", "Answer: D"]
    assert all(p["echo"] is True and p["logprobs"] == 1 and p["max_tokens"] == 0
               for p in stub.completion_payloads)


def test_loglik_on_a_dataset_without_options_is_refused(stub_url, tmp_path, capsys):
    url, _ = stub_url
    assert evaluate(url, DATA / "alpaca.jsonl", tmp_path / "out", "--mc-mode", "loglik") == 2
    assert "needs a multiple-choice dataset" in capsys.readouterr().err


def test_continuation_logprob_is_anchored_at_the_end_of_the_echoed_prompt():
    # The server spelled a two-byte character as two "\ufffd" tokens, so offsets inside the prompt run
    # one character ahead of the prompt string; only the trailing " B" counts, and the token the server
    # generated after it is ignored.
    logprobs = {"tokens": ["Q", "\ufffd", "\ufffd", ":", " B", "!"],
                "token_logprobs": [None, -1.0, -1.0, -1.0, -0.25, -9.0],
                "text_offset": [0, 1, 2, 3, 4, 6]}
    assert sum_continuation_logprobs(logprobs, " B", generated_tokens=1) == -0.25


def test_retry_after_accepts_seconds_and_http_dates():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: retry now
    assert parse_retry_after("soon") is None


def test_backoff_grows_exponentially_and_defers_to_retry_after():
    policy = RetryPolicy(base_delay_s=0.5, max_delay_s=60.0)
    assert all(0 <= policy.delay(retry) <= 0.5 * 2 ** retry for retry in range(5) for _ in range(20))
    assert policy.delay(0, retry_after=2.5) == 2.5
    assert policy.delay(0, retry_after=600.0) == 60.0


def test_base_url_gets_v1_only_when_it_has_no_path():
    assert api_base("http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert api_base("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/v1"
    assert api_base("https://example.com/openai/v1") == "https://example.com/openai/v1"
