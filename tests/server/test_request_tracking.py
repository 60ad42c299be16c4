"""How the serving code learns a request's tracker and how a shutdown is told apart from a failure: the
tracker travels on the request, and a shutdown is a flag on the engine's last delta, never its text."""
from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from engines.base import EngineConfig, GenerationOutput, GenerationRequest, RequestHandle, SamplingParams
from server.errors import APIError
from server.middleware import RequestTracking
from server.serving import collect
from server.shutdown import Drain
from server.tracking import RequestTracker, TrackedHandle, tracker_of

SHUTDOWN_TEXT = "the server is shutting down and this request did not finish within its graceful_timeout"


def http_scope(path: str = "/v1/chat/completions") -> dict:
    return {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}


class ConnectedClient(Request):
    """A request whose client never goes away."""

    async def is_disconnected(self) -> bool:
        return False


class NoMetrics:
    def observe(self, tracker: RequestTracker) -> None:
        pass


def test_a_request_the_tracking_middleware_never_saw_has_no_tracker():
    with pytest.raises(RuntimeError, match="RequestTracking"):
        tracker_of(Request(http_scope()))


def test_the_tracking_middleware_puts_the_request_s_tracker_on_the_request():
    seen: list[RequestTracker] = []
    drain = Drain(grace_seconds=1.0)

    async def app(scope, receive, send):
        seen.append(tracker_of(Request(scope)))
        assert seen[0] in drain.in_flight
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def ignore(message):
        pass

    scope = {**http_scope(), "state": {"shared": True}}
    shared_state = scope["state"]
    asyncio.run(RequestTracking(app, metrics=NoMetrics(), drain=drain)(scope, None, ignore))
    [tracker] = seen
    assert (tracker.path, tracker.status) == ("/v1/chat/completions", 204)
    assert shared_state == {"shared": True}  # the server's state dict is left as it was


def handle_pair(loop: asyncio.AbstractEventLoop) -> tuple[RequestHandle, TrackedHandle]:
    handle = RequestHandle("req-1", loop, on_cancel=lambda _: None)
    return handle, TrackedHandle(handle)


def test_a_choice_the_shutdown_ends_says_so_in_its_last_delta():
    async def run() -> tuple[list[GenerationOutput], RequestTracker]:
        tracker = RequestTracker("r", "POST", "/v1/chat/completions")
        [tracked] = tracker.track([RequestHandle("req-1", asyncio.get_running_loop(), lambda _: None)], 3)
        tracker.abort(SHUTDOWN_TEXT)
        return [out async for out in tracked], tracker

    outputs, tracker = asyncio.run(run())
    assert [(o.finish_reason, o.server_shutdown, o.error) for o in outputs] == [("error", True, SHUTDOWN_TEXT)]
    assert tracker.finish_reasons() == ["server_shutdown"]


def collected(last: GenerationOutput) -> list[GenerationOutput]:
    async def run() -> list[GenerationOutput]:
        handle, tracked = handle_pair(asyncio.get_running_loop())
        handle.deliver(last)
        tracker = RequestTracker("r", "POST", "/v1/completions")
        return await collect(ConnectedClient(http_scope()), tracker, [tracked], timeout=5)

    return asyncio.run(run())


def test_a_collected_choice_the_shutdown_ended_is_a_503_whatever_its_message():
    with pytest.raises(APIError) as raised:
        collected(GenerationOutput("req-1", finish_reason="abort", error="engine stopping", server_shutdown=True))
    error = raised.value
    assert (error.status, error.code, error.message) == (503, "server_shutdown", "engine stopping")


def test_a_failure_that_reads_like_a_shutdown_is_still_a_failure():
    [out] = collected(GenerationOutput("req-1", finish_reason="error", error=SHUTDOWN_TEXT))
    assert (out.finish_reason, out.server_shutdown) == ("error", False)


def test_an_engine_that_stops_ends_its_requests_in_flight_as_shut_down(demo_model_dir):
    from tests.scripted_engine import ScriptedEngine

    engine = ScriptedEngine(EngineConfig(model_path=str(demo_model_dir)))
    engine.start()

    async def run() -> GenerationOutput:
        handle = engine.submit(GenerationRequest([5, 6, 7], SamplingParams(max_tokens=4000, ignore_eos=True)))
        await asyncio.to_thread(engine.stop)
        return await asyncio.wait_for(handle.result(), timeout=30)

    try:
        out = asyncio.run(run())
    finally:
        if engine.ready:  # the run failed before it stopped the engine
            engine.stop()
    assert (out.finish_reason, out.server_shutdown) == ("abort", True)
