"""Serve an already started engine over HTTP (the real app, real uvicorn on 127.0.0.1) and load it with
streaming clients in a separate process, so the clients' own Python work does not share the server's GIL.
The engine stays loaded from the decode phase; the server adds only its own overhead."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

from engines.base import Engine
from bench.lib.shapes import Plan


@contextlib.contextmanager
def serving(engine: Engine, model_path: str, timeout: float = 60.0) -> Iterator[str]:
    """The app around `engine` (which it neither starts nor stops) on a free loopback port; yields the URL."""
    import httpx
    import uvicorn

    from server.app import create_app
    from server.settings import load_settings

    settings = load_settings(None, {"model": model_path, "engine": engine.name, "host": "127.0.0.1",
                                    "max_concurrent": engine.config.max_concurrent}, env={})
    app = create_app(settings, engine, load_engine=False)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=30,
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="bench-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the benchmark server did not become healthy")
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def _any_core(pid: int) -> None:
    """The clients stand for other machines: they run on any core, not on the cores the engine kept for the
    server's threads (kt_isolate_workers), which a process started from one of those threads inherits. Set
    right after the start, before the client has started threads of its own (they would keep the old cores)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(pid, range(os.cpu_count() or 1))


def run_clients(url: str, model: str, plan: Plan, vocab: int, time_left: float, temperature: float = 0.0,
                top_p: float = 1.0, max_tokens: int | None = None) -> dict:
    """Every concurrency level of the plan, one round each, in a client subprocess; its JSON result. The
    clients ask for greedy tokens unless given a temperature (and top_p). With `max_tokens` above the plan's
    tokens, each asks for `max_tokens` but closes its stream after the plan's tokens."""
    cmd = [sys.executable, "-m", "bench.lib.http_client", "--base-url", url, "--model", model,
           "--temperature", str(temperature), "--top-p", str(top_p),
           "--levels", ",".join(map(str, plan.http_levels)), "--prompt-tokens", str(plan.http_prompt),
           "--max-tokens", str(max_tokens or plan.http_tokens), "--vocab", str(vocab),
           "--read-tokens", str(plan.http_tokens if max_tokens else 0),
           "--round-timeout", str(plan.http_round_timeout), "--time-left", f"{time_left:.1f}"]
    repo = Path(__file__).resolve().parents[2]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=repo) as client:
        _any_core(client.pid)
        try:
            out, _ = client.communicate(timeout=time_left + 30)
        except subprocess.TimeoutExpired:
            client.kill()
            raise
    if client.returncode != 0:
        raise RuntimeError(f"the HTTP client exited with {client.returncode}")
    return json.loads(out.strip().splitlines()[-1])
