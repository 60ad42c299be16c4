"""Replicas behind a real router: sglang-router (SGLang's model gateway, the Rust binary from PyPI) in front
of two `ktserve serve` processes on the demo model, all on 127.0.0.1.

The replicas run the huggingface engine: the router sees only HTTP, and on two cores that engine starts in
a fraction of the KT engine's time. Both tests share the replicas; the SIGTERM test ends one of them, so
it comes last."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from tests.ops_support import ServerProcess, free_port, metric_samples, sample, wait_for

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install -e '.[test]')")

KEY = "sk-router-5c2e91"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "ktserve-demo"
CHAT_ROUTE = "/v1/chat/completions"


class RouterProcess:
    """`sglang-router launch` over the given workers, its log kept in a file."""

    def __init__(self, workers: list[str], log: Path, *args: str):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.metrics_url = f"http://127.0.0.1:{free_port()}"
        self.log = log
        command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                   "--port", self.url.rsplit(":", 1)[1], "--worker-urls", *workers, "--api-key", KEY,
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", self.metrics_url.rsplit(":", 1)[1],
                   "--shutdown-grace-period-secs", "5", "--log-level", "warn", *args]
        with log.open("w") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        wait_for(lambda: self._healthy_count() == len(workers), 60, "the router to register every worker")

    def _healthy_count(self) -> int:
        if self.proc.poll() is not None:
            raise RuntimeError("the router exited early:\n" + self.log.read_text()[-3000:])
        try:
            return sum(self.health().values())
        except httpx.TransportError:
            return 0

    def health(self) -> dict[str, bool]:
        """Each worker's health as the router sees it."""
        workers = httpx.get(self.url + "/workers", headers=AUTH, timeout=5).json()["workers"]
        return {w["url"]: w["is_healthy"] for w in workers}

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a metric's samples whose labels include `labels`."""
        samples = metric_samples(httpx.get(self.metrics_url + "/metrics", timeout=5).text)
        return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)


@pytest.fixture(scope="module")
def replicas(demo_model_dir) -> Iterator[list[ServerProcess]]:
    started = [ServerProcess("--engine", "huggingface", "--model", str(demo_model_dir), "--served-model-name", MODEL,
                             "--api-key", KEY, "--graceful-timeout", "60") for _ in range(2)]
    try:
        for replica in started:
            replica.wait_healthy(timeout=300)
        yield started
    finally:
        for replica in started:
            if replica.proc.poll() is None:
                replica.proc.send_signal(signal.SIGTERM)
        for replica in started:
            try:
                replica.wait(timeout=60)
            except subprocess.TimeoutExpired:
                replica.kill()


@pytest.fixture
def router_log(tmp_path) -> Path:
    return tmp_path / "router.log"


def chat_requests_served(replica: ServerProcess) -> float:
    text = httpx.get(replica.url + "/metrics", headers=AUTH, timeout=10).text
    return sample(metric_samples(text), "ktserve_requests_total", route=CHAT_ROUTE, status="200")


# A long shared beginning, as a system prompt or a few-shot preamble gives; the questions differ after it.
PREFIXES = {
    "tides": "You answer questions about tides and coastal navigation. " * 8,
    "bread": "You are a baker who explains sourdough, flour hydration and ovens. " * 8,
}


def test_repeated_prefixes_land_on_one_replica(replicas, router_log):
    router = RouterProcess([r.url for r in replicas], router_log, "--policy", "cache_aware")
    try:
        client = router.client()
        for name, prefix in PREFIXES.items():
            before = [chat_requests_served(r) for r in replicas]
            for i in range(5):
                client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
                    {"role": "system", "content": prefix}, {"role": "user", "content": f"Question {i} on {name}?"}])
            served = [chat_requests_served(r) - b for r, b in zip(replicas, before)]
            assert sorted(served) == [0, 5], f"requests sharing the {name!r} prefix spread over replicas: {served}"
    finally:
        router.stop()


REQUESTS = 36
SIGTERM_AFTER = 12  # completed requests
MAX_TOKENS = 4


def send(client: openai.OpenAI, i: int) -> str | None:
    """One request through the router, streaming every other one; None when it completed, else what failed."""
    kwargs = dict(model=MODEL, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True},
                  messages=[{"role": "user", "content": f"Request {i}: say something."}])
    try:
        if i % 2:
            finish = [c.choices[0].finish_reason for c in client.chat.completions.create(stream=True, **kwargs)
                      if c.choices and c.choices[0].finish_reason]
            return None if finish == ["length"] else f"stream {i} ended with {finish}"
        answer = client.chat.completions.create(**kwargs)
        if answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == MAX_TOKENS:
            return None
        return f"request {i} answered {answer.model_dump_json()}"
    except openai.APIError as exc:
        return f"request {i} failed: {exc!r}"


# as docs/scaling-out.md and the deploy files configure the router: back off 0.5, 1, 2, 4, 8 s, past the
# health check that marks a draining replica (the defaults spend all retries within 0.7 s)
RETRIES_OUTLASTING_HEALTH_CHECKS = ("--retry-max-retries", "6", "--retry-initial-backoff-ms", "500",
                                    "--retry-backoff-multiplier", "2")


def test_sigterm_to_a_replica_loses_no_request_through_the_router(replicas, router_log):
    victim, survivor = replicas
    router = RouterProcess([victim.url, survivor.url], router_log, "--policy", "round_robin",
                           "--health-check-interval-secs", "2", "--health-failure-threshold", "1",
                           *RETRIES_OUTLASTING_HEALTH_CHECKS)
    client = router.client()
    completed = threading.Semaphore(0)

    def counted(i: int) -> str | None:
        try:
            return send(client, i)
        finally:
            completed.release()

    try:
        with ThreadPoolExecutor(4) as pool:
            results = [pool.submit(counted, i) for i in range(REQUESTS)]
            for _ in range(SIGTERM_AFTER):
                assert completed.acquire(timeout=120), "requests stopped completing before the SIGTERM"
            # A long stream on the victim keeps it draining (alive, finishing its work) after the signal.
            keeper = openai.OpenAI(base_url=victim.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
            kept = keeper.chat.completions.create(
                model=MODEL, max_tokens=3000, stream=True, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": "Keep talking."}])
            chunks = iter(kept)
            next(chunks)
            victim.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: router.health()[victim.url] is False, 30, "the router to mark the victim unhealthy")
            alive_when_marked = victim.proc.poll() is None
            chunks_after_mark = sum(1 for _, _ in zip(range(5), chunks))
            kept.close()  # the victim cancels it, and with nothing left in flight it exits
            failures = [f for f in (r.result(timeout=300) for r in results) if f is not None]
        returncode = victim.wait(timeout=60)
        refused = router.metric("smg_router_upstream_responses_total", status_code="503")
        retries = router.metric("smg_worker_retries_total")
        print(json.dumps({"requests": REQUESTS, "failed": len(failures), "victim_503s_retried": refused,
                          "router_retries": retries, "victim_alive_when_marked_unhealthy": alive_when_marked}))
        assert failures == []
        assert refused <= retries, "a 503 from the draining replica reached the router and was not retried"
        assert alive_when_marked, "the router noticed the replica only after it had exited"
        assert chunks_after_mark == 5, "the draining replica stopped serving its stream in flight"
        assert returncode == 0
        assert router.health()[survivor.url] is True
    finally:
        router.stop()
