"""Short versions of the load scenarios (tests/load): a few clients for a few seconds against a real
`ktserve serve` process (ktransformers engine, BF16 experts: it batches and has a paged KV cache, so
cross-talk and leaked cache blocks would show). Every answer is checked (framing, usage, reference text);
each scenario's expectations are the assertions. The long version is `python -m tests.load.run`
(docs/reliability.md)."""
from __future__ import annotations

import asyncio
import json

import pytest

from tests.load.scenarios import SCENARIOS, prepare, run_scenario
from tests.load.server import ServerOptions, ServerProcess

pytestmark = pytest.mark.timeout(600)

SECONDS = 8.0
CLIENTS = 6  # each asks for at most 2 choices at a time: well inside the server's capacity of 16
OPTIONS = ServerOptions(engine="ktransformers", kt_method="BF16", max_concurrent=4, max_queue=12)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(OPTIONS, tmp_path_factory.mktemp("load") / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def workload(server):
    return asyncio.run(prepare(server, pool=8, max_tokens_cap=8))


def run(server, workload, name: str, clients: int) -> dict:
    report = asyncio.run(run_scenario(server, SCENARIOS[name], workload, clients=clients, duration=SECONDS,
                                      warmup=1.0, max_requests=400))
    print(json.dumps(report, indent=1, ensure_ascii=False))
    return report


def test_steady_load_every_answer_checks_out_and_the_engine_ends_idle(server, workload):
    report = run(server, workload, "steady", CLIENTS)
    assert report["violations"] == [], report["problems"]
    assert report["requests"]["succeeded"] > CLIENTS


def test_clients_that_disconnect_mid_stream_leave_nothing_running_and_the_kv_cache_free(server, workload):
    report = run(server, workload, "disconnect", CLIENTS)
    assert report["violations"] == [], report["problems"]
    assert report["requests"]["disconnected_on_purpose"] > 0
    assert report["engine_after"]["running"] == report["engine_after"]["waiting"] == 0
    assert report["engine_after"]["kv_used_tokens"] == 0
    assert report["engine_peak"]["kv_used_tokens"] > 0  # the cache was really in use


def test_overload_is_answered_with_200_or_429_only_and_the_server_recovers(server, workload):
    capacity = OPTIONS.max_concurrent + OPTIONS.max_queue
    report = run(server, workload, "overload", 4 * capacity)
    assert report["violations"] == [], report["problems"]
    assert set(report["requests"]["statuses"]) == {"200", "429"}
    assert report["recovery"]["succeeded"] == report["recovery"]["requests"]
