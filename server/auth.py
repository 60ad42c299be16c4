"""API-key check for the protected routes: `Authorization: Bearer <key>` compared in constant time."""
from __future__ import annotations

import hmac

from fastapi import Request

from server.errors import APIError


def require_api_key(request: Request) -> None:
    expected = request.app.state.settings.api_key
    if not expected:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        given = request.headers.get("x-api-key", "")
    if not given:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", type="authentication_error",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise APIError(401, "incorrect API key", type="authentication_error", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
