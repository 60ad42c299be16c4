"""Graceful shutdown. SIGTERM to `ktserve serve`: /health and new requests get 503, a stream in flight runs
to [DONE], a request still queued in the engine is answered, then the process exits 0. Requests still
running when graceful_timeout runs out end with an error their clients receive, never a cut connection.

The SIGTERM run also writes the JSON log that the log tests read."""
from __future__ import annotations

import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest

from tests.ops_support import ServerProcess, ThreadedServer, metric_samples, sample, sse_data, wait_for

KEY = "sk-shutdown-7d41c9"
WRONG_KEY = "sk-not-this-one-2b8e"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Long enough to still be generating when the signal arrives, short enough to finish within the grace period.
STREAM = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 120,
          "ignore_eos": True, "stream": True}
QUEUED = {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}
STREAM_ID = "sigterm-stream-1"


def read_stream(url: str, body: dict, headers: dict, started: threading.Event) -> list[str]:
    lines = []
    with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                lines.append(line)
                started.set()
    return lines


def engine_counts(http: httpx.Client) -> tuple[float, float]:
    """(running, waiting) engine requests, as /metrics reports them."""
    samples = metric_samples(http.get("/metrics", headers=AUTH).text)
    return sample(samples, "ktserve_requests_running"), sample(samples, "ktserve_requests_waiting")


@dataclass
class SigtermRun:
    stream_done_before_signal: bool
    stream: list[str]
    queued: httpx.Response
    health_while_draining: int
    new_request_while_draining: httpx.Response
    returncode: int
    log_lines: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def sigterm_run(demo_model_dir) -> SigtermRun:
    server = ServerProcess("--engine", "huggingface", "--model", str(demo_model_dir), "--api-key", KEY,
                           "--max-concurrent", "1", "--graceful-timeout", "60", "--log-format", "json")
    try:
        server.wait_healthy()
        with ThreadPoolExecutor(2) as pool, httpx.Client(base_url=server.url, timeout=60) as http:
            http.get("/v1/models", headers={"Authorization": f"Bearer {WRONG_KEY}"})
            http.get("/v1/models", params={"api_key": KEY}, headers=AUTH)
            started = threading.Event()
            stream = pool.submit(read_stream, server.url, STREAM, {**AUTH, "X-Request-Id": STREAM_ID}, started)
            assert started.wait(60), "the stream never began"
            queued = pool.submit(httpx.post, server.url + "/v1/completions", json=QUEUED, headers=AUTH, timeout=120)
            wait_for(lambda: engine_counts(http) == (1, 1), 60, "one request running and one queued")
            stream_done_before_signal = stream.done()
            server.proc.send_signal(signal.SIGTERM)
            health = wait_for(lambda: http.get("/health").status_code == 503 and 503, 30, "/health to turn 503")
            refused = http.get("/v1/models", headers=AUTH)
            run = SigtermRun(stream_done_before_signal, stream.result(timeout=120), queued.result(timeout=120),
                             health, refused, server.wait(timeout=120))
        run.log_lines = server.lines
        return run
    finally:
        server.kill()


def test_a_stream_in_flight_at_sigterm_runs_to_done(sigterm_run):
    assert not sigterm_run.stream_done_before_signal
    events = sse_data(sigterm_run.stream)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_request_queued_in_the_engine_at_sigterm_is_answered(sigterm_run):
    assert sigterm_run.queued.status_code == 200
    assert sigterm_run.queued.json()["usage"]["completion_tokens"] == QUEUED["max_tokens"]


def test_health_answers_503_while_draining(sigterm_run):
    assert sigterm_run.health_while_draining == 503


def test_new_requests_get_503_while_draining(sigterm_run):
    refused = sigterm_run.new_request_while_draining
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "service_unavailable"
    assert refused.headers["retry-after"]


def test_the_process_exits_zero_after_draining(sigterm_run):
    assert sigterm_run.returncode == 0


def request_log(run: SigtermRun) -> list[dict]:
    entries = [json.loads(line) for line in run.log_lines if line.startswith("{")]
    return [e for e in entries if e["logger"] == "ktserve.requests"]


def test_the_json_log_has_one_line_per_request_with_its_accounting(sigterm_run, demo_model_dir):
    (line,) = [e for e in request_log(sigterm_run) if e["request_id"] == STREAM_ID]
    assert line["method"] == "POST" and line["path"] == "/v1/chat/completions" and line["status"] == 200
    assert line["model"] == demo_model_dir.name  # the served model's id
    assert line["prompt_tokens"] > 0 and line["output_tokens"] == STREAM["max_tokens"]
    assert 0 < line["ttft_s"] <= line["duration_s"]
    assert line["finish_reasons"] == ["length"]
    statuses = sorted(e["status"] for e in request_log(sigterm_run) if e["path"] == "/v1/models")
    assert statuses == [200, 401, 503]


def test_the_api_key_never_reaches_the_log(sigterm_run):
    text = "\n".join(sigterm_run.log_lines)
    assert KEY not in text
    assert WRONG_KEY not in text


# --------------------------------------------------------------------------- after the grace period
@dataclass
class GraceRun:
    stream: list[str]
    queued: httpx.Response
    server_stopped: bool
    engine_stopped: bool


@pytest.fixture(scope="module")
def grace_run(demo_model_dir) -> GraceRun:
    """In-process, so the test can play the signal: the server draining with a half-second grace period
    while a stream that would take minutes runs and a second request waits behind it."""
    from engines.registry import create_engine
    from server.app import create_app
    from server.settings import load_settings
    from server.shutdown import DrainingServer

    settings = load_settings(None, {"model": str(demo_model_dir), "engine": "huggingface", "max_concurrent": 1,
                                    "graceful_timeout": 0.5}, env={})
    engine = create_engine(settings.engine, settings.engine_config(str(demo_model_dir)))
    app = create_app(settings, engine)
    running = ThreadedServer(app, lambda config: DrainingServer(config, app.state.drain))
    try:
        running.wait_healthy()
        endless = {**STREAM, "max_tokens": 3000}
        with ThreadPoolExecutor(2) as pool:
            started = threading.Event()
            stream = pool.submit(read_stream, running.base_url, endless, {}, started)
            assert started.wait(60), "the stream never began"
            queued = pool.submit(httpx.post, running.base_url + "/v1/completions", json=QUEUED, timeout=120)
            wait_for(lambda: (engine.stats().running, engine.stats().waiting) == (1, 1), 60,
                     "one request running and one queued")
            running.server.handle_exit(signal.SIGTERM, None)  # what the signal handler does
            lines, queued_response = stream.result(timeout=120), queued.result(timeout=120)
        running.thread.join(timeout=60)
        return GraceRun(lines, queued_response, not running.thread.is_alive(), not engine.ready)
    finally:
        running.stop()


def test_a_stream_still_running_after_the_grace_period_ends_with_an_error_event_then_done(grace_run):
    events = sse_data(grace_run.stream)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "server_shutdown")


def test_a_request_still_queued_after_the_grace_period_gets_a_503(grace_run):
    assert grace_run.queued.status_code == 503, grace_run.queued.text
    assert grace_run.queued.json()["error"]["code"] == "server_shutdown"


def test_the_server_and_engine_stop_once_the_last_answer_is_sent(grace_run):
    assert grace_run.server_stopped
    assert grace_run.engine_stopped
