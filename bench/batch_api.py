"""The Batch API beside concurrent clients: one batch of N completion requests against the same N requests sent
by C concurrent clients, and an interactive request's time to first token while the batch runs.

Starts `ktserve serve` on the demo model in its own process (`--max-concurrent C`, so the clients get a slot
each; the batch runs `batch_max_in_flight` lines at once, half of that by default), then:
  1. idle: `--probes` streaming chat requests one after another, their TTFT;
  2. batch: uploads the N lines, creates the batch, polls it to the end; meanwhile the same probes, spaced
     `--probe-interval` apart, measure TTFT beside the batch;
  3. clients: the same N request bodies from C concurrent clients.
Requests use `ignore_eos`, so every line writes `--max-tokens` tokens in both runs. Prints one JSON object.

    python -m bench.batch_api [--lines 2000] [--clients 32] [--max-tokens 16] [--engine huggingface]
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import tempfile
import time
from pathlib import Path

import httpx

from bench.lib.report import median, percentile
from tests.load.server import ServerOptions, ServerProcess

POLL_S = 0.2


def bodies(model: str, lines: int, max_tokens: int) -> list[dict]:
    return [{"model": model, "prompt": f"Sample {i}: the river begins in the mountains and", "max_tokens": max_tokens,
             "temperature": 0, "ignore_eos": True} for i in range(lines)]


def ttft(url: str, model: str, max_tokens: int) -> float:
    """Seconds from sending a streaming chat request to its first content delta."""
    body = {"model": model, "messages": [{"role": "user", "content": "What is a river?"}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    started = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():  # read to the end, as a client does
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"no content delta in the stream (HTTP {response.status_code})")
    return first


def summary(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    return {"count": len(values), "p50_s": round(median(values), 4), "p90_s": round(percentile(values, 90), 4),
            "max_s": round(max(values), 4)}


def run_batch(url: str, requests: list[dict], probe: dict) -> dict:
    """The batch of `requests` to its end; TTFT probes beside it while it runs."""
    data = b"".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                                "body": body}).encode() + b"\n" for i, body in enumerate(requests))
    with httpx.Client(base_url=url, timeout=300) as http:
        started = time.perf_counter()
        uploaded = http.post("/v1/files", files={"file": ("bench.jsonl", io.BytesIO(data))},
                             data={"purpose": "batch"}).json()
        batch = http.post("/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": "/v1/completions"}).json()
        probes, next_probe = [], time.perf_counter() + probe["interval"]
        deadline = time.perf_counter() + probe["limit_s"]
        while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the batch did not finish within {probe['limit_s']} s: {batch['request_counts']}")
            if batch["status"] == "in_progress" and time.perf_counter() >= next_probe and len(probes) < probe["count"]:
                probes.append(ttft(url, probe["model"], probe["max_tokens"]))
                next_probe = time.perf_counter() + probe["interval"]
            else:
                time.sleep(POLL_S)
            batch = http.get(f"/v1/batches/{batch['id']}").json()
        elapsed = time.perf_counter() - started
        output = http.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines()
    tokens = sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"] for line in output)
    return {"status": batch["status"], "lines": len(output), "failed": batch["request_counts"]["failed"],
            "seconds": round(elapsed, 2), "requests_per_s": round(len(output) / elapsed, 2),
            "output_tokens_per_s": round(tokens / elapsed, 1), "ttft_during": summary(probes)}


async def run_clients(url: str, requests: list[dict], clients: int) -> dict:
    pending = iter(requests)
    tokens, failures = 0, 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        async def client() -> None:
            nonlocal tokens, failures
            for body in pending:
                r = await http.post("/v1/completions", json=body)
                if r.status_code == 200:
                    tokens += r.json()["usage"]["completion_tokens"]
                else:
                    failures += 1

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.perf_counter() - started
    done = len(requests) - failures
    return {"clients": clients, "lines": done, "failed": failures, "seconds": round(elapsed, 2),
            "requests_per_s": round(done / elapsed, 2), "output_tokens_per_s": round(tokens / elapsed, 1)}


def measure(url: str, args: argparse.Namespace, report: dict) -> None:
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    ttft(url, model, args.max_tokens)  # warm-up
    report["ttft_idle"] = summary([ttft(url, model, args.max_tokens) for _ in range(args.probes)])
    requests = bodies(model, args.lines, args.max_tokens)
    probe = {"model": model, "max_tokens": args.max_tokens, "count": args.probes, "interval": args.probe_interval,
             "limit_s": args.limit}
    report["batch"] = run_batch(url, requests, probe)
    report["concurrent_clients"] = asyncio.run(run_clients(url, requests, args.clients))
    report["batch_vs_clients_throughput"] = round(
        report["batch"]["requests_per_s"] / report["concurrent_clients"]["requests_per_s"], 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.batch_api", description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=2000, help="requests in the batch (and sent by the clients)")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients, and the server's max_concurrent")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each request writes")
    p.add_argument("--in-flight", type=int, help="batch_max_in_flight (default: the server's, max_concurrent / 2)")
    p.add_argument("--probes", type=int, default=10, help="TTFT requests idle, and during the batch")
    p.add_argument("--probe-interval", type=float, default=1.0, help="seconds between probes during the batch")
    p.add_argument("--engine", default="huggingface", choices=["huggingface", "ktransformers"])
    p.add_argument("--kt-method", default="BF16")
    p.add_argument("--limit", type=float, default=3600.0, help="seconds the batch may take")
    args = p.parse_args(argv)
    report: dict = {"engine": args.engine, "lines": args.lines, "max_tokens": args.max_tokens, "cpus": os.cpu_count(),
                    "load_average": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--data-dir", str(Path(tmp) / "data")]
        if args.in_flight:
            extra += ["--batch-max-in-flight", str(args.in_flight)]
        report["batch_max_in_flight"] = args.in_flight or max(1, args.clients // 2)
        options = ServerOptions(engine=args.engine, max_concurrent=args.clients, max_queue=max(256, args.clients),
                                kt_method=args.kt_method if args.engine == "ktransformers" else None,
                                extra_args=tuple(extra))
        with ServerProcess(options, Path(tmp) / "server.log") as server:
            measure(server.base_url, args, report)
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
