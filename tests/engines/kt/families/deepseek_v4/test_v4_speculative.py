"""Speculative decoding with DeepSeek-V4's multi-token-prediction layer (`speculative: mtp`): the tiny V4 in the
released layout, its MTP layer a copy of the last layer (engines/kt/families/deepseek_v4/demo_model.py: its drafts are accepted often
enough for both paths, a step keeping its draft and one taking rejected positions back out of the V4 cache), its
main weights the same as the plain V4 server's, whose replies it must give. The first prompt runs past position
128 while decoding, where the heavily compressed layer closes its first window."""
from __future__ import annotations

import logging

import pytest

from tests.conftest import start_server
from tests.helpers import completions_together, require_kt_kernel

require_kt_kernel()

PROMPTS = ("The harbour master kept a ledger of every boat that left at dawn and every boat that came back at dusk, "
           "and the ledger grew heavy with years. " * 4, "Tell me about rivers.", "1, 2, 3, 4, 5, 6, 7,")
TOKENS = 12


@pytest.fixture(scope="module")
def drafting(tmp_path_factory):
    from engines.kt.families.deepseek_v4.demo_model import make_demo_model_v4

    model = make_demo_model_v4(tmp_path_factory.mktemp("v4-mtp") / "tiny-v4-mtp", mtp="last-layer")
    running = start_server(model, engine="ktransformers", cpu_infer=1, speculative="mtp",
                           speculative_adaptive=False)  # draft in every step, however long it takes
    yield running
    running.stop()


def complete(server, prompt: str, **kwargs):
    kwargs.setdefault("temperature", 0)
    return server.openai().completions.create(model=server.engine.info.id, prompt=prompt, max_tokens=TOKENS,
                                              extra_body={"ignore_eos": True}, **kwargs)


@pytest.fixture(scope="module")
def expected(v4_server):
    return {p: complete(v4_server, p).choices[0].text for p in PROMPTS}


def test_v4_greedy_replies_with_drafting_equal_the_replies_without_it(drafting, expected):
    before = drafting.engine.stats()
    for prompt in PROMPTS:
        reply = complete(drafting, prompt)
        assert reply.choices[0].text == expected[prompt]
        assert reply.usage.completion_tokens == TOKENS
    after = drafting.engine.stats()
    drafted = after.draft_tokens - before.draft_tokens
    accepted = after.accepted_draft_tokens - before.accepted_draft_tokens
    assert 0 < accepted < drafted  # steps that kept their draft, and steps that took it back out


def test_v4_three_requests_drafting_at_once_get_the_replies_each_gets_alone(drafting, expected):
    before = drafting.engine.stats().draft_tokens
    assert completions_together(drafting, list(PROMPTS), TOKENS, ignore_eos=True) == [expected[p] for p in PROMPTS]
    assert drafting.engine.stats().draft_tokens > before


def test_v4_sampled_replies_draft_and_finish(drafting):
    before = drafting.engine.stats().draft_tokens
    reply = complete(drafting, PROMPTS[1], temperature=0.8, top_p=0.95, seed=7)
    assert reply.usage.completion_tokens == TOKENS
    assert drafting.engine.stats().draft_tokens > before


def test_v4_metrics_report_drafted_and_accepted_tokens(drafting):
    complete(drafting, PROMPTS[2])
    drafting.wait_idle()
    with drafting.http() as http:
        text = http.get("/metrics").text
    stats = drafting.engine.stats()
    assert stats.draft_tokens > 0
    assert f"ktserve_spec_decode_draft_tokens_total {float(stats.draft_tokens)}" in text
    assert f"ktserve_spec_decode_accepted_tokens_total {float(stats.accepted_draft_tokens)}" in text
    assert "ktserve_spec_decode_acceptance_ratio" in text


def test_v4_drafting_serves_without_a_prefix_cache(drafting):
    """The draft head's own caches are not kept with a prefix (engines/kt/families/deepseek_v4/prefixes.py), so a
    repeated prompt is computed again."""
    assert drafting.engine.info.details["v4_prefix_cache"].startswith("off: the MTP head drafts")
    complete(drafting, PROMPTS[0])
    assert complete(drafting, PROMPTS[0]).usage.prompt_tokens_details.cached_tokens == 0
    assert len(drafting.engine._runner.prefixes) == 0


def test_v4_checkpoint_without_an_mtp_layer_says_so_and_serves(tmp_path_factory, caplog):
    from engines.kt.families.deepseek_v4.demo_model import make_demo_model_v4

    model = make_demo_model_v4(tmp_path_factory.mktemp("v4-no-mtp") / "tiny-v4-no-mtp", mtp=None)
    with caplog.at_level(logging.WARNING, logger="ktserve.engine"):
        running = start_server(model, engine="ktransformers", cpu_infer=1, speculative="mtp")
    try:
        assert any("has no multi-token-prediction layer" in r.getMessage() and "serving without drafting"
                   in r.getMessage() for r in caplog.records)
        assert complete(running, "Hello").usage.completion_tokens == TOKENS
        assert running.engine.stats().draft_tokens == 0
    finally:
        running.stop()
