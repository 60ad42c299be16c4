"""What the hostile-input and fault probe of 2026-11-23 found, each sent again and answered as it should be
now (docs/reliability.md lists them). tests/server/test_hostile_input.py holds what already held."""
from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import threading

import httpx
import pytest

from .conftest import PROBE_KEY as KEY
from .conftest import PROBE_MAX_CONCURRENT as MAX_CONCURRENT
from .conftest import PROBE_MAX_QUEUE as MAX_QUEUE
from tests.helpers import assert_error
from tests.lora_helpers import adapter_variant

AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def post(server, path, body=None, *, content: bytes | None = None, headers=None) -> httpx.Response:
    with server.http(headers={**AUTH, **(headers or {})}) as http:
        if content is not None:
            return http.post(path, content=content, headers={"content-type": "application/json"})
        return http.post(path, json=body)


# ------------------------------------------------------------------------------------ lone surrogates
SURROGATE_BODIES = {
    "chat": (CHAT, '{"messages":[{"role":"user","content":"\\ud800"}],"max_tokens":8}', "messages[0].content"),
    "completions": (COMPLETIONS, '{"prompt":"a\\udfff","max_tokens":2}', "prompt"),
    "completions-list": (COMPLETIONS, '{"prompt":["ok","a\\udfff"],"max_tokens":2}', "prompt[1]"),
    "score": ("/v1/score/evaluation", '{"messages":["fine","\\ud800x"]}', "messages[1]"),
    "responses": ("/v1/responses", '{"input":[{"role":"user","content":"\\ud800"}]}', "input[0].content"),
    "embeddings": ("/v1/embeddings", '{"input":["a","\\udbff"]}', "input[1]"),
    "tokenize": ("/tokenize", '{"prompt":"\\udfff"}', "prompt"),
    "tools": (CHAT, '{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":'
                    '{"name":"f","description":"\\udc00"}}]}', "tools[0].function.description"),
}


@pytest.mark.parametrize("case", list(SURROGATE_BODIES))
def test_a_lone_surrogate_is_400_naming_the_field(probe, case):
    path, body, param = SURROGATE_BODIES[case]
    error = assert_error(post(probe, path, content=body.encode()), 400, param)
    assert "surrogate" in error["message"]


@pytest.mark.parametrize("path,body,field", [
    ("/api/chat", '{"model":"demo","messages":[{"role":"user","content":"\\ud800"}]}', "messages[0].content"),
    ("/api/generate", '{"model":"demo","prompt":"a\\udfff"}', "prompt"),
], ids=["chat", "generate"])
def test_a_lone_surrogate_on_the_ollama_routes_is_400_naming_the_field(probe, path, body, field):
    r = post(probe, path, content=body.encode())
    assert r.status_code == 400
    assert field in r.json()["error"] and "surrogate" in r.json()["error"]


# ------------------------------------------------------------------------------------ bodies
@pytest.mark.parametrize("path", ["/api/chat", "/api/generate", "/api/show"])
def test_json_nested_100k_deep_on_the_ollama_routes_is_400(probe, path):
    r = post(probe, path, content=b'{"model": "x", "options": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert r.status_code == 400
    assert "nested too deeply" in r.json()["error"]


@pytest.mark.parametrize("path,param", [(CHAT, "messages"), (COMPLETIONS, "prompt"),
                                        ("/v1/load_lora_adapter", "lora_name")])
def test_an_empty_body_names_the_first_required_field(probe, path, param):
    error = assert_error(post(probe, path, content=b""), 400, param)
    assert f"'{param}' is required" in error["message"]


# ------------------------------------------------------------------------------------ adapters
def load(server, name: str, path) -> httpx.Response:
    return post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def served(server) -> set[str]:
    with server.http(headers=AUTH) as http:
        return {m["id"] for m in http.get("/v1/models").json()["data"]}


def test_a_lora_path_with_a_component_over_255_characters_is_400(probe, adapter_root):
    assert_error(load(probe, "long", adapter_root / ("x" * 300) / "adapter"), 400, "lora_path")


def _config(d, value) -> None:
    (d / "adapter_config.json").write_text(json.dumps(value))


def _alpha_abc(d) -> None:
    config = json.loads((d / "adapter_config.json").read_text())
    _config(d, {**config, "lora_alpha": "abc"})


def _corrupt_bin(d) -> None:
    (d / "adapter_model.safetensors").unlink()
    (d / "adapter_model.bin").write_bytes(b"PK\x03\x04 not a torch archive")


def _corrupt_value_head(d) -> None:
    (d / "value_head.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")


BROKEN = {
    "config-is-a-list": lambda d: _config(d, ["r", 8]),
    "lora-alpha-abc": _alpha_abc,
    "corrupt-safetensors": lambda d: (d / "adapter_model.safetensors").write_bytes(b"\xff" * 64),
    "corrupt-bin": _corrupt_bin,
    "corrupt-value-head": _corrupt_value_head,
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_adapter_file_is_400_and_its_name_stays_free(probe, adapter_root, case):
    path = adapter_variant(adapter_root, case, BROKEN[case])
    error = assert_error(load(probe, case, path), 400, "lora_path")
    assert path in error["message"] or case in error["message"]
    assert case not in served(probe)
    assert_error(load(probe, case, path), 400, "lora_path")  # not "already loaded": the name was released


def test_a_fifo_given_as_lora_path_is_400_at_once(probe, adapter_root):
    fifo = adapter_root / "a-fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    assert_error(load(probe, "fifo", fifo), 400, "lora_path")


def test_a_fifo_named_like_a_gguf_file_never_blocks_the_load_and_the_name_stays_free(probe, adapter_root):
    directory = adapter_root / "fifo-gguf"
    directory.mkdir(exist_ok=True)
    if not (directory / "x.gguf").exists():
        os.mkfifo(directory / "x.gguf")
    error = assert_error(load(probe, "fifo-gguf", directory), 400, "lora_path")
    assert "not a regular file" in error["message"]
    r = load(probe, "fifo-gguf", adapter_root / "good")
    assert r.status_code == 200, r.text
    assert "fifo-gguf" in served(probe)
    assert post(probe, "/v1/unload_lora_adapter", {"lora_name": "fifo-gguf"}).status_code == 200


# ------------------------------------------------------------------------------------ unexpected errors
def test_an_unexpected_exception_is_one_openai_500_with_the_request_id_logged_once(probe, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug in a route")

    monkeypatch.setattr(probe.app.state.completions, "create", broken)
    caplog.set_level(logging.ERROR)
    with probe.http(headers=AUTH) as http:
        r = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "probe-500"})
        assert_error(r, 500)
        assert r.json()["error"]["type"] == "internal_error"
        assert r.headers["x-request-id"] == "probe-500"
        assert r.headers["connection"] == "close"
        monkeypatch.undo()
        # the same client goes on: the server closed the connection cleanly, so the client opens a new one
        assert http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    tracebacks = [rec for rec in caplog.records if rec.exc_info is not None]
    assert len(tracebacks) == 1 and "probe-500" in tracebacks[0].getMessage()


# ------------------------------------------------------------------------------------ smaller findings
def test_n_more_than_the_server_ever_holds_is_400_not_429(probe):
    error = assert_error(post(probe, CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                            "n": MAX_CONCURRENT + MAX_QUEUE + 4}), 400, "n")
    assert "at most 6" in error["message"]


def test_n_that_fits_the_server_is_served(probe):
    r = post(probe, CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "n": MAX_QUEUE})
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_QUEUE


def test_a_trailing_slash_redirect_is_relative_whatever_the_host_header(probe):
    with probe.http(headers=AUTH, follow_redirects=False) as http:
        r = http.post("/v1/completions/", json={"prompt": "hi"}, headers={"Host": "evil.example"})
    assert r.status_code == 307
    assert r.headers["location"] == "/v1/completions"


def test_the_redirect_keeps_the_query_and_is_followed_by_clients(probe):
    with probe.http(headers=AUTH, follow_redirects=True) as http:
        r = http.get("/version/?x=1")
    assert r.status_code == 200 and r.json()["version"]


@pytest.mark.parametrize("method,path", [("GET", "/nowhere"), ("POST", "/v2/chat"), ("GET", "/version/"),
                                         ("DELETE", CHAT)])
def test_an_unknown_route_is_401_before_404_when_a_key_is_set(probe, method, path):
    with probe.http(follow_redirects=False) as http:
        r = http.request(method, path)
    assert_error(r, 401)


def test_an_unknown_route_with_the_key_is_404(probe):
    with probe.http(headers=AUTH) as http:
        assert_error(http.get("/nowhere"), 404)


def test_health_while_draining_is_503_and_closes_the_connection():
    from tests.ops_support import HeldLoadEngine, ThreadedServer
    from server.app import create_app
    from server.settings import load_settings

    app = create_app(load_settings(None, {"model": "held"}, env={}), HeldLoadEngine())
    server = ThreadedServer(app)
    try:
        app.state.drain.begin()
        r = httpx.get(server.base_url + "/health", timeout=10)
    finally:
        server.stop()
    assert r.status_code == 503 and r.headers["connection"] == "close"


# ------------------------------------------------------------------------------------ the event loop
LARGE = "hello " * 4000  # over the off-loop threshold (16 384 characters)


@pytest.fixture
def tokenizer_calls(probe, monkeypatch):
    """For each tokenizer call the server makes: whether it ran on the event loop's thread."""
    calls: list[tuple[str, bool]] = []
    tokenizer = probe.engine.tokenizer

    def watched(name):
        original = getattr(tokenizer, name)

        def call(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                on_loop = True
            except RuntimeError:
                on_loop = False
            text = args[0] if args and isinstance(args[0], str) else ""
            if len(text) >= len(LARGE) or name == "apply_chat_template":
                calls.append((name, on_loop))
            return original(*args, **kwargs)
        return call

    for name in ("encode", "apply_chat_template"):
        monkeypatch.setattr(tokenizer, name, watched(name))
    return calls


@pytest.mark.parametrize("path,body", [
    (CHAT, {"messages": [{"role": "user", "content": LARGE}], "max_tokens": 1}),
    (COMPLETIONS, {"prompt": LARGE, "max_tokens": 1}),
    ("/api/chat", {"messages": [{"role": "user", "content": LARGE}], "stream": False}),
    ("/api/generate", {"prompt": LARGE, "raw": True, "stream": False}),
    ("/v1/score/evaluation", {"messages": [LARGE]}),
], ids=["chat", "completions", "ollama-chat", "ollama-generate-raw", "score"])
def test_a_large_prompt_is_templated_and_tokenized_off_the_event_loop(probe, tokenizer_calls, path, body):
    if path.startswith("/api/"):
        body = {**body, "model": probe.engine.info.id}
    post(probe, path, body)  # the answer (a context-length 400 here) does not matter; where the work ran does
    assert tokenizer_calls, "the server never tokenized the prompt"
    assert [c for c in tokenizer_calls if c[1]] == []


def test_native_stdout_is_captured_at_the_descriptor_and_logged_at_debug(capfd, caplog):
    from server.native_output import stdout_to_log

    caplog.set_level(logging.DEBUG, logger="ktserve.native")
    libc = ctypes.CDLL(None)
    with stdout_to_log():
        libc.printf(b"CPUInfer[0x1]: Hello from C\n")
        libc.fflush(None)
        os.write(1, b"TP MOE layer 1, pool 0\n")
    print("after the capture", flush=True)
    out = capfd.readouterr().out
    assert "Hello from C" not in out and "TP MOE" not in out and "after the capture" in out
    lines = [r.getMessage() for r in caplog.records if r.name == "ktserve.native"]
    assert "CPUInfer[0x1]: Hello from C" in lines and "TP MOE layer 1, pool 0" in lines
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "ktserve.native")


def test_what_native_code_prints_while_the_engine_loads_goes_to_the_log(capfd, caplog):
    """The app wraps the engine's start: kt-kernel's C++ lines ("CPUInfer[...]: Hello") land in the log."""
    from tests.ops_support import HeldLoadEngine, ThreadedServer, wait_for
    from server.app import create_app
    from server.settings import load_settings

    class PrintingEngine(HeldLoadEngine):
        def start(self) -> None:
            libc = ctypes.CDLL(None)
            libc.printf(b"CPUInfer[0x2]: Hello\n")
            libc.fflush(None)
            self.loaded.set()
            super().start()

    caplog.set_level(logging.DEBUG, logger="ktserve.native")
    app = create_app(load_settings(None, {"model": "held"}, env={}), PrintingEngine())
    server = ThreadedServer(app)
    try:
        wait_for(lambda: httpx.get(server.base_url + "/health", timeout=5).status_code == 200, 30, "the load")
    finally:
        server.stop()
    assert "CPUInfer[0x2]: Hello" in [r.getMessage() for r in caplog.records if r.name == "ktserve.native"]
    assert "CPUInfer" not in capfd.readouterr().out


def test_a_request_still_running_when_the_drain_ends_gets_an_openai_503(caplog):
    """What uvicorn cancels once the drain is over (here a route that never answers) is answered in our shape,
    with no traceback, never uvicorn's plain-text 500."""
    import signal

    from tests.ops_support import HeldLoadEngine, ThreadedServer, wait_for
    from server.app import create_app
    from server.settings import load_settings
    from server.shutdown import DrainingServer

    app = create_app(load_settings(None, {"model": "held", "graceful_timeout": 0.2}, env={}), HeldLoadEngine())

    async def never_answers():
        await asyncio.Event().wait()

    app.add_api_route("/never", never_answers)
    server = ThreadedServer(app, make_server=lambda config: DrainingServer(config, app.state.drain))
    answers: list[httpx.Response] = []
    client = threading.Thread(target=lambda: answers.append(httpx.get(server.base_url + "/never", timeout=60)))
    client.start()
    try:
        wait_for(lambda: app.state.drain.in_flight, 10, "the request to arrive")
        server.server.handle_exit(signal.SIGTERM, None)
        client.join(timeout=60)
    finally:
        server.stop()
    [r] = answers
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown"
    assert r.headers["connection"] == "close" and r.headers["x-request-id"]
    assert not [rec for rec in caplog.records if rec.exc_info is not None]


def test_after_every_probe_above_the_server_still_answers_an_ordinary_request(probe):
    # runs last in this module (pytest keeps file order), on the server every probe above hit
    with probe.http(headers=AUTH) as http:
        assert http.get("/health").json()["status"] == "ok"
        reply = http.post(CHAT, json={"model": probe.engine.info.id, "max_tokens": 4,
                                      "messages": [{"role": "user", "content": "Hello"}]})
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] is not None
