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
    steps = engine.stats().steps  # read once the engine thread has ended: it counts a step after delivering it
    assert [t.strip() for t in texts] == SCRIPTS  # every delta arrived, in order
    deltas = sum(len(engine._tokenizer.encode(s, add_special_tokens=False)) + 1 for s in SCRIPTS)
    assert len(wakeups) <= steps < deltas
