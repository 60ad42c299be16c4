"""The three scenarios, what each expects, and the per-scenario report.

steady      `clients` clients for `duration`: no failures, no 5xx, no 429, server RSS growth < 10% after
            warm-up, engine idle afterwards.
disconnect  the same with a quarter of the clients abandoning their requests at random points: no
            failures or 5xx among the rest, and afterwards nothing running or waiting and the KV cache
            all free.
overload    far more clients than max_concurrent + max_queue: every request answered (200 or 429 with
            Retry-After, nothing else, nothing left hanging), and full recovery: idle engine, free KV
            cache, and a round of requests that all succeed with the reference answers.

In every scenario the server must log no ERROR line (a traceback per disconnect is a bug too), keep
running <= max_concurrent and waiting <= max_queue, and pass a recovery round afterwards."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any

import httpx

from tests.load.generator import LoadConfig, Tally, percentile, reference_run, run_load
from tests.load.server import ServerOptions, ServerProcess, parse_engine_state
from tests.load.generator import http_client, send_one
from tests.load.workload import Policy, Problem, Reference, RequestSpec, build_specs, compare_with_reference

# Engines that run every request as its own forward pass: seeded sampling reproduces exactly under load.
BATCH_INVARIANT_ENGINES = frozenset({"huggingface"})

RSS_GROWTH_LIMIT = 0.10
IDLE_WAIT_SECONDS = 60.0
MONITOR_INTERVAL = 1.0


@dataclass(frozen=True)
class Scenario:
    name: str
    flaky_share: float = 0.0
    overload: bool = False
    # server capacity for this scenario (engine requests: one per choice)
    max_concurrent: int = 16
    max_queue: int = 256


SCENARIOS = {
    "steady": Scenario("steady"),
    "disconnect": Scenario("disconnect", flaky_share=0.25),
    "overload": Scenario("overload", overload=True, max_concurrent=2, max_queue=4),
}


def server_options(scenario: Scenario, engine: str, kt_method: str | None, **overrides: Any) -> ServerOptions:
    return ServerOptions(engine=engine, kt_method=kt_method if engine == "ktransformers" else None,
                         max_concurrent=overrides.get("max_concurrent") or scenario.max_concurrent,
                         max_queue=overrides.get("max_queue") if overrides.get("max_queue") is not None
                         else scenario.max_queue)


class Monitor:
    """Samples the server's engine gauges and RSS once a second while the load runs (bounded by the run)."""

    def __init__(self, server: ServerProcess):
        self.server = server
        self.peak_running = self.peak_waiting = self.peak_kv_used = 0
        self.rss_samples: list[int] = []

    async def run(self, http: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                state = await engine_state(http)
                self.peak_running = max(self.peak_running, state.get("running", 0))
                self.peak_waiting = max(self.peak_waiting, state.get("waiting", 0))
                self.peak_kv_used = max(self.peak_kv_used, state.get("kv_used_tokens", 0))
            except (httpx.HTTPError, ValueError):
                pass  # a missed sample under load is not a failure; the run's own checks are
            self.rss_samples.append(self.server.rss_bytes())
            try:
                await asyncio.wait_for(stop.wait(), timeout=MONITOR_INTERVAL)
            except asyncio.TimeoutError:
                pass


async def engine_state(http: httpx.AsyncClient) -> dict[str, int]:
    r = await http.get("/metrics", timeout=10)
    r.raise_for_status()
    return parse_engine_state(r.text)


async def wait_idle(http: httpx.AsyncClient, timeout: float = IDLE_WAIT_SECONDS) -> tuple[dict[str, int], float]:
    """Poll until nothing runs or waits and the KV cache is free (bounded); return the last state and how
    long it took."""
    started = time.monotonic()
    state: dict[str, int] = {}
    while time.monotonic() - started < timeout:
        state = await engine_state(http)
        if state.get("running") == 0 and state.get("waiting") == 0 and state.get("kv_used_tokens") == 0:
            break
        await asyncio.sleep(0.1)
    return state, round(time.monotonic() - started, 2)


async def recovery_round(base_url: str, specs: list[RequestSpec], reference: Reference, policy: Policy
                         ) -> dict[str, Any]:
    """Every deterministic spec once more, one at a time: all must succeed with the reference answer."""
    ok, problems = 0, []
    chosen = [s for s in specs if s.deterministic]
    async with http_client(base_url, 1, 120.0) as http:
        for i, spec in enumerate(chosen):
            try:
                status, answer, _ = await asyncio.wait_for(send_one(http, spec, stream=i % 2 == 1), 120.0)
                if status != 200 or answer is None:
                    raise Problem(f"{spec.name}: status {status}")
                compare_with_reference(spec, answer, reference.answers[spec.name], policy)
                ok += 1
            except (Problem, httpx.HTTPError, asyncio.TimeoutError) as exc:
                problems.append(f"{type(exc).__name__}: {exc}")
    return {"requests": len(chosen), "succeeded": ok, "problems": problems[:5]}


@dataclass
class Workload:
    """The request pool and its reference answers, computed once per server and reused by scenarios."""

    specs: list[RequestSpec]
    reference: Reference
    policy: Policy


async def prepare(server: ServerProcess, *, pool: int = 32, seed: int = 0, max_tokens_cap: int | None = None
                  ) -> Workload:
    specs = build_specs(pool, seed, max_tokens_cap=max_tokens_cap)
    reference = await reference_run(server.base_url, specs)
    return Workload(specs, reference, Policy(exact_seeded=server.options.engine in BATCH_INVARIANT_ENGINES))


async def run_scenario(server: ServerProcess, scenario: Scenario, workload: Workload, *, clients: int,
                       duration: float, warmup: float, max_requests: int, seed: int = 0,
                       request_timeout: float = 300.0) -> dict[str, Any]:
    specs, reference, policy = workload.specs, workload.reference, workload.policy
    log_start = server.log_size()
    config = LoadConfig(clients=clients, duration=duration, max_requests=max_requests,
                        flaky_share=scenario.flaky_share, seed=seed, policy=policy,
                        request_timeout=request_timeout)
    if warmup > 0:  # the same load, unmeasured: caches and allocator arenas reach their working size
        await run_load(server.base_url, specs, reference,
                       replace(config, duration=warmup, flaky_share=0.0, seed=seed + 1))
    async with http_client(server.base_url, 2, 30.0) as http:
        await wait_idle(http)
        rss_start = server.rss_bytes()
        monitor, stop = Monitor(server), asyncio.Event()
        watcher = asyncio.create_task(monitor.run(http, stop))
        started = time.monotonic()
        try:
            tally = await run_load(server.base_url, specs, reference, config)
        finally:
            stop.set()
            await watcher
        elapsed = time.monotonic() - started
        after, idle_after = await wait_idle(http)
        rss_end = server.rss_bytes()
    recovery = await recovery_round(server.base_url, specs, reference, policy)
    report = _report(scenario, server, clients, duration, elapsed, tally, monitor, rss_start, rss_end, after,
                     idle_after, recovery)
    errors = server.log_errors(log_start)
    report["server_log_errors"] = {"count": len(errors), "first": errors[:5]}
    report["violations"] = violations(scenario, server.options, report, tally)
    report["passed"] = not report["violations"] and server.alive
    return report


def _report(scenario, server, clients, duration, elapsed, tally: Tally, monitor: Monitor, rss_start, rss_end,
            after, idle_after, recovery) -> dict[str, Any]:
    mb = 1024 * 1024
    o = server.options
    return {
        "scenario": scenario.name,
        "engine": o.engine, "kt_method": o.kt_method,
        "server": {"max_concurrent": o.max_concurrent, "max_queue": o.max_queue},
        "clients": clients, "duration_s": duration, "elapsed_s": round(elapsed, 1),
        "flaky_share": scenario.flaky_share,
        "requests": {"sent": tally.sent, "succeeded": tally.succeeded, "rejected_429": tally.rejected,
                     "failed": tally.failed, "disconnected_on_purpose": tally.disconnected,
                     "status_5xx": tally.server_errors,
                     "statuses": {str(k): v for k, v in sorted(tally.statuses.items())}},
        "latency_s": {"p50": _r(percentile(tally.latencies, 50)), "p99": _r(percentile(tally.latencies, 99)),
                      "max": _r(max(tally.latencies, default=None))},
        "stream_first_chunk_s": {"p50": _r(percentile(tally.first_chunk, 50)),
                                 "p99": _r(percentile(tally.first_chunk, 99))},
        "completion_tokens": tally.completion_tokens,
        "near_tie_divergences": tally.near_tie_divergences,
        "seeded_compared_exactly": server.options.engine in BATCH_INVARIANT_ENGINES,
        "tokens_per_s": round(tally.completion_tokens / elapsed, 1) if elapsed else None,
        "rss_mb": {"start": round(rss_start / mb, 1), "end": round(rss_end / mb, 1),
                   "peak": round(max(monitor.rss_samples + [rss_end]) / mb, 1),
                   "growth_pct": round(100 * (rss_end - rss_start) / rss_start, 2)},
        "engine_peak": {"running": monitor.peak_running, "waiting": monitor.peak_waiting,
                        "kv_used_tokens": monitor.peak_kv_used},
        "engine_after": {**after, "idle_within_s": idle_after},
        "recovery": recovery,
        "problems": tally.problems,
    }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def violations(scenario: Scenario, options: ServerOptions, report: dict[str, Any], tally: Tally) -> list[str]:
    """What this run broke of its scenario's expectations (empty: passed)."""
    out = []
    req, after = report["requests"], report["engine_after"]
    if req["failed"]:
        out.append(f"{req['failed']} failed requests")
    if req["status_5xx"]:
        out.append(f"{req['status_5xx']} 5xx answers")
    if not req["succeeded"]:
        out.append("no request succeeded")
    if report["server_log_errors"]["count"]:
        out.append(f"the server logged {report['server_log_errors']['count']} error lines")
    if any(after.get(k) != 0 for k in ("running", "waiting", "kv_used_tokens")):
        out.append(f"engine not idle after the run: {after}")
    rec = report["recovery"]
    if rec["succeeded"] != rec["requests"]:
        out.append(f"recovery round: {rec['succeeded']}/{rec['requests']} succeeded")
    peak = report["engine_peak"]
    if peak["running"] > options.max_concurrent or peak["waiting"] > options.max_queue:
        out.append(f"engine bounds exceeded: {peak}")
    if scenario.name == "steady":
        if req["rejected_429"]:
            out.append(f"{req['rejected_429']} requests rejected below capacity")
        if report["rss_mb"]["growth_pct"] >= 100 * RSS_GROWTH_LIMIT:
            out.append(f"RSS grew {report['rss_mb']['growth_pct']}% after warm-up")
    if scenario.overload:
        if not req["rejected_429"]:
            out.append("overload produced no 429: the server was not overloaded")
        unexpected = {s for s in req["statuses"] if s not in ("200", "429")}
        if unexpected:
            out.append(f"statuses other than 200/429 under overload: {sorted(unexpected)}")
    if scenario.flaky_share and not req["disconnected_on_purpose"]:
        out.append("no client disconnected: the scenario did not exercise disconnects")
    return out
