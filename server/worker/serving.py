"""The answers to a router's probes, built from the engine and the settings: what this replica serves
(model id, adapters, context length, capacity), how loaded it is, and whether its engine still makes
progress.

The shapes follow SGLang's worker endpoints, which sglang-router (SGLang's model gateway) reads when it
registers a worker and while it routes: `served_model_name` becomes the worker's model id; `dp_size` is 1
(one replica is one data-parallel rank); the load is a list with one entry per rank, and the router's
power-of-two policy balances on its `num_tokens`.

No `model_path` is reported: the router takes it as a tokenizer to load and, when it is not a directory
on the router's own host (the usual case in containers), tries to download it from a model hub."""
from __future__ import annotations

import asyncio
import uuid
from typing import Any

from engines.base import Engine, EngineError, GenerationRequest, SamplingParams
from server import __version__
from server.settings import Settings

PROGRESS_POLL_SECONDS = 0.05


def server_info(settings: Settings, engine: Engine) -> dict[str, Any]:
    info, stats = engine.info, engine.stats()
    return {
        "served_model_name": info.id,
        "version": __version__,
        "engine": engine.name,
        "architectures": [info.architecture],
        "context_length": info.max_model_len,
        "adapters": adapter_names(engine),
        "max_running_requests": settings.max_concurrent,
        "max_queued_requests": settings.max_queue,
        "max_total_tokens": stats.kv_total_tokens or None,  # None: the engine's KV cache is not bounded
        "dp_size": 1,
    }


def model_info(engine: Engine) -> dict[str, Any]:
    info = engine.info
    return {
        "served_model_name": info.id,
        "architectures": [info.architecture],
        "is_generation": True,
        "has_value_head": info.has_value_head,
        "max_context_length": info.max_model_len,
        "adapters": adapter_names(engine),
    }


def load(engine: Engine) -> list[dict[str, int]]:
    """Requests generating and queued (one per choice), and the KV cache positions they hold (0 for an
    engine without a bounded KV cache)."""
    s = engine.stats()
    return [{"dp_rank": 0, "num_reqs": s.running, "num_waiting_reqs": s.waiting, "num_tokens": s.kv_used_tokens}]


def adapter_names(engine: Engine) -> list[str]:
    return [a.name for a in engine.list_adapters()]


async def engine_makes_progress(engine: Engine, timeout: float) -> str | None:
    """None when the engine thread is alive and stepping, else why not. A busy engine proves it by taking
    a step within `timeout`; an idle one by generating one token, so a probe never queues behind work."""
    before = engine.stats()
    if before.running or before.waiting:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            await asyncio.sleep(PROGRESS_POLL_SECONDS)
            if engine.stats().steps > before.steps:
                return None
        return f"the engine took no step in {timeout:g}s"
    try:
        handle = engine.submit(GenerationRequest(
            prompt_token_ids=engine.tokenizer.encode("ping"), sampling=SamplingParams(max_tokens=1),
            request_id=f"health-{uuid.uuid4().hex}"))
    except EngineError as exc:
        return str(exc)
    try:
        await asyncio.wait_for(handle.result(), timeout)
    except asyncio.TimeoutError:
        handle.cancel()
        return f"a one-token generation did not finish in {timeout:g}s"
    return None
