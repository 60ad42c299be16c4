"""Per-request plumbing that needs no model: X-Request-Id, CORS, and /health while the model loads."""
from __future__ import annotations

import pytest

from tests.ops_support import HeldLoadEngine, ThreadedServer, wait_for
from server.app import create_app
from server.settings import Settings

ORIGIN = "https://chat.example.com"


def serve(**settings) -> tuple[ThreadedServer, HeldLoadEngine]:
    engine = HeldLoadEngine()
    return ThreadedServer(create_app(Settings(**settings), engine)), engine


@pytest.fixture(scope="module")
def plain():
    running, engine = serve()
    engine.loaded.set()
    running.wait_healthy()
    yield running
    running.stop()


def test_a_client_request_id_is_echoed(plain):
    with plain.http() as http:
        assert http.get("/v1/models", headers={"X-Request-Id": "trace-42"}).headers["x-request-id"] == "trace-42"


def test_a_fresh_request_id_is_made_when_the_client_sends_none(plain):
    with plain.http() as http:
        first, second = (http.get("/v1/models").headers["x-request-id"] for _ in range(2))
    assert first and second and first != second


def test_a_client_request_id_is_cleaned_and_cut_to_length(plain):
    with plain.http() as http:
        echoed = http.get("/v1/models", headers={"X-Request-Id": "a b\t<c>;" + "x" * 500}).headers["x-request-id"]
    assert echoed == ("abc" + "x" * 500)[:128]


def test_errors_carry_the_request_id_too(plain):
    with plain.http() as http:
        response = http.get("/no/such/route", headers={"X-Request-Id": "lost-1"})
    assert response.status_code == 404
    assert response.headers["x-request-id"] == "lost-1"


def test_no_cors_headers_unless_origins_are_configured(plain):
    with plain.http() as http:
        response = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in response.headers


def test_configured_cors_origins_are_allowed_with_preflight():
    running, engine = serve(cors_origins=[ORIGIN], api_key="sk-cors")
    engine.loaded.set()
    try:
        running.wait_healthy()
        with running.http() as http:
            preflight = http.options("/v1/chat/completions", headers={
                "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type"})
            simple = http.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer sk-cors"})
            other = http.get("/v1/models", headers={"Origin": "https://elsewhere.example", "Authorization":
                                                    "Bearer sk-cors"})
    finally:
        running.stop()
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert simple.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in simple.headers["access-control-expose-headers"].lower()
    assert "access-control-allow-origin" not in other.headers


def test_health_is_503_while_the_model_loads_and_200_once_it_has():
    running, engine = serve()
    try:
        with running.http() as http:
            loading = http.get("/health")
            engine.loaded.set()
            wait_for(lambda: http.get("/health").status_code == 200, 30, "/health to turn 200")
    finally:
        running.stop()
    assert loading.status_code == 503
    assert loading.json()["status"] == "loading"
