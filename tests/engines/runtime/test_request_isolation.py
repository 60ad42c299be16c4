"""One request never fails or changes another (ktransformers engine, demo model, CPU): token ids outside the
model are refused before they join a batch, a request whose model step fails fails alone, and a KV cache too
small for every request's max_tokens preempts and recomputes instead of refusing work, without changing a
token of anyone's output."""
from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from tests.conftest import start_server
from tests.helpers import (chat_prompt_ids, failing_steps, greedy_reference, poisoned_request, require_kt_kernel,
                     run_beside_a_stream, stream_chat, with_peak_running)

require_kt_kernel()

PAGE = 64
CACHE_PAGES = 4
POISON = 77_777  # a prompt token the injected fault looks for


@pytest.fixture(scope="module")
def kt(demo_model_dir):
    """The ktransformers engine with a KV cache of four pages, which the admission test fills."""
    running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16",
                           kv_cache_tokens=CACHE_PAGES * PAGE, max_concurrent=8)
    yield running
    running.stop()


def reference_text(tokenizer, reference_model, content: str, max_tokens: int) -> str:
    ids = greedy_reference(reference_model, chat_prompt_ids(tokenizer, [{"role": "user", "content": content}]),
                           max_tokens)
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_ollama_context_ids_outside_the_model_are_400_and_a_neighbour_stream_is_untouched(
        server, tokenizer, reference_model):
    content = "Name three rivers."
    contexts = [[999_999_999], [-1], [129_280], [2**70], [5, 6, 129_280]]  # 129,280: the demo model's vocab size

    def bad_requests() -> list[httpx.Response]:
        with server.http() as http:
            return [http.post("/api/generate", json={"model": server.engine.info.id, "prompt": "x",
                                                     "stream": False, "context": context, "raw": raw})
                    for context in contexts for raw in (False, True)]

    text, replies = run_beside_a_stream(server, content, 16, bad_requests)
    for reply in replies:
        assert reply.status_code == 400
        assert reply.json()["error"].startswith("context: token id")
    assert text == reference_text(tokenizer, reference_model, content, 16)


def test_a_request_whose_model_step_fails_fails_alone_while_its_neighbour_streams_on(
        server, tokenizer, reference_model, caplog):
    content = "Describe a lighthouse."
    with failing_steps(server.engine._runner, POISON) as shared:
        with caplog.at_level(logging.ERROR, logger="ktserve.engine"):
            text, reply = run_beside_a_stream(server, content, 24, lambda: poisoned_request(server, POISON))
    assert any(shared)  # the fault struck a step the neighbour was in
    assert reply.status_code == 500 and "injected fault" in reply.json()["error"]["message"]
    assert text == reference_text(tokenizer, reference_model, content, 24)
    culprits = [r for r in caplog.records if r.levelno == logging.ERROR and "injected fault" in r.getMessage()]
    assert len(culprits) == 1


def preemptions(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return float(next(line.rsplit(" ", 1)[1] for line in text.splitlines()
                      if line.startswith("ktserve_preemptions_total")))


def test_a_full_kv_cache_preempts_and_every_stream_gets_the_tokens_it_gets_alone(kt, tokenizer, reference_model):
    # each request ends at 78 positions (2 pages): reserving that up front runs 2 at a time on 4 pages;
    # admitted by use, all 3 start (1 page each) and the cache fills as they grow. The prompts are ones whose
    # greedy tokens lead the runner-up by more than bf16 experts move a logprob (0.04 or more here; 0.0075 is
    # the batching noise measured in test_kt_prefix_cache.py), so any change of a token is a real one.
    prompts = ["Count to 1:", "Describe a lighthouse.", "Name three rivers."]
    max_tokens = 70
    before = preemptions(kt)

    async def main():
        return await with_peak_running(kt.engine, asyncio.gather(*(stream_chat(kt, p, max_tokens) for p in prompts)))

    results, peak = asyncio.run(main())
    for prompt, (text, finish) in zip(prompts, results):
        assert finish == "length"
        assert text == reference_text(tokenizer, reference_model, prompt, max_tokens)  # no delta twice, none lost
    assert peak > CACHE_PAGES // 2
    assert preemptions(kt) > before
    kt.wait_idle()
    assert kt.engine.stats().kv_used_tokens == 0
