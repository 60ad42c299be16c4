"""Hostile and broken input: every route fuzzed from the server's own OpenAPI schema, then the inputs an
attacker or a broken client actually sends — oversized, deeply nested, undecodable and absurd bodies,
path-like model and adapter names, and clients too slow to ever finish a request. Each gets the right 4xx
(or a bounded, clean outcome), and the server keeps serving. tests/server/test_api_errors.py has the ordinary
validation errors; nothing here repeats them."""
from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode

from tests.conftest import start_server
from tests.helpers import assert_error

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BODY_LIMIT = 2 * 1024 * 1024
READ_TIMEOUT = 2.0
CONTEXT = 64  # a small context keeps every generation the fuzzer asks for short
SLOW_CLIENT_GIVE_UP = 60.0  # seconds a test waits for the server to drop a slow client before failing


@pytest.fixture(scope="module")
def hostile(demo_model_dir, tmp_path_factory):
    roots = tmp_path_factory.mktemp("adapter-roots")
    running = start_server(demo_model_dir, max_body_bytes=BODY_LIMIT, read_timeout=READ_TIMEOUT,
                           max_model_len=CONTEXT, request_timeout=10, adapter_roots=[str(roots)])
    running.adapter_root = roots
    yield running
    running.stop()


def post(server, path, **kwargs) -> httpx.Response:
    with server.http(timeout=120) as http:
        return http.post(path, **kwargs)


def post_raw(server, path, body: bytes) -> httpx.Response:
    return post(server, path, content=body, headers={"content-type": "application/json"})


def assert_still_serving(server) -> None:
    assert post(server, CHAT, json=GOOD).status_code == 200


# ------------------------------------------------------------------------------------ schema fuzzing
FUZZ_EXAMPLES = 40


@pytest.fixture(scope="module")
def api_schema(hostile):
    return schemathesis.openapi.from_url(hostile.base_url + "/openapi.json")


def openai_error_json(ctx, response, case) -> None:
    """Every 4xx of the OpenAI routes is OpenAI error JSON (Ollama's /api routes use Ollama's shape)."""
    if response.status_code < 400 or case.path.startswith("/api/"):
        return None
    error = json.loads(response.content)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return None


def fuzz(operation, mode: GenerationMode) -> None:
    # Not schemathesis' pytest plugin (`from_fixture` breaks on pytest 9): one hypothesis run per route.
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def one_request(case):
        response = case.call(timeout=60)
        case.validate_response(response, checks=[not_a_server_error, openai_error_json])

    one_request()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_route_answers_a_fuzzed_request_with_a_server_error(api_schema, hostile, mode):
    failures, routes = {}, 0
    for result in api_schema.get_all_operations():
        operation = result.ok()
        routes += 1
        try:
            fuzz(operation, mode)
        except Unsatisfiable:  # nothing to get wrong: a route without parameters or body, in negative mode
            continue
        except Exception as exc:  # collected so that one route's failure does not hide another's
            failures[operation.label] = f"{type(exc).__name__}: {exc}"
    assert routes >= 5
    assert failures == {}
    assert_still_serving(hostile)


# ------------------------------------------------------------------------------------ body size
def test_a_body_over_the_limit_is_413_by_its_content_length(hostile):
    error = assert_error(post_raw(hostile, CHAT, b" " * (BODY_LIMIT + 1)), 413)
    assert error["code"] == "request_too_large"
    assert_still_serving(hostile)


def test_a_chunked_body_over_the_limit_is_413_while_it_streams_in(hostile):
    def chunks():
        for _ in range(BODY_LIMIT // 65536 + 2):
            yield b"[" * 65536

    error = assert_error(post(hostile, CHAT, content=chunks(), headers={"content-type": "application/json"}), 413)
    assert error["code"] == "request_too_large"
    assert_still_serving(hostile)


# ------------------------------------------------------------------------------------ undecodable bodies
@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000,
                                  b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                  b'{"prompt": "x", "logit_bias": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_001],
                         ids=["array", "inside-a-field", "objects"])
def test_json_nested_100k_levels_deep_is_400_not_a_recursion_crash(hostile, body):
    error = assert_error(post_raw(hostile, CHAT, body), 400)
    assert "nested too deeply" in error["message"]
    assert_still_serving(hostile)


def test_json_nested_just_within_the_parser_limit_in_a_free_form_field_is_answered_cleanly(hostile):
    deep = "[" * 900 + "]" * 900
    for field in ("chat_template_kwargs", "response_format", "tools"):
        body = f'{{"messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 1, "{field}": {{"x": {deep}}}}}'
        assert post_raw(hostile, CHAT, body.encode()).status_code < 500, field
    assert_still_serving(hostile)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_invalid_utf8_in_the_body_is_400(hostile, path):
    body = b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3"}], "prompt": "\xc3\x28"}'
    error = assert_error(post_raw(hostile, path, body), 400)
    assert "UTF-8" in error["message"]


def test_an_integer_of_thousands_of_digits_is_400(hostile):
    assert_error(post_raw(hostile, COMPLETIONS, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"), 400)


@pytest.mark.parametrize("body", [b"null", b"[]", b'"text"', b"12", b"true", b""])
def test_a_body_that_is_not_an_object_is_400(hostile, body):
    assert_error(post_raw(hostile, CHAT, body), 400)


# ------------------------------------------------------------------------------------ huge but well-formed
@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, {"prompt": list(range(5, 200_005)), "max_tokens": 1}, "prompt"),
    (COMPLETIONS, {"prompt": ["x"] * 100_000}, "prompt"),
    (CHAT, {**GOOD, "logit_bias": {str(i): 1 for i in range(50_000)}}, "logit_bias"),
    (CHAT, {**GOOD, "stop_token_ids": list(range(50_000))}, "stop_token_ids"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}] * 20_000, "max_tokens": 1}, "messages"),
], ids=["200k-token-ids", "100k-prompts", "50k-logit-bias", "50k-stop-token-ids", "20k-messages"])
def test_huge_well_formed_json_is_400_naming_the_field(hostile, path, body, param):
    assert_error(post(hostile, path, json=body), 400, param)
    assert_still_serving(hostile)


@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, {"prompt": "hello " * 170_000, "max_tokens": 1}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 170_000}], "max_tokens": 1}, "messages"),
], ids=["completions", "chat"])
def test_a_prompt_of_a_million_characters_is_a_clean_400_context_length(hostile, path, body, param):
    error = assert_error(post(hostile, path, json=body), 400, param)
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    assert_still_serving(hostile)


# ------------------------------------------------------------------------------------ absurd values
@pytest.mark.parametrize("path,extra,param", [
    (CHAT, {"max_tokens": 10**9}, "max_tokens"),
    (COMPLETIONS, {"max_tokens": 10**9}, "max_tokens"),
    (CHAT, {"max_completion_tokens": 10**30}, "max_tokens"),
    (CHAT, {"n": 10**6}, "n"),
    (COMPLETIONS, {"n": 10**6}, "n"),
    (COMPLETIONS, {"logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"logprobs": -1}, "logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (CHAT, {"top_logprobs": 3}, None),  # without logprobs: true
    (CHAT, {"repetition_penalty": 0}, "repetition_penalty"),
    (CHAT, {"repetition_penalty": -1}, "repetition_penalty"),
    (CHAT, {"min_p": -0.1}, "min_p"),
    (CHAT, {"top_k": -2}, "top_k"),
    (CHAT, {"min_tokens": -1}, "min_tokens"),
    (CHAT, {"min_tokens": 10**12}, "min_tokens"),
    (CHAT, {"seed": -(2**64)}, "seed"),
    (CHAT, {"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    (COMPLETIONS, {"stop": ["x" * 5000]}, "stop"),
    (COMPLETIONS, {"stop": ["x"] * 5000}, "stop"),
    (CHAT, {"logit_bias": {"-5": 1}}, "logit_bias"),
], ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else str(v))
def test_out_of_range_values_are_400(hostile, path, extra, param):
    base = GOOD if path == CHAT else {"prompt": "hi", "max_tokens": 2}
    assert_error(post(hostile, path, json={**base, **extra}), 400, param)


@pytest.mark.parametrize("field", ["top_p", "frequency_penalty", "repetition_penalty", "min_p", "presence_penalty"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_sampling_values_are_400(hostile, field, value):
    body = f'{{"messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 2, "{field}": {value}}}'
    assert_error(post_raw(hostile, CHAT, body.encode()), 400, field)


def test_a_non_finite_logit_bias_is_400(hostile):
    assert_error(post_raw(hostile, COMPLETIONS, b'{"prompt": "hi", "logit_bias": {"5": NaN}}'), 400, "logit_bias[5]")


@pytest.mark.parametrize("messages", [
    [{"content": "no role"}],
    [{"role": "user", "content": {"text": "a dict"}}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": "hi", "name": 5}],
    [{"role": "tool"}],
    [None],
    ["just a string"],
    {"role": "user", "content": "an object, not a list"},
    [{"role": ["user"], "content": "hi"}],
], ids=lambda m: json.dumps(m)[:50])
def test_messages_of_the_wrong_shape_are_400(hostile, messages):
    error = assert_error(post(hostile, CHAT, json={"messages": messages, "max_tokens": 2}), 400)
    assert (error["param"] or "").startswith("messages"), error


# ------------------------------------------------------------------------------------ names that look like paths
class FileAccess:
    """Records every file the process opens, lists or stats whose path mentions one of `needles`."""

    def __init__(self):
        self.needles: tuple[str, ...] = ()
        self.seen: list[tuple[str, str]] = []
        sys.addaudithook(self._audit)  # hooks cannot be removed; this one is idle outside `watching`

    def _audit(self, event: str, args: tuple) -> None:
        if self.needles and event in ("open", "os.listdir", "os.scandir") and args:
            self._note(event, args[0])

    def _note(self, what: str, path) -> None:
        if isinstance(path, (str, bytes, os.PathLike)):
            text = os.fsdecode(path)
            if any(n in text for n in self.needles):
                self.seen.append((what, text))

    @contextmanager
    def watching(self, monkeypatch, *needles: str):
        for name in ("stat", "lstat"):
            real = getattr(os, name)

            def spy(path, *args, _real=real, _name=name, **kwargs):
                if self.needles:
                    self._note(f"os.{_name}", path)
                return _real(path, *args, **kwargs)
            monkeypatch.setattr(os, name, spy)
        self.needles, self.seen = needles, []
        try:
            yield self.seen
        finally:
            self.needles = ()


@pytest.fixture(scope="module")
def file_access():
    return FileAccess()


@pytest.mark.parametrize("name", ["/etc/passwd", "../ktserve-probe", "../../../../etc/shadow", "~/.ssh/id_rsa",
                                  "file:///etc/passwd", "C:\\Windows\\win.ini", "ktserve-probe\x00.bin",
                                  "./ktserve-probe", "ktserve-probe" * 1000])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_model_name_that_looks_like_a_path_is_404_and_no_file_is_touched(hostile, file_access, monkeypatch,
                                                                          path, name):
    body = {**GOOD, "model": name} if path == CHAT else {"prompt": "hi", "max_tokens": 2, "model": name}
    needle = name.split("/")[-1].split("\\")[-1].split("\x00")[0][:40] or name
    with file_access.watching(monkeypatch, needle) as seen:
        error = assert_error(post(hostile, path, json=body), 404, "model")
    assert error["code"] == "model_not_found"
    assert seen == []


def test_a_model_name_naming_a_fifo_is_answered_without_opening_it(hostile, tmp_path):
    """Opening a FIFO with no writer blocks forever: a server that tried would never answer."""
    fifo = tmp_path / "model-fifo"
    os.mkfifo(fifo)
    assert_error(post(hostile, COMPLETIONS, json={"prompt": "hi", "max_tokens": 1, "model": str(fifo)}), 404, "model")


def _outside_paths(root: Path) -> dict[str, str]:
    outside = root.parent / (root.name + "-outside")
    (outside / "adapter").mkdir(parents=True, exist_ok=True)
    (outside / "adapter" / "adapter_config.json").write_text("{}")
    sibling = root.parent / (root.name + "-evil") / "adapter"
    sibling.mkdir(parents=True, exist_ok=True)
    link = root / "link-out"
    if not link.is_symlink():
        link.symlink_to(outside / "adapter")
    return {"absolute": "/etc/passwd", "relative": "../../../../etc/passwd",
            "dot-dot": f"{root}/../{outside.name}/adapter", "sibling-prefix": str(sibling),
            "symlink": str(link), "home": "~/.ssh"}


@pytest.mark.parametrize("case", ["absolute", "relative", "dot-dot", "sibling-prefix", "symlink", "home"])
def test_an_adapter_path_outside_the_roots_is_403_and_nothing_is_loaded(hostile, file_access, monkeypatch, case):
    lora_path = _outside_paths(hostile.adapter_root)[case]
    with hostile.http() as http:
        before = http.get("/v1/models").json()
        with file_access.watching(monkeypatch, "-outside", "-evil", "passwd", ".ssh") as seen:
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "probe", "lora_path": lora_path})
        error = assert_error(r, 403, "lora_path")
        assert error["type"] == "permission_error"
        assert http.get("/v1/models").json() == before
    # resolving the path (realpath's lstat calls) is allowed; reading anything there is not
    assert [s for s in seen if not s[0].startswith("os.")] == []


def test_an_adapter_path_with_a_nul_byte_is_400(hostile):
    r = post(hostile, "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": f"{hostile.adapter_root}/a\x00b"})
    assert_error(r, 400, "lora_path")


@pytest.mark.parametrize("name", ["../../etc", "/etc/passwd", "x\x00y"])
def test_unloading_an_adapter_by_a_path_like_name_is_404(hostile, name):
    assert_error(post(hostile, "/v1/unload_lora_adapter", json={"lora_name": name}), 404)


# ------------------------------------------------------------------------------------ slow clients
def _port(server) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", _port(server)), timeout=10)
    sock.setblocking(False)
    return sock


def _closed_by_server(sock: socket.socket, trickle: bytes = b"", interval: float = 0.2) -> bytes | None:
    """Send `trickle` a byte per `interval` (then nothing) until the server answers or closes; return what it
    sent (b"" for a bare close), or None if it still held the connection after SLOW_CLIENT_GIVE_UP."""
    received = b""
    deadline = time.monotonic() + SLOW_CLIENT_GIVE_UP
    position = 0
    for _ in range(int(SLOW_CLIENT_GIVE_UP / interval) + 1):
        if time.monotonic() > deadline:
            break
        if position < len(trickle):
            try:
                sock.send(trickle[position:position + 1])
                position += 1
            except (BrokenPipeError, ConnectionResetError):
                return received
        readable, _, _ = select.select([sock], [], [], interval)
        if readable:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                return received
            if not data:
                return received
            received += data
    return None


def test_a_client_that_connects_and_sends_nothing_is_dropped(hostile):
    with _connect(hostile) as sock:
        assert _closed_by_server(sock) == b""


def test_a_client_trickling_its_headers_byte_by_byte_is_dropped_while_others_are_served(hostile):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Padding: " + b"a" * 500
    outcome = {}

    def slow():
        with _connect(hostile) as sock:
            outcome["answer"] = _closed_by_server(sock, trickle=head)

    thread = threading.Thread(target=slow)
    thread.start()
    served = 0
    while thread.is_alive() and served < 50:  # ordinary clients meanwhile
        assert_still_serving(hostile)
        served += 1
    thread.join(SLOW_CLIENT_GIVE_UP + 10)
    assert served > 0
    assert outcome["answer"] is not None, "the server held a trickling client"
    assert outcome["answer"].startswith(b"HTTP/1.1 408 ")


def test_a_client_that_never_finishes_its_body_gets_408_and_its_request_ends(hostile):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")
    with _connect(hostile) as sock:
        sock.setblocking(True)
        sock.sendall(head)
        sock.setblocking(False)
        answer = _closed_by_server(sock)
    assert answer is not None and answer.startswith(b"HTTP/1.1 408 "), answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "timeout_error"
    in_flight = hostile.app.state.drain.in_flight
    for _ in range(100):  # the request task sees the disconnect and ends (bounded wait)
        if not in_flight:
            break
        time.sleep(0.1)
    assert not in_flight
    assert_still_serving(hostile)


def test_many_idle_connections_are_all_dropped_and_the_server_keeps_serving(hostile):
    socks = [_connect(hostile) for _ in range(100)]
    try:
        assert_still_serving(hostile)
        assert all(_closed_by_server(s) == b"" for s in socks)
    finally:
        for s in socks:
            s.close()
    assert_still_serving(hostile)


def test_a_keep_alive_connection_idle_after_its_answer_is_closed(hostile):
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with _connect(hostile) as sock:
        sock.setblocking(True)
        sock.sendall(request)
        sock.setblocking(False)
        answer = _closed_by_server(sock)
    assert answer is not None and answer.startswith(b"HTTP/1.1 200 ")
