"""Speculative decoding with the MTP layer on a GPU (pytest -m gpu): drafted steps verify their draft as extra
rows of the decode step, replayed from the same CUDA graphs as plain decode steps, and the draft head runs on
the GPU beside the model. Replies equal those without drafting, with CUDA graphs off and on."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

from conftest import start_server
from helpers import require_kt_kernel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

require_kt_kernel()

from engines.kt.experts.methods import best_method  # noqa: E402

INT8 = best_method(8)  # results independent of the step's other tokens (tests/test_kt_speculative.py)
PROMPTS = ("Tell me about rivers.", "Write a haiku about the sea.", "1, 2, 3,")
TOKENS = 32


def replies(server, at_once: bool = False) -> list[str]:
    async def one(client, prompt):
        reply = await client.completions.create(model=server.engine.info.id, prompt=prompt, max_tokens=TOKENS,
                                                temperature=0, extra_body={"ignore_eos": True})
        return reply.choices[0].text

    async def run():
        client = server.async_openai()
        if at_once:
            return list(await asyncio.gather(*[one(client, p) for p in PROMPTS]))
        return [await one(client, p) for p in PROMPTS]
    return asyncio.run(run())


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_greedy_replies_with_drafting_equal_the_replies_without_it_on_the_gpu(graphs):
    from engines.demo_model import ensure_demo_model

    settings = dict(engine="ktransformers", kt_method=INT8, kt_use_cuda_graph=graphs)
    plain = start_server(ensure_demo_model(), **settings)
    try:
        expected = replies(plain)
        # a batch's bf16 GEMMs round differently from one sequence's: drafting in a batch is held to the batch
        expected_together = replies(plain, at_once=True)
        print(json.dumps({"graphs": graphs, "plain_batch_equals_plain_solo": expected_together == expected}))
    finally:
        plain.stop()
    drafting = start_server(ensure_demo_model(mtp="last-layer"), speculative="mtp", speculative_adaptive=False,
                            **settings)
    try:
        runner = drafting.engine._runner
        assert (runner.graphs is not None) == graphs
        assert runner.drafter.head.device.type == "cuda"
        assert replies(drafting) == expected
        assert replies(drafting, at_once=True) == expected_together
        stats = drafting.engine.stats()
        print(f"\ngraphs={graphs}: {stats.accepted_draft_tokens} of {stats.draft_tokens} draft tokens accepted")
        assert 0 < stats.accepted_draft_tokens < stats.draft_tokens
    finally:
        drafting.stop()
