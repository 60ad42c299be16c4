"""Requests that no route serves (404) or serves with another method (405).

With an API key set, a request without the right key gets 401 first, so an unauthenticated client learns
nothing about which paths exist. A path that only differs from a served one by its trailing slash is
redirected (307) with a relative `Location`: copying the client's `Host` header into an absolute URL, as
Starlette's own redirect does, would send the client wherever that header says."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import RedirectResponse, Response
from starlette.routing import Match

from server.auth import require_api_key
from server.errors import APIError, error_answer


def unmatched_route(request: Request) -> Response | None:
    """The answer to an unmatched request, or None for the plain 404/405."""
    try:
        require_api_key(request)
    except APIError as err:
        return error_answer(request, err)
    other = _slash_twin(request)
    if other is None:
        return None
    query = request.url.query
    return RedirectResponse(other + (f"?{query}" if query else ""), status_code=307)


def _slash_twin(request: Request) -> str | None:
    """The request's path with its trailing slash added or removed, if a route serves that one."""
    path = request.url.path
    if path == "/":
        return None
    other = path[:-1] if path.endswith("/") else path + "/"
    scope = {**request.scope, "path": other}
    for route in request.app.router.routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return other
    return None
