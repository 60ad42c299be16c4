"""Shared fixtures: the demo model, and real uvicorn servers on 127.0.0.1 around real engines.

Servers run in a background thread of the test process (real uvicorn, real sockets), so tests can talk
HTTP to them with the official `openai` client and still look at the engine's counters directly."""
from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SERVER_START_TIMEOUT = 300.0


@dataclass
class RunningServer:
    base_url: str
    app: Any
    engine: Any
    settings: Any
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        return self.base_url

    def openai(self, **kwargs: Any):
        import openai

        kwargs.setdefault("api_key", self.settings.api_key or "unused")
        kwargs.setdefault("timeout", 120.0)
        kwargs.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.base_url + "/v1", **kwargs)

    def async_openai(self, **kwargs: Any):
        import openai

        kwargs.setdefault("api_key", self.settings.api_key or "unused")
        kwargs.setdefault("timeout", 120.0)
        kwargs.setdefault("max_retries", 0)
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", **kwargs)

    def http(self, **kwargs: Any) -> httpx.Client:
        kwargs.setdefault("timeout", 120.0)
        return httpx.Client(base_url=self.base_url, **kwargs)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no request runs or waits (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.engine.stats()
            if s.running == 0 and s.waiting == 0:
                return
            time.sleep(0.05)
        raise AssertionError(f"engine still busy after {timeout}s: {self.engine.stats()}")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)


def start_server(model_path: str | Path, **overrides: Any) -> RunningServer:
    """Start engine + app + uvicorn on a free loopback port; return once /health says ok."""
    from server.settings import load_settings

    overrides.setdefault("engine", "huggingface")
    return serve_settings(load_settings(None, {"model": str(model_path), "host": "127.0.0.1", **overrides}, env={}))


def start_server_from_config(config_path: str | Path) -> RunningServer:
    """A server configured by a YAML file alone (as `ktserve serve FILE`), on a free loopback port."""
    from server.settings import load_settings

    return serve_settings(load_settings(str(config_path), {"host": "127.0.0.1"}, env={}))


def serve_settings(settings: Any) -> RunningServer:
    import uvicorn

    from engines.registry import create_engine
    from server.app import create_app
    from server.http_protocol import http_protocol

    engine = create_engine(settings.engine, settings.engine_config(settings.model))
    app = create_app(settings, engine)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", http=http_protocol(settings.read_timeout),
                            timeout_keep_alive=5, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    running = RunningServer(f"http://127.0.0.1:{port}", app, engine, settings, server, thread)
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while time.monotonic() < deadline:
        if app.state.load_error:
            running.stop()
            raise RuntimeError(f"engine failed to load: {app.state.load_error}")
        try:
            if httpx.get(running.base_url + "/health", timeout=2).status_code == 200:
                return running
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    running.stop()
    raise RuntimeError("server did not become healthy in time")


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    from engines.demo_model import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture(scope="session")
def v4_model_dir(tmp_path_factory) -> Path:
    """A tiny random DeepSeek-V4 in the released layout (engines/kt/families/deepseek_v4/demo_model.py)."""
    from engines.kt.families.deepseek_v4.demo_model import make_demo_model_v4

    return make_demo_model_v4(tmp_path_factory.mktemp("v4") / "tiny-v4")


@pytest.fixture(scope="session")
def v4_adapter_root(tmp_path_factory) -> Path:
    """Where the V4 server may load adapters from at run time (tests/engines/kt/families/deepseek_v4/test_v4_lora.py
    writes them there)."""
    return tmp_path_factory.mktemp("v4-adapters")


@pytest.fixture(scope="session")
def v4_server(v4_model_dir, v4_adapter_root) -> Iterator[RunningServer]:
    """The tiny V4 served by the ktransformers engine on the CPU (MXFP4 experts), thinking parsed, runtime
    adapter loading from `v4_adapter_root`."""
    from tests.helpers import require_kt_kernel

    require_kt_kernel()
    running = start_server(v4_model_dir, engine="ktransformers", cpu_infer=1, reasoning_parser="deepseek_r1",
                           adapter_roots=[str(v4_adapter_root)])
    yield running
    running.stop()


@pytest.fixture(scope="session")
def tokenizer(demo_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.fixture(scope="session")
def reference_model(demo_model_dir):
    """The demo model run directly through transformers, as the HF engine loads it on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()


# The HTTP test set runs against every engine. The KT engine uses BF16 experts here so that its greedy text
# equals transformers' (INT8 agreement is measured separately in test_kt_engine.py).
ENGINE_SETTINGS = {
    "huggingface": {"engine": "huggingface"},
    "ktransformers": {"engine": "ktransformers", "kt_method": "BF16"},
}


@pytest.fixture(scope="session", params=list(ENGINE_SETTINGS))
def server(request, demo_model_dir) -> Iterator[RunningServer]:
    """One shared server per engine, default settings; tests must leave it idle."""
    running = start_server(demo_model_dir, **ENGINE_SETTINGS[request.param])
    yield running
    running.stop()
