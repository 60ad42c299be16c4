"""--request-timeout: a request that runs too long ends cleanly with an error — a 408 body, or an error
event and [DONE] on a stream — and the engine stops working on it."""
from __future__ import annotations

import json

import pytest

from tests.conftest import start_server
from tests.ops_support import sse_data

ENDLESS = {"messages": [{"role": "user", "content": "Go on forever."}], "max_tokens": 3000, "ignore_eos": True}


@pytest.fixture(scope="module")
def one_second_limit(demo_model_dir):
    running = start_server(demo_model_dir, request_timeout=1.0)
    yield running
    running.stop()


def test_a_request_over_the_timeout_gets_a_408_error(one_second_limit):
    with one_second_limit.http() as http:
        response = http.post("/v1/chat/completions", json=ENDLESS)
    assert response.status_code == 408
    assert response.json()["error"]["code"] == "request_timeout"


def test_a_stream_over_the_timeout_ends_with_an_error_event_then_done(one_second_limit):
    with one_second_limit.http() as http, http.stream("POST", "/v1/chat/completions",
                                                      json={**ENDLESS, "stream": True}) as response:
        events = sse_data(response.iter_lines())
    assert response.status_code == 200
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert any(json.loads(e).get("choices") for e in events[:-2])  # it was generating when cut


@pytest.mark.parametrize("stream", [False, True])
def test_the_engine_stops_working_on_a_timed_out_request(one_second_limit, stream):
    with one_second_limit.http() as http:
        http.post("/v1/chat/completions", json={**ENDLESS, "stream": stream})
    one_second_limit.wait_idle(timeout=10)
    assert one_second_limit.engine.stats().kv_used_tokens == 0
