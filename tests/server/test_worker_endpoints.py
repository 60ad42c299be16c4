"""The endpoints a router probes on each replica (server/worker): what it serves, its load, a deep health
check, all behind the API key the router sends as a bearer token."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import httpx
import pytest

from tests.conftest import start_server
from tests.lora_helpers import make_peft_adapter
from tests.ops_support import wait_for

KEY = "sk-worker-81d3aa"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROBES = ["/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_load", "/health_generate"]


@pytest.fixture(scope="module")
def replica(demo_model_dir, reference_model, tmp_path_factory):
    adapter = tmp_path_factory.mktemp("adapters") / "tone"
    make_peft_adapter(reference_model, "attn", adapter)
    running = start_server(demo_model_dir, api_key=KEY, max_concurrent=3, max_queue=7, adapters={"tone": str(adapter)})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http(replica):
    with replica.http(headers=AUTH) as client:
        yield client


@pytest.mark.parametrize("path", PROBES)
def test_router_probes_need_the_api_key(replica, path):
    with replica.http() as anonymous:
        assert anonymous.get(path).status_code == 401


def test_server_info_names_the_model_its_adapters_and_capacity(http, replica):
    info = http.get("/server_info").json()
    assert info["served_model_name"] == replica.engine.info.id
    assert info["adapters"] == ["tone"]
    assert info["context_length"] == replica.engine.info.max_model_len
    assert (info["max_running_requests"], info["max_queued_requests"]) == (3, 7)
    assert info["dp_size"] == 1
    assert "model_path" not in info  # a router would try to fetch it from a model hub


def test_older_probe_names_answer_the_same(http):
    assert http.get("/get_server_info").json() == http.get("/server_info").json()
    assert http.get("/get_model_info").json() == http.get("/model_info").json()


def test_model_info_describes_a_generative_model(http, replica):
    info = http.get("/model_info").json()
    assert info["is_generation"] is True
    assert info["architectures"] == [replica.engine.info.architecture]
    assert info["adapters"] == ["tone"]


@contextmanager
def busy(replica, choices: int) -> Iterator[None]:
    """A stream of `choices` long choices, generating for as long as the block runs."""
    body = {"messages": [{"role": "user", "content": "Go on."}], "max_tokens": 400, "ignore_eos": True,
            "stream": True, "n": choices}
    started, finished = threading.Event(), threading.Event()

    def stream() -> None:
        with httpx.Client(base_url=replica.url, headers=AUTH, timeout=120) as client:
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                for _ in response.iter_lines():
                    started.set()
                    if finished.is_set():
                        return  # closing the stream cancels the rest

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        assert started.wait(60), "the stream never started"
        yield
    finally:
        finished.set()
        reader.join(60)
        replica.wait_idle()


def test_load_is_zero_when_idle(http, replica):
    replica.wait_idle()
    assert http.get("/get_load").json() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


def test_load_counts_running_and_queued_requests(http, replica):
    with busy(replica, choices=5):
        load = http.get("/get_load").json()[0]
    # five choices: three generating at once (max_concurrent), the other two queued behind them
    assert (load["num_reqs"], load["num_waiting_reqs"]) == (3, 2)


def test_health_generate_generates_a_token_when_idle(http, replica):
    steps = replica.engine.stats().steps
    assert http.get("/health_generate").json()["status"] == "ok"
    # the step counter moves right after the step's token is handed out: allow it that moment
    wait_for(lambda: replica.engine.stats().steps > steps, 10, "the probe's step to be counted")


def test_health_generate_on_a_busy_engine_answers_without_queueing(http, replica):
    with busy(replica, choices=5):
        assert http.get("/health_generate").json()["status"] == "ok"
        assert http.get("/get_load").json()[0]["num_waiting_reqs"] == 2  # no probe request joined the queue
