"""The server under load: `ktserve serve` in its own process on a loopback port, so the RSS measured is
the server's alone and the load generator does not share its interpreter. Engine state is read from the
server's /metrics, as an operator would."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 300.0
STOP_TIMEOUT = 60.0


@dataclass(frozen=True)
class ServerOptions:
    engine: str = "huggingface"
    kt_method: str | None = None  # ktransformers engine: BF16 | AMXINT8 | AMXINT4 (None: the rules' choice)
    max_concurrent: int = 16
    max_queue: int = 256
    extra_args: tuple[str, ...] = field(default=())

    log_level: str = "warning"

    def argv(self, port: int) -> list[str]:
        args = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--engine", self.engine, "--max-concurrent", str(self.max_concurrent),
                "--max-queue", str(self.max_queue), "--log-level", self.log_level, *self.extra_args]
        if self.kt_method:
            args += ["--kt-method", self.kt_method]
        return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Start with `with ServerProcess(options, log_path) as server:`; stopped (SIGTERM, then kill) on exit."""

    def __init__(self, options: ServerOptions, log_path: Path, env: dict[str, str] | None = None):
        self.options = options
        self.log_path = log_path
        self.extra_env = env or {}
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self._log = None

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        # the repository first, then whatever the caller's path holds (a device machine's packages live there)
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONPATH=path, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
                   **self.extra_env)
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.options.argv(self.port), cwd=REPO, env=env, stdout=self._log,
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server was not healthy within {START_TIMEOUT:.0f}s; see {self.log_path}")

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STOP_TIMEOUT)
        if self._log is not None:
            self._log.close()
        return self.process.returncode

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def log_errors(self, since: int = 0) -> list[str]:
        """Lines the server logged at ERROR level (or tracebacks) after byte offset `since`."""
        with open(self.log_path, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        return [line for line in text.splitlines() if " ERROR " in line or line.startswith("Traceback")]

    def rss_bytes(self) -> int:
        """Resident set size of the server process, from /proc (Linux)."""
        assert self.process is not None
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc status")


ENGINE_GAUGES = {"ktserve_requests_running": "running", "ktserve_requests_waiting": "waiting",
                 "ktserve_kv_cache_used_tokens": "kv_used_tokens", "ktserve_kv_cache_total_tokens": "kv_total_tokens"}


def parse_engine_state(metrics_text: str) -> dict[str, int]:
    state = {}
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name in ENGINE_GAUGES:
            state[ENGINE_GAUGES[name]] = int(float(value))
    return state
