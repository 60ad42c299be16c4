"""Speculative decoding with DeepSeek-V3's multi-token-prediction layer (`speculative: mtp`), ktransformers engine on
the demo model with an MTP layer written beside its weights: drafting changes how many steps a reply takes,
never the reply. Two draft heads: one copying the model's last layer (its drafts are often accepted: the
accept path) and a random one (nearly always rejected: the reject path, rejected positions' KV written over).

The experts run in the 8-bit method of this kt-kernel build (AMXINT8, FP8 on avx2), whose results do not depend
on the other tokens of a step. kt-kernel's BF16 kernels on the avx2 build do: there a sequence's greedy reply
already differs alone and in a batch of three, drafting or not, and a verification step is a batch of two."""
from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from tests.conftest import start_server
from tests.helpers import require_kt_kernel

require_kt_kernel()

from engines.kt.experts.methods import best_method  # noqa: E402

INT8 = best_method(8)

PROMPTS = ("Tell me about rivers.", "Write a haiku about the sea.", "1, 2, 3,")
TOKENS = 16
# where transformers' MTP layer prefers its top token by more than this many logits, rounding (kt-kernel's bf16
# experts against float32) cannot change the draft
CLEAR_MARGIN = 0.5


def drafting_server(kind: str):
    from engines.demo_model import ensure_demo_model

    running = start_server(ensure_demo_model(mtp=kind), engine="ktransformers", kt_method=INT8, speculative="mtp",
                           speculative_adaptive=False)  # draft in every step, however long it takes
    running.kind = kind
    return running


@pytest.fixture(scope="module")
def plain(demo_model_dir):
    """The demo model without drafting: the same weights as both drafting models, whose outputs they must give."""
    running = start_server(demo_model_dir, engine="ktransformers", kt_method=INT8)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def copied_head():
    running = drafting_server("last-layer")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def random_head():
    running = drafting_server("random")
    yield running
    running.stop()


@pytest.fixture(params=["copied_head", "random_head"])
def drafting(request):
    return request.getfixturevalue(request.param)


def generate(server, prompt_ids: list[int], tokens: int) -> list[int]:
    """Greedy token ids straight from the engine (the HTTP replies carry text)."""
    from engines.base import GenerationRequest, SamplingParams

    async def run() -> list[int]:
        handle = server.engine.submit(GenerationRequest(prompt_ids, SamplingParams(
            max_tokens=tokens, temperature=0, ignore_eos=True)))
        return [t async for out in handle for t in out.token_ids]
    return asyncio.run(asyncio.wait_for(run(), timeout=120))


def completions_at_once(server, prompts) -> list[str]:
    async def run():
        client = server.async_openai()
        replies = await asyncio.gather(*[client.completions.create(
            model=server.engine.info.id, prompt=p, max_tokens=TOKENS, temperature=0,
            extra_body={"ignore_eos": True}) for p in prompts])
        return [r.choices[0].text for r in replies]
    return asyncio.run(run())


@pytest.fixture(scope="module")
def expected(plain):
    return {p: plain.openai().completions.create(model=plain.engine.info.id, prompt=p, max_tokens=TOKENS,
                                                 temperature=0, extra_body={"ignore_eos": True}).choices[0].text
            for p in PROMPTS}


def test_greedy_replies_with_drafting_equal_the_replies_without_it(drafting, expected):
    before = drafting.engine.stats()
    for prompt in PROMPTS:
        reply = drafting.openai().completions.create(model=drafting.engine.info.id, prompt=prompt, max_tokens=TOKENS,
                                                     temperature=0, extra_body={"ignore_eos": True})
        assert reply.choices[0].text == expected[prompt]
        assert reply.usage.completion_tokens == TOKENS
    after = drafting.engine.stats()
    drafted, accepted = (after.draft_tokens - before.draft_tokens,
                         after.accepted_draft_tokens - before.accepted_draft_tokens)
    assert drafted > 0
    if drafting.kind == "last-layer":
        assert accepted > 0  # the accept path ran: steps that took two tokens
    assert accepted < drafted  # and the reject path


def test_a_batch_of_three_drafting_at_once_gets_the_replies_each_gets_alone(drafting, expected):
    assert completions_at_once(drafting, PROMPTS) == [expected[p] for p in PROMPTS]


def test_pages_cached_while_drafting_serve_a_longer_prompt_as_computing_it_whole(drafting, plain):
    """Decode positions fill pages that the prefix cache indexes; one holding a rejected draft token's KV would
    change the reply of a prompt that borrows it."""
    start = drafting.engine.tokenizer.encode("The mills along the river " * 11)
    assert 50 < len(start) < 62
    generated = generate(drafting, start, 14)
    longer = start + generated[:10]  # its first 64-position page ends in generated tokens
    cached = drafting.engine.stats().cached_prompt_tokens
    assert generate(drafting, longer, 6) == generate(plain, longer, 6)
    assert drafting.engine.stats().cached_prompt_tokens - cached == 64


def test_sampled_replies_draft_and_finish(copied_head):
    before = copied_head.engine.stats().draft_tokens
    reply = copied_head.openai().completions.create(model=copied_head.engine.info.id, prompt=PROMPTS[0],
                                                    max_tokens=TOKENS, temperature=0.8, top_p=0.95, seed=7,
                                                    extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == TOKENS
    assert copied_head.engine.stats().draft_tokens > before


def test_metrics_report_drafted_and_accepted_tokens(copied_head):
    copied_head.openai().completions.create(model=copied_head.engine.info.id, prompt=PROMPTS[1], max_tokens=8,
                                            temperature=0)
    copied_head.wait_idle()
    with copied_head.http() as http:
        text = http.get("/metrics").text
    stats = copied_head.engine.stats()
    assert f"ktserve_spec_decode_draft_tokens_total {float(stats.draft_tokens)}" in text
    assert f"ktserve_spec_decode_accepted_tokens_total {float(stats.accepted_draft_tokens)}" in text
    assert "ktserve_spec_decode_acceptance_ratio" in text


def test_greedy_replies_are_unchanged_while_drafting_pauses_itself(random_head, plain):
    """The served model with the default `speculative_adaptive` gate, fed step times where drafted steps cost three
    plain ones (real times on this machine decide nothing the test relies on): it drafts, times plain steps,
    pauses, and the reply is still the plain model's."""
    from engines.runtime.draft_gate import MEASURE, DraftGate

    gate = DraftGate()
    record = gate.record
    gate.record = lambda seconds, sequences, drafted, accepted: record(0.03 if drafted else 0.01, sequences,
                                                                       drafted, accepted)
    speculator = random_head.engine._speculator
    random_head.wait_idle()
    before = random_head.engine.stats().draft_tokens
    speculator.gate = gate
    try:
        prompt = random_head.engine.tokenizer.encode(PROMPTS[0])
        assert generate(random_head, prompt, 48) == generate(plain, prompt, 48)
        random_head.wait_idle()
        stats = random_head.engine.stats()
        with random_head.http() as http:
            text = http.get("/metrics").text
    finally:
        speculator.gate = None
    assert stats.draft_tokens - before >= 32  # drafted before it had the evidence to pause
    assert stats.draft_paused and stats.draft_paused_steps > MEASURE
    assert "ktserve_spec_decode_paused 1.0" in text
    assert f"ktserve_spec_decode_paused_steps_total {float(stats.draft_paused_steps)}" in text


def test_the_draft_head_proposes_what_transformers_mtp_layer_predicts(random_head):
    """The random head (both halves of eh_proj matter) against transformers' own MtpModel on the same checkpoint:
    every draft the engine proposed, for the sequence it proposed it after."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    proposed: list[tuple[list[int], int]] = []
    runner = random_head.engine._runner

    def recording(seqs, depths):
        drafts = type(runner).propose(runner, seqs, depths)
        proposed.extend((list(s.token_ids), d[0]) for s, d in zip(seqs, drafts) if d)
        return drafts

    runner.propose = recording
    try:
        for prompt in PROMPTS:
            generate(random_head, random_head.engine.tokenizer.encode(prompt), 6)
    finally:
        del runner.propose
    reference = AutoModelForCausalLM.from_pretrained(random_head.settings.model, dtype=torch.float32).eval()
    reference._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{reference.config.num_hidden_layers}\..*"]
    mtp = MtpModel.from_pretrained(reference, device_map={"": "cpu"}).float().eval()
    clear = 0
    for ids, draft in proposed:
        with torch.inference_mode():
            tokens = torch.tensor([ids])
            hidden = reference(tokens[:, :-1], output_hidden_states=True).hidden_states[-1]
            states = mtp.forward_layer(0, hidden, torch.arange(len(ids) - 1).unsqueeze(0), None,
                                       input_ids=tokens[:, 1:])
            top = mtp._project_to_logits(states[:, -1:])[0, -1].float().topk(2)
        if float(top.values[0] - top.values[1]) > CLEAR_MARGIN:
            clear += 1
            assert draft == int(top.indices[0])
    assert len(proposed) >= 3 * 4 and clear >= len(proposed) // 2


def test_a_checkpoint_without_an_mtp_layer_says_so_and_serves(demo_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="ktserve.engine"):
        running = start_server(demo_model_dir, engine="ktransformers", kt_method=INT8, speculative="mtp")
    try:
        assert any("has no multi-token-prediction layer" in r.getMessage() and "serving without drafting"
                   in r.getMessage() for r in caplog.records)
        reply = running.openai().completions.create(model=running.engine.info.id, prompt="Hello", max_tokens=4)
        assert reply.usage.completion_tokens == 4
        assert running.engine.stats().draft_tokens == 0
    finally:
        running.stop()
