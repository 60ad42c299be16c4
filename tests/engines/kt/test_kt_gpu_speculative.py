"""Speculative decoding with the MTP layer on a GPU (pytest -m gpu): drafted steps verify their draft as extra
rows of the decode step, replayed from the same CUDA graphs as plain decode steps, and the draft head runs on
the GPU beside the model. Replies equal those without drafting, with CUDA graphs off and on."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

from tests.conftest import start_server
from tests.helpers import require_kt_kernel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

require_kt_kernel()

from engines.kt.experts.methods import best_method  # noqa: E402

INT8 = best_method(8)  # results independent of the step's other tokens (tests/engines/kt/test_kt_speculative.py)
PROMPTS = ("Tell me about rivers.", "Write a haiku about the sea.", "1, 2, 3,")
TOKENS = 32


# a batch drafting at once has other rows in its GEMMs than the same batch without drafting: where the plain batch's
# top two tokens lie closer than this, bf16 rounding may pick the other one. The demo's logits are bf16, one step of
# which is 0.25 at magnitudes 32-64: on the H200 (2026-11-28, eager) a batch parted at token 6 of 32 where the plain
# batch's top two were 0.2500 apart, one step, a tie the other rows' rounding broke the other way.
NEAR_TIE = 0.3


def replies(server, at_once: bool = False, logprobs: bool = False) -> list:
    """Each prompt's greedy reply: its text, or with `logprobs` its choice's logprobs (tokens, top two)."""
    async def one(client, prompt):
        reply = await client.completions.create(model=server.engine.info.id, prompt=prompt, max_tokens=TOKENS,
                                                temperature=0, extra_body={"ignore_eos": True},
                                                logprobs=2 if logprobs else None)
        return reply.choices[0].logprobs if logprobs else reply.choices[0].text

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
        expected_together = replies(plain, at_once=True, logprobs=True)
        print(json.dumps({"graphs": graphs, "plain_batch_equals_plain_solo":
                          ["".join(r.tokens) for r in expected_together] == expected}))
    finally:
        plain.stop()
    drafting = start_server(ensure_demo_model(mtp="last-layer"), speculative="mtp", speculative_adaptive=False,
                            **settings)
    try:
        runner = drafting.engine._runner
        assert (runner.graphs is not None) == graphs
        assert runner.drafter.head.device.type == "cuda"
        assert replies(drafting) == expected
        for got, plain_reply in zip(replies(drafting, at_once=True, logprobs=True), expected_together):
            assert_same_up_to_a_near_tie(got.tokens, plain_reply)
        stats = drafting.engine.stats()
        print(f"\ngraphs={graphs}: {stats.accepted_draft_tokens} of {stats.draft_tokens} draft tokens accepted")
        assert 0 < stats.accepted_draft_tokens < stats.draft_tokens
    finally:
        drafting.stop()


def assert_same_up_to_a_near_tie(tokens: list[str], plain) -> None:
    """`tokens` are the plain reply's, or they part where the plain reply's top two lay within NEAR_TIE."""
    same = next((i for i, (a, b) in enumerate(zip(tokens, plain.tokens)) if a != b), len(plain.tokens))
    if same < len(plain.tokens):
        top = sorted(plain.top_logprobs[same].values(), reverse=True)
        print(f"\nparted at token {same} of {len(plain.tokens)}: the plain batch's top two {top[0] - top[1]:.4f} apart")
        assert top[0] - top[1] < NEAR_TIE, (same, tokens, plain.tokens)
