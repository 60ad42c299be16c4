"""With an API key configured, every route refuses a request without it — except /health and /version
(and /metrics when configured public). The routes are read from the app itself, so a route added later is
covered without touching this file. The key never reaches the log. (tests/server/test_api_auth.py covers the
key's accepted forms; this file is about coverage and leaks.)"""
from __future__ import annotations

import re

import httpx
import pytest
from starlette.routing import Route, WebSocketRoute

from tests.conftest import start_server
from tests.load.server import ServerOptions, ServerProcess

KEY = "sk-ktserve-7f3a9c1e5b2d8046"
WRONG_KEY = "sk-ktserve-wrong-0d1e2f3a4b5c"
OPEN_ROUTES = {"/health", "/version"}


def http_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every HTTP route the app serves, path parameters filled with a placeholder.
    Included routers are walked (FastAPI keeps them as one entry each); a route of a kind this function
    does not know fails the test rather than being skipped."""
    found: list[tuple[str, str]] = []

    def walk(routes, prefix: str) -> None:
        for route in routes:
            if isinstance(route, Route):
                path = re.sub(r"\{[^}]+\}", "placeholder", prefix + route.path)
                found.extend((m, path) for m in sorted(route.methods or ()) if m != "HEAD")
            elif hasattr(route, "original_router"):  # fastapi's _IncludedRouter
                walk(route.original_router.routes, prefix + (route.include_context.prefix or ""))
            elif not isinstance(route, WebSocketRoute):
                raise AssertionError(f"unknown kind of route {route!r}: teach http_routes about it")

    walk(app.routes, "")
    return found


@pytest.fixture(scope="module", params=[False, True], ids=["metrics-keyed", "metrics-public"])
def keyed(request, demo_model_dir):
    running = start_server(demo_model_dir, api_key=KEY, metrics_public=request.param)
    yield running
    running.stop()


def open_routes(server) -> set[str]:
    return OPEN_ROUTES | ({"/metrics"} if server.settings.metrics_public else set())


def test_the_route_list_read_from_the_app_holds_every_documented_route(keyed):
    paths = {path for _, path in http_routes(keyed.app)}
    documented = {re.sub(r"\{[^}]+\}", "placeholder", path) for path in keyed.app.openapi()["paths"]}
    assert documented <= paths
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"} <= paths


def test_every_route_but_the_open_ones_refuses_a_request_without_the_key(keyed):
    allowed = open_routes(keyed)
    with keyed.http() as http:
        for method, path in http_routes(keyed.app):
            r = http.request(method, path, json={})
            if path in allowed:
                assert r.status_code != 401, (method, path)
            else:
                assert r.status_code == 401, (method, path, r.status_code, r.text[:200])
                error = r.json()["error"]
                if path.startswith("/api/"):  # Ollama's routes answer in Ollama's shape
                    assert isinstance(error, str) and "API key" in error, (path, error)
                else:
                    assert error["type"] == "authentication_error"


def test_every_protected_route_refuses_a_wrong_key_and_lets_the_right_one_through(keyed):
    allowed = open_routes(keyed)
    with keyed.http() as http:
        for method, path in http_routes(keyed.app):
            if path in allowed:
                continue
            wrong = http.request(method, path, json={}, headers={"Authorization": f"Bearer {WRONG_KEY}"})
            assert wrong.status_code == 401, (method, path)
            right = http.request(method, path, json={}, headers={"Authorization": f"Bearer {KEY}"})
            assert right.status_code != 401, (method, path)


def test_the_key_never_appears_in_the_log_or_in_answers(tmp_path):
    """A real `ktserve serve` process with the key from API_KEY, logging at debug level: its whole output,
    after authorized, refused and failing requests, holds neither the key nor a wrong key a client sent."""
    log_path = tmp_path / "server.log"
    options = ServerOptions(log_level="debug", extra_args=("--log-format", "text"))
    answers = []
    with ServerProcess(options, log_path, env={"API_KEY": KEY}) as server:
        good = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=server.base_url, timeout=120, trust_env=False) as http:
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            answers += [
                http.post("/v1/chat/completions", json=chat, headers=good),
                http.post("/v1/chat/completions", json={**chat, "stream": True}, headers=good),
                http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"X-Api-Key": KEY}),
                http.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1}, headers=good),
                http.post("/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {WRONG_KEY}"}),
                http.post("/v1/chat/completions", json=chat, headers={"Authorization": f"Basic {KEY}"}),
                http.get(f"/v1/models?api_key={KEY}"),
                http.get("/metrics", headers=good),
                http.get("/nowhere", headers=good),
            ]
            assert answers[0].status_code == 200 and answers[4].status_code == 401
    output = log_path.read_text(errors="replace")
    assert "/v1/chat/completions" in output  # the request log was on
    for secret in (KEY, WRONG_KEY):
        assert secret not in output
        for r in answers:
            assert secret not in r.text and secret not in str(r.headers)
