"""How long `/health` waits while one heavy request is handled: the event loop's responsiveness, from outside.

Starts `ktserve serve` on the demo model in its own process (so neither the poller's nor the heavy client's
Python shares the server's interpreter lock), then for each scenario sends the heavy request `--repeat` times
from one thread — its body encoded beforehand, its answer read as bytes — while another thread sends a
`/health` every `--interval` seconds on a connection of its own. A baseline round polls `/health` alone for
as long, so what the machine's own scheduling costs is measured beside it. Prints one JSON object.

    python -m bench.health_latency [--engine huggingface] [--repeat 3] [--only tokenize,detokenize]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import httpx

from bench.lib.report import median, percentile
from tests.load.server import ServerOptions, ServerProcess

BIG_TEXT = "The quick brown fox jumps over the lazy dog. " * 60_000  # 2.7 M characters

# name -> (path, body); bodies are the probe's of 2026-11-28 (tests/server/test_second_probe_findings.py)
SCENARIOS: dict[str, tuple[str, Callable[[str], dict]]] = {
    "tokenize": ("/tokenize", lambda model: {"prompt": BIG_TEXT, "return_token_strs": True}),
    "detokenize": ("/detokenize", lambda model: {"tokens": [1000 + i % 5000 for i in range(1_000_000)]}),
    "api-embed": ("/api/embed", lambda model: {"model": model, "input": ["a short text to embed"] * 2048}),
    "v1-embeddings": ("/v1/embeddings", lambda model: {"model": model, "input": ["a short text to embed"] * 2048}),
    "completions-128-prompts": ("/v1/completions", lambda model: {
        "model": model, "prompt": [f"prompt number {i}: a short text" for i in range(128)], "max_tokens": 1}),
}


def summary(latencies: list[float]) -> dict:
    return {"count": len(latencies), "median_s": round(median(latencies), 4),
            "p99_s": round(percentile(latencies, 99), 4), "max_s": round(max(latencies), 4)}


def poll_health(url: str, interval: float, until: Callable[[], bool], limit: int = 20_000) -> list[float]:
    latencies = []
    with httpx.Client(base_url=url, timeout=60) as http:
        http.get("/health")
        for _ in range(limit):
            started = time.perf_counter()
            http.get("/health").raise_for_status()
            latencies.append(time.perf_counter() - started)
            if until():
                break
            time.sleep(interval)
    return latencies


def during(url: str, path: str, body: bytes, repeat: int, interval: float) -> dict:
    done = threading.Event()
    durations, statuses = [], []

    def heavy():
        try:
            with httpx.Client(base_url=url, timeout=300) as http:
                for _ in range(repeat):
                    started = time.perf_counter()
                    r = http.post(path, content=body, headers={"content-type": "application/json"})
                    durations.append(time.perf_counter() - started)
                    statuses.append(r.status_code)
        finally:
            done.set()
    thread = threading.Thread(target=heavy)
    thread.start()
    latencies = poll_health(url, interval, done.is_set)
    thread.join(300)
    return {"health": summary(latencies), "request_s": [round(d, 3) for d in durations], "status": statuses}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.health_latency", description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="huggingface", choices=["huggingface", "ktransformers"])
    p.add_argument("--kt-method", default="BF16")
    p.add_argument("--repeat", type=int, default=3, help="heavy requests per scenario, one after another")
    p.add_argument("--interval", type=float, default=0.02, help="seconds between /health requests")
    p.add_argument("--baseline", type=float, default=10.0, help="seconds of /health alone")
    p.add_argument("--only", help="comma-separated scenarios: " + ",".join(SCENARIOS))
    p.add_argument("--url", help="measure this running server instead of starting one")
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else list(SCENARIOS)
    options = ServerOptions(engine=args.engine, kt_method=args.kt_method if args.engine == "ktransformers" else None,
                            max_concurrent=4, max_queue=256)
    report: dict = {"engine": args.url or args.engine, "load_average": os.getloadavg(), "cpus": os.cpu_count()}
    if args.url:
        measure(args.url, names, args, report)
    else:
        with tempfile.TemporaryDirectory() as tmp, ServerProcess(options, Path(tmp) / "server.log") as server:
            measure(server.base_url, names, args, report)
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report))
    return 0


def measure(url: str, names: list[str], args: argparse.Namespace, report: dict) -> None:
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    deadline = time.monotonic() + args.baseline
    report["alone"] = summary(poll_health(url, args.interval, lambda: time.monotonic() > deadline))
    for name in names:
        path, body = SCENARIOS[name]
        report[name] = during(url, path, json.dumps(body(model)).encode(), args.repeat, args.interval)
        print(json.dumps({name: report[name]}), flush=True)
    deadline = time.monotonic() + args.baseline
    report["alone_after"] = summary(poll_health(url, args.interval, lambda: time.monotonic() > deadline))


if __name__ == "__main__":
    raise SystemExit(main())
