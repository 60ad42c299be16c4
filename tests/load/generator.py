"""The bounded load generator: `clients` async clients on one httpx pool, each sending one request at a
time until the duration is up or the run's request budget is spent; every request has a timeout. Flaky
clients abandon their requests at a random point (mid-stream, or before a non-streaming answer)."""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from tests.load.workload import (
    Answer, Policy, Problem, Reference, RequestSpec, compare_with_reference, parse_json_answer, parse_sse_answer,
)

MAX_PROBLEMS_KEPT = 20


@dataclass(frozen=True)
class LoadConfig:
    clients: int
    duration: float  # seconds of load
    max_requests: int  # total budget: the run stops at whichever bound comes first
    stream_share: float = 0.5
    flaky_share: float = 0.0  # share of clients that abandon every streaming request at a random point
    request_timeout: float = 300.0  # a bound on a queued request's whole life, not a latency target
    backoff_on_429: tuple[float, float] = (0.05, 0.25)  # seconds, uniform: keeps the pressure on, politely
    seed: int = 0
    policy: Policy = Policy()


@dataclass
class Tally:
    sent: int = 0
    succeeded: int = 0
    rejected: int = 0  # 429
    failed: int = 0  # no answer, a wrong answer, or a status other than 200 / 429
    disconnected: int = 0  # abandoned on purpose by a flaky client
    statuses: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)  # succeeded requests, to the last byte
    first_chunk: list[float] = field(default_factory=list)  # succeeded streams, to the first content chunk
    completion_tokens: int = 0
    near_tie_divergences: int = 0  # greedy answers that left the reference only at a near tie
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        self.failed += 1
        if len(self.problems) < MAX_PROBLEMS_KEPT:
            self.problems.append(text)

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)


# An idle connection must be dropped by the client before the server drops it (uvicorn: 5 s); with equal
# timeouts a request sent just as the server closes the connection fails with a ReadError (measured: 7 of
# 120 requests sent after 4.97-5.03 s idle). See docs/reliability.md.
CLIENT_KEEPALIVE_EXPIRY = 2.0


def http_client(base_url: str, clients: int, request_timeout: float) -> httpx.AsyncClient:
    """One pool for all clients; every request has a timeout, and nothing leaves loopback."""
    timeout = httpx.Timeout(request_timeout, connect=10.0)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4,
                          keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY)
    return httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits, trust_env=False)


async def send_one(http: httpx.AsyncClient, spec: RequestSpec, stream: bool, *, abandon_after: int | None = None
                   ) -> tuple[int, Answer | None, float | None]:
    """Send one request. Returns (status, answer, seconds to the first chunk). With `abandon_after`, a
    stream is closed after that many lines (status 0: abandoned). Raises Problem for a broken answer."""
    body = spec.request_body(stream)
    started = time.monotonic()
    if not stream:
        r = await http.post(spec.path, json=body)
        if r.status_code != 200:
            _check_error_body(spec, r.status_code, r.content, r.headers)
            return r.status_code, None, None
        return 200, parse_json_answer(spec, r.content), None
    async with http.stream("POST", spec.path, json=body) as r:
        if r.status_code != 200:
            _check_error_body(spec, r.status_code, await r.aread(), r.headers)
            return r.status_code, None, None
        if not r.headers.get("content-type", "").startswith("text/event-stream"):
            raise Problem(f"{spec.name}: stream content-type {r.headers.get('content-type')!r}")
        lines: list[str] = []
        first = None
        async for line in r.aiter_lines():
            if abandon_after is not None and len(lines) >= abandon_after:
                return 0, None, None  # leaving the block closes the connection mid-stream
            if first is None and line.startswith("data: "):
                first = time.monotonic() - started
            lines.append(line)
    return 200, parse_sse_answer(spec, lines), first


def _check_error_body(spec: RequestSpec, status: int, raw: bytes, headers: httpx.Headers) -> None:
    try:
        error = json.loads(raw)["error"]
        assert {"message", "type", "param", "code"} <= set(error)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise Problem(f"{spec.name}: status {status} without OpenAI error JSON: {raw[:120]!r}", status) from None
    if status == 429 and (error["type"] != "rate_limit_error" or "retry-after" not in headers):
        raise Problem(f"{spec.name}: 429 without rate_limit_error type and Retry-After", status)


async def run_load(base_url: str, specs: list[RequestSpec], reference: Reference, config: LoadConfig) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + config.duration
    n_flaky = round(config.clients * config.flaky_share)

    async def client(index: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(config.seed * 100_003 + index)
        flaky = index < n_flaky
        while time.monotonic() < deadline and tally.sent < config.max_requests:
            tally.sent += 1
            spec = rng.choice(specs)
            stream = rng.random() < config.stream_share
            # A flaky client leaves a stream after a random number of lines (some streams end first), and
            # gives up on a non-streaming request after a random wait.
            abandon_after = rng.randrange(0, 4 * spec.max_tokens + 8) if (flaky and stream) else None
            give_up_in = rng.uniform(0.05, 1.0) if (flaky and not stream) else None
            started = time.monotonic()
            try:
                status, answer, first = await asyncio.wait_for(
                    send_one(http, spec, stream, abandon_after=abandon_after),
                    timeout=give_up_in or config.request_timeout)
            except Problem as exc:
                tally.statuses[exc.status] += 1
                tally.problem(str(exc))
                continue
            except asyncio.TimeoutError:
                if give_up_in is not None:
                    tally.disconnected += 1
                else:
                    tally.problem(f"{spec.name}: no answer within {config.request_timeout:g}s")
                continue
            except httpx.HTTPError as exc:
                tally.problem(f"{spec.name}: no answer: {type(exc).__name__}: {exc}")
                continue
            if status == 0:
                tally.disconnected += 1
                continue
            tally.statuses[status] += 1
            if status == 429:
                tally.rejected += 1
                await asyncio.sleep(rng.uniform(*config.backoff_on_429))
                continue
            if status != 200 or answer is None:
                tally.problem(f"{spec.name}: status {status}")
                continue
            try:
                note = compare_with_reference(spec, answer, reference.answers[spec.name], config.policy)
            except Problem as exc:
                tally.problem(str(exc))
                continue
            tally.near_tie_divergences += note is not None
            tally.succeeded += 1
            tally.completion_tokens += answer.completion_tokens
            tally.latencies.append(time.monotonic() - started)
            if first is not None:
                tally.first_chunk.append(first)

    async with http_client(base_url, config.clients, config.request_timeout) as http:
        await asyncio.gather(*(client(i, http) for i in range(config.clients)))
    return tally


async def reference_run(base_url: str, specs: list[RequestSpec], timeout: float = 120.0) -> Reference:
    """Each spec once, alone and non-streaming: the answers the load is compared with. Reproducible specs
    are also probed with top logprobs, to learn where their tokens were near ties."""
    reference = Reference()
    async with http_client(base_url, 1, timeout) as http:

        async def one(spec: RequestSpec) -> Answer:
            status, answer, _ = await asyncio.wait_for(send_one(http, spec, False), timeout=timeout)
            if status != 200 or answer is None:
                raise RuntimeError(f"reference run: {spec.name} answered {status}")
            return answer

        for spec in specs:
            answer = await one(spec)
            if spec.deterministic:
                probe = await one(spec.probe())
                if probe.texts != answer.texts:
                    raise RuntimeError(f"reference run: {spec.name} changes its text when logprobs are asked for")
                answer.near_ties = probe.near_ties
            reference.answers[spec.name] = answer
    return reference


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]
