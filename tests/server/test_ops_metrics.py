"""GET /metrics: Prometheus text that counts requests, tokens and latencies, shows the engine's state at
scrape time, and sits behind the API key unless made public."""
from __future__ import annotations

import pytest

from tests.ops_support import HeldLoadEngine, ThreadedServer, metric_samples, sample
from server.app import create_app
from server.settings import Settings

KEY = "sk-metrics-5e1f"
CHAT = {"messages": [{"role": "user", "content": "Count sheep."}], "max_tokens": 4, "ignore_eos": True,
        "temperature": 0}


def scrape(running) -> dict:
    with running.http() as http:
        response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return metric_samples(response.text)


def test_a_request_moves_the_request_token_and_latency_counters(server):
    before = scrape(server)
    with server.http() as http:
        reply = http.post("/v1/chat/completions", json=CHAT).json()
    after = scrape(server)

    def moved(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    route = "/v1/chat/completions"
    assert moved("ktserve_requests_total", route=route, status="200") == 1
    assert moved("ktserve_prompt_tokens_total") == reply["usage"]["prompt_tokens"]
    assert moved("ktserve_generation_tokens_total") == reply["usage"]["completion_tokens"] == 4
    assert moved("ktserve_time_to_first_token_seconds_count") == 1
    assert moved("ktserve_time_per_output_token_seconds_count") == 1
    assert moved("ktserve_request_duration_seconds_count", route=route) == 1
    assert moved("ktserve_choices_finished_total", finish_reason="length") == 1


def test_a_streamed_request_is_counted_like_any_other(server):
    before = scrape(server)
    with server.http() as http, http.stream("POST", "/v1/completions", json={
            "prompt": "Once upon", "max_tokens": 3, "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        assert list(response.iter_lines())[-2:] == ["data: [DONE]", ""]
    after = scrape(server)
    assert sample(after, "ktserve_requests_total", route="/v1/completions", status="200") - \
        sample(before, "ktserve_requests_total", route="/v1/completions", status="200") == 1
    assert sample(after, "ktserve_generation_tokens_total") - sample(before, "ktserve_generation_tokens_total") == 3
    assert sample(after, "ktserve_time_to_first_token_seconds_count") - \
        sample(before, "ktserve_time_to_first_token_seconds_count") == 1


def test_running_requests_and_kv_use_are_read_from_the_engine_at_scrape_time(server):
    body = {"prompt": "Tell a long story", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        during = scrape(server)
    server.wait_idle()
    after = scrape(server)
    assert sample(during, "ktserve_requests_running") == 1
    assert sample(during, "ktserve_requests_waiting") == 0
    assert sample(after, "ktserve_requests_running") == 0
    if sample(during, "ktserve_kv_cache_total_tokens"):  # engines with a bounded KV cache (ktransformers)
        assert sample(during, "ktserve_kv_cache_used_tokens") > 0
        assert 0 < sample(during, "ktserve_kv_cache_usage_ratio") <= 1
        assert sample(after, "ktserve_kv_cache_used_tokens") == 0


def test_step_time_and_cpu_expert_wait_are_exported_as_counters(server):
    with server.http() as http:
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    samples = scrape(server)
    steps = sample(samples, "ktserve_engine_step_seconds_total")
    wait = sample(samples, "ktserve_engine_expert_wait_seconds_total")
    assert sample(samples, "ktserve_engine_steps_total") > 0
    assert steps > 0
    assert 0 <= wait <= steps
    if server.engine.name == "ktransformers":  # its routed experts run on the CPU
        assert wait > 0


def test_where_step_time_goes_is_exported_as_counters(server):
    with server.http() as http:
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    samples = scrape(server)
    steps = sample(samples, "ktserve_engine_step_seconds_total")
    wait = sample(samples, "ktserve_engine_expert_wait_seconds_total")
    expert = sample(samples, "ktserve_engine_expert_seconds_total")
    gpu = sample(samples, "ktserve_engine_gpu_seconds_total")
    forward = sample(samples, "ktserve_engine_forward_seconds_total")
    assert 0 <= wait <= expert <= forward <= steps and 0 <= gpu + wait <= forward
    if server.engine.name == "ktransformers":  # CPU experts: their time and the wait on them are measured
        assert expert > 0


@pytest.fixture(scope="module")
def keyed_fake():
    """A server (no model) with an API key: /metrics needs it."""
    engine = HeldLoadEngine()
    engine.loaded.set()
    running = ThreadedServer(create_app(Settings(api_key=KEY), engine))
    running.wait_healthy()
    yield running
    running.stop()


def test_metrics_need_the_api_key_when_one_is_set(keyed_fake):
    with keyed_fake.http() as http:
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_metrics_public_serves_metrics_without_the_key():
    engine = HeldLoadEngine()
    engine.loaded.set()
    running = ThreadedServer(create_app(Settings(api_key=KEY, metrics_public=True), engine))
    try:
        running.wait_healthy()
        with running.http() as http:
            assert http.get("/metrics").status_code == 200
            assert http.get("/v1/models").status_code == 401
    finally:
        running.stop()


def test_unknown_paths_share_one_route_label(keyed_fake):
    auth = {"Authorization": f"Bearer {KEY}"}
    with keyed_fake.http(headers=auth) as http:
        assert http.get("/no/such/path-1234").status_code == 404
        text = http.get("/metrics").text
    samples = metric_samples(text)
    assert sample(samples, "ktserve_requests_total", route="unmatched", status="404") >= 1
    assert "path-1234" not in text


def test_streamed_expert_counters_are_exported_and_zero_without_streaming(server):
    samples = scrape(server)
    for name in ("ktserve_streamed_expert_calls_total", "ktserve_streamed_expert_bytes_total"):
        assert samples[(name, ())] == 0
