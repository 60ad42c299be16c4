"""Speculative decoding with DeepSeek-V3.2's multi-token-prediction layer (`speculative: mtp`), ktransformers
engine on the tiny V3.2 in its released layout: the MTP layer is a V3.2 decoder layer with its own lightning
indexer, attending over its own layer of the indexed latent cache. Drafting changes how many steps a reply
takes, never the reply. Two heads: the release's layout with a copy of the model's last layer (its drafts are
often accepted: the accept path), and the demo's random one (nearly always rejected: the reject path, rejected
positions' latents and indexer keys written over). The prompts run past index_topk (64), so the main layers'
and the head's indexers choose which positions attention sees.

The experts run in the 8-bit method of this kt-kernel build (AMXINT8, FP8 on avx2), whose results do not depend
on the other tokens of a step (tests/engines/kt/test_kt_speculative.py says why)."""
from __future__ import annotations

import json

import pytest

from tests.conftest import start_server
from tests.helpers import RIVER_TEXT, prompt_of_length, require_kt_kernel

require_kt_kernel()

from engines.kt.experts.methods import best_method  # noqa: E402

INT8 = best_method(8)
TOKENS = 12
LENGTHS = (20, 90)  # prompt tokens: below and past index_topk


@pytest.fixture(scope="module")
def copied_dir(tmp_path_factory):
    from engines.kt.families.deepseek_v32.demo_model import make_demo_model_v32

    return make_demo_model_v32(tmp_path_factory.mktemp("v32-mtp-copy"), mtp="last-layer")


def serve(model_dir, **overrides):
    return start_server(model_dir, engine="ktransformers", kt_method=INT8, max_concurrent=4, **overrides)


@pytest.fixture(scope="module")
def replies(copied_dir, v32_dir, v32_tokenizer):
    """Greedy replies of each prompt without drafting, then with it, from each model (one server at a time),
    and the draft counts of each drafting server."""
    prompts = [prompt_of_length(v32_tokenizer, RIVER_TEXT, n)[0] for n in LENGTHS]
    out = {}
    for kind, model_dir in (("copied", copied_dir), ("random", v32_dir)):
        for drafting in (False, True):
            running = serve(model_dir, **({"speculative": "mtp", "speculative_adaptive": False} if drafting else {}))
            try:
                client, model = running.openai(), running.engine.info.id
                texts = [client.completions.create(model=model, prompt=p, max_tokens=TOKENS, temperature=0,
                                                   extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
                stats = running.engine.stats()
                out[kind, drafting] = (texts, stats.draft_tokens, stats.accepted_draft_tokens,
                                       running.engine.info.details.get("speculative"))
            finally:
                running.stop()
    print(json.dumps({f"v32_mtp_{kind}_drafted_accepted": [v[1], v[2]] for (kind, drafting), v in out.items()
                      if drafting}))
    return out


@pytest.mark.parametrize("kind", ["copied", "random"])
def test_greedy_replies_with_drafting_equal_the_replies_without_it(replies, kind):
    assert replies[kind, True][0] == replies[kind, False][0]


def test_the_mtp_layer_drafts_and_both_accept_and_reject_paths_run(replies):
    _, drafted, accepted, where = replies["copied", True]
    assert where == "mtp (model.layers.4)" and drafted > 0 and 0 < accepted < drafted
    _, drafted, accepted, _ = replies["random", True]
    assert drafted > 0 and accepted < drafted
