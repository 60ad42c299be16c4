"""Overload: with MAX_CONCURRENT=1 and --max-queue 2, one request runs, two wait, and the rest are refused
at once with 429 and Retry-After — and the server serves normally once the burst has passed."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx
import pytest

from tests.conftest import start_server

LONG = {"prompt": "Tell a long story", "max_tokens": 96, "ignore_eos": True}  # outlasts the burst
SHORT = {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def one_running_two_queued(demo_model_dir):
    running = start_server(demo_model_dir, max_concurrent=1, max_queue=2)
    yield running
    running.stop()


@dataclass
class Outcome:
    first: httpx.Response  # the long request that was running
    burst: list[httpx.Response]
    queue_emptied_while_first_ran: bool


async def while_one_runs(server, bodies: list[dict]) -> Outcome:
    """Start a long request, wait until the engine runs it, then send `bodies` all at once."""
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
        first = asyncio.create_task(http.post("/v1/completions", json=LONG))
        for _ in range(600):
            if server.engine.stats().running == 1:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the long request never started running")
        burst = await asyncio.gather(*(http.post("/v1/completions", json=body) for body in bodies))
        while server.engine.stats().waiting and not first.done():
            await asyncio.sleep(0.01)
        emptied = not first.done()
        return Outcome(await asyncio.wait_for(first, 120), list(burst), emptied)


@dataclass
class Burst:
    responses: list[httpx.Response]
    after: httpx.Response


@pytest.fixture(scope="module")
def burst(one_running_two_queued) -> Burst:
    server = one_running_two_queued
    outcome = asyncio.run(while_one_runs(server, [SHORT] * 7))
    server.wait_idle()
    with server.http() as http:
        after = http.post("/v1/completions", json=SHORT)
    return Burst([outcome.first] + outcome.burst, after)


def test_a_burst_of_eight_gets_one_running_two_queued_and_five_429(burst):
    statuses = sorted(r.status_code for r in burst.responses)
    assert statuses == [200] * 3 + [429] * 5


def test_a_refused_request_says_when_to_retry(burst):
    refused = [r for r in burst.responses if r.status_code == 429]
    assert all(r.headers["retry-after"] == "1" for r in refused)
    assert all(r.json()["error"]["code"] == "queue_full" for r in refused)


def test_the_server_serves_again_after_the_burst(burst):
    assert burst.after.status_code == 200


def test_a_request_whose_choices_do_not_all_fit_is_refused_whole(one_running_two_queued):
    three_choices = {**SHORT, "n": 3}  # each choice is one engine request: three places for a queue of two
    outcome = asyncio.run(while_one_runs(one_running_two_queued, [three_choices]))
    assert outcome.burst[0].status_code == 429
    assert outcome.queue_emptied_while_first_ran  # the two choices that had fitted were taken back out
    assert outcome.first.status_code == 200
