"""Run load scenarios against a fresh `ktserve serve` on the demo model and print one JSON report each.

    python -m tests.load.run --scenario all --clients 64 --duration 180 --engine ktransformers --kt-method BF16

Exit status 1 if any scenario broke its expectations (see tests/load/scenarios.py)."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.load.scenarios import SCENARIOS, prepare, run_scenario, server_options
from tests.load.server import REPO, ServerProcess


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.load.run", description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default="all", choices=["all", *SCENARIOS])
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (overload: see --overload-factor)")
    p.add_argument("--overload-factor", type=int, default=4,
                   help="overload runs max(clients, factor x (max_concurrent + max_queue)) clients")
    p.add_argument("--duration", type=float, default=180.0, help="seconds of measured load per scenario")
    p.add_argument("--warmup", type=float, default=None, help="seconds of unmeasured load first "
                   "(default: a sixth of the duration, at most 30)")
    p.add_argument("--max-requests", type=int, default=1_000_000, help="request budget per scenario")
    p.add_argument("--engine", default="huggingface", choices=["huggingface", "ktransformers"])
    p.add_argument("--kt-method", default="BF16", help="ktransformers expert weights: BF16 | AMXINT8 | AMXINT4")
    p.add_argument("--max-concurrent", type=int, help="override the scenario's server setting")
    p.add_argument("--max-queue", type=int, help="override the scenario's server setting")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a client waits for one answer, queueing included, before counting it failed")
    p.add_argument("--pool", type=int, default=32, help="distinct request specs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, help="also write the reports (a JSON list) here")
    return p.parse_args(argv)


async def _run(server: ServerProcess, scenario, args: argparse.Namespace, clients: int, warmup: float) -> dict:
    workload = await prepare(server, pool=args.pool, seed=args.seed)
    return await run_scenario(server, scenario, workload, clients=clients, duration=args.duration, warmup=warmup,
                              max_requests=args.max_requests, seed=args.seed,
                              request_timeout=args.request_timeout)


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=REPO, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=REPO, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+uncommitted" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    warmup = args.warmup if args.warmup is not None else min(30.0, args.duration / 6)
    reports = []
    log_dir = Path(tempfile.mkdtemp(prefix="ktserve-load-"))
    for name in names:
        scenario = SCENARIOS[name]
        options = server_options(scenario, args.engine, args.kt_method, max_concurrent=args.max_concurrent,
                                 max_queue=args.max_queue)
        clients = args.clients
        if scenario.overload:
            clients = max(clients, args.overload_factor * (options.max_concurrent + options.max_queue))
        with ServerProcess(options, log_dir / f"{name}.log") as server:
            report = asyncio.run(_run(server, scenario, args, clients, warmup))
        report["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        report["host"] = {"cpus": os.cpu_count(), "load_average_1m_after": round(os.getloadavg()[0], 2),
                          "commit": _commit()}
        report["server_log"] = str(log_dir / f"{name}.log")
        reports.append(report)
        print(json.dumps(report, indent=2, ensure_ascii=False), flush=True)
    if args.output:
        args.output.write_text(json.dumps(reports, indent=2, ensure_ascii=False))
    return 0 if all(r["passed"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
