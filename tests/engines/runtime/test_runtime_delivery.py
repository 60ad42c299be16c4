"""How the engine thread hands outputs to the callers' event loop: a step's outputs go together, in order."""
from __future__ import annotations

import asyncio

from engines.base import EngineConfig, GenerationRequest, SamplingParams
from tests.scripted_engine import ScriptedEngine

SCRIPTS = ["one two three four five six", "alpha beta gamma delta", "red green blue"]


async def _generate(engine: ScriptedEngine, wakeups: list[int]) -> list[str]:
    loop = asyncio.get_running_loop()
    wake = loop.call_soon_threadsafe

    def counted(*args, **kwargs):
        wakeups.append(1)
        return wake(*args, **kwargs)
    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    tokenizer = engine._tokenizer
    handles = [engine.submit(GenerationRequest(prompt_token_ids=tokenizer.encode(s, add_special_tokens=False),
                                               sampling=SamplingParams(max_tokens=64, temperature=0)))
               for s in SCRIPTS]

    async def text(handle) -> str:
        return "".join([out.text async for out in handle])
    return await asyncio.gather(*(text(h) for h in handles))


def test_a_step_wakes_the_callers_loop_once_for_all_its_requests(demo_model_dir):
    engine = ScriptedEngine(EngineConfig(model_path=str(demo_model_dir), max_concurrent=4))
    engine.start()
    try:
        wakeups: list[int] = []
        texts = asyncio.run(_generate(engine, wakeups))
    finally:
        engine.stop()
    steps = engine.stats().steps  # read once the engine thread has ended
    assert [t.strip() for t in texts] == SCRIPTS  # every delta arrived, in order
    deltas = sum(len(engine._tokenizer.encode(s, add_special_tokens=False)) + 1 for s in SCRIPTS)
    assert len(wakeups) <= steps < deltas


def test_a_steps_tokens_go_out_once_the_step_is_counted(demo_model_dir, monkeypatch):
    """A caller woken by a token reads stats that already hold the step that made it (bench's step breakdown
    snapshots them at the first token: delivered before the count, the prompt's step could land among the decode
    steps'). Each hand-off of outputs records the steps counted then."""
    engine = ScriptedEngine(EngineConfig(model_path=str(demo_model_dir), max_concurrent=4))
    counted_at_send: list[tuple[int, float]] = []
    send = engine._send_outbox

    def recorded() -> None:
        if engine._outbox:
            counted_at_send.append((engine._stats.steps, engine._stats.times.step))
        send()
    monkeypatch.setattr(engine, "_send_outbox", recorded)
    engine.start()
    try:
        asyncio.run(_generate(engine, []))
    finally:
        engine.stop()
    assert counted_at_send and counted_at_send[0][0] >= 1 and counted_at_send[0][1] > 0
    assert [steps for steps, _ in counted_at_send] == sorted({steps for steps, _ in counted_at_send})
