"""With an API key configured, every /v1 route needs it; /health and /version stay open."""
from __future__ import annotations

import openai
import pytest

from tests.conftest import start_server

KEY = "sk-test-4c0ffee"


@pytest.fixture(scope="module")
def keyed_server(demo_model_dir):
    running = start_server(demo_model_dir, api_key=KEY)
    yield running
    running.stop()


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                                         ("POST", "/v1/completions")])
def test_routes_refuse_a_missing_key_with_401(keyed_server, method, path):
    with keyed_server.http() as http:
        r = http.request(method, path, json={})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"


def test_a_wrong_key_is_401(keyed_server):
    with pytest.raises(openai.AuthenticationError):
        keyed_server.openai(api_key="sk-wrong").models.list()


def test_the_right_key_is_accepted(keyed_server):
    assert keyed_server.openai(api_key=KEY).models.list().data[0].id == keyed_server.engine.info.id


@pytest.mark.parametrize("path", ["/health", "/version"])
def test_health_and_version_need_no_key(keyed_server, path):
    with keyed_server.http() as http:
        assert http.get(path).status_code == 200
