"""What the operations tests share: an engine that loads only when told to, servers in a thread or in a
child process, and readers for /metrics and SSE streams. Every wait here is bounded."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from engines.base import Engine, EngineConfig, EngineStats, EngineUnavailableError, ModelInfo

REPO = Path(__file__).resolve().parents[1]


def child_pythonpath() -> str:
    """PYTHONPATH for a child Python: the repository first, then whatever this process was given."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"gave up after {timeout}s waiting for {what}")


class HeldLoadEngine(Engine):
    """An engine with no model whose start() returns only once the test sets `loaded`."""

    name = "held-load"

    def __init__(self) -> None:
        super().__init__(EngineConfig(model_path="held-load"))
        self.loaded = threading.Event()
        self._ready = False

    def start(self) -> None:
        if not self.loaded.wait(timeout=60):
            raise RuntimeError("the test never let the engine finish loading")
        self._ready = True

    def stop(self) -> None:
        self.loaded.set()
        self._ready = False

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(id="held-load-model", max_model_len=64, architecture="None", engine=self.name, created=0)

    @property
    def tokenizer(self) -> Any:
        return None

    def submit(self, request):
        raise EngineUnavailableError("this engine generates nothing")

    def stats(self) -> EngineStats:
        return EngineStats()


class ThreadedServer:
    """An app served by uvicorn (or a subclass, e.g. the draining one) in a thread on a free loopback port."""

    def __init__(self, app: Any, make_server: Callable[[uvicorn.Config], uvicorn.Server] = uvicorn.Server):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.app = app
        config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=5, timeout_graceful_shutdown=5)
        self.server = make_server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, 30, "uvicorn to start")

    def http(self, **kwargs: Any) -> httpx.Client:
        kwargs.setdefault("timeout", 60.0)
        return httpx.Client(base_url=self.base_url, **kwargs)

    def wait_healthy(self, timeout: float = 300.0) -> None:
        def healthy() -> bool:
            if self.app.state.load_error:
                raise RuntimeError(f"engine failed to load: {self.app.state.load_error}")
            return httpx.get(self.base_url + "/health", timeout=5).status_code == 200
        wait_for(healthy, timeout, "/health to answer 200")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`ktserve serve` in a child process, its stderr collected line by line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": child_pythonpath(), "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_healthy(self, timeout: float = 300.0) -> None:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError("the server exited early:\n" + "\n".join(self.lines[-20:]))
            try:
                return httpx.get(self.url + "/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False
        wait_for(healthy, timeout, "the server process to become healthy")

    def wait(self, timeout: float) -> int:
        returncode = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text page, keyed by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def sse_data(lines) -> list[str]:
    """The `data:` payloads of an SSE stream, in order."""
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]
