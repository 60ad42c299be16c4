"""Served LoRA adapters give what the adapter merged into the model gives (peft's merge_and_unload run by
transformers in float32), on both engines, for every format; requests for several adapters and the base
run at once without cross-talk.

Measured on the demo model (demo-model-v2, r=4 peft adapters, 10 greedy tokens, ~25 teacher-forced
positions): huggingface engine: every greedy token equal, max |dlogprob| < 1e-3 (float32 both sides).
ktransformers, BF16 experts (expert LoRA in kt-kernel's AMXBF16_SFT_MOE): median |dlogprob| up to 0.09
(all-linear and GGUF adapters), top-1 agreement >= 0.86 - the same level as the base model alone on this
engine (bf16 activations in the kernels; v2 of the demo model is more sensitive than v1, where the
all-linear adapter's greedy text was equal token for token). INT8 experts (AMXInt8_SFT_MOE): median
|dlogprob| 0.19, top-1 agreement 0.905 over 60 positions.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from tests.conftest import start_server
from tests.helpers import require_kt_kernel, forward_logprobs, greedy_reference
from tests.lora_helpers import make_peft_adapter, write_fused_expert_lora, write_gguf_lora

PROMPT = "The river flows through the valley and"
HF_MAX_LOGPROB_DIFF = 1e-3
KT_MEDIAN_LOGPROB_DIFF = 0.15
KT_MIN_TOP1_AGREEMENT = 0.8
GREEDY_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, reference_model):
    """name -> (path, merged reference) for every kind and format."""
    root = tmp_path_factory.mktemp("adapters")
    refs = {}
    for kind in ("attn", "all", "experts"):
        refs[kind] = (root / kind, make_peft_adapter(reference_model, kind, root / kind))
    config = reference_model.config
    fused = write_fused_expert_lora(root / "experts", root / "fused", config.n_routed_experts,
                                    config.moe_intermediate_size)
    refs["fused"] = (fused, refs["experts"][1])
    refs["gguf"] = (write_gguf_lora(root / "all", root / "all.gguf", config.n_routed_experts,
                                    config.moe_intermediate_size), refs["all"][1])
    return refs


@pytest.fixture(scope="module", params=["huggingface", "ktransformers"])
def lora_server(request, demo_model_dir, adapters):
    settings = {"engine": request.param, "adapters": {name: str(p) for name, (p, _) in adapters.items()}}
    if request.param == "ktransformers":
        require_kt_kernel()
        settings["kt_method"] = "BF16"
    running = start_server(demo_model_dir, **settings)
    yield running
    running.stop()


def served(server, adapter, prompt_ids):
    reply = server.openai().completions.create(model=adapter, prompt=prompt_ids, max_tokens=GREEDY_TOKENS,
                                               temperature=0, echo=True, logprobs=1)
    return reply.choices[0]


def check_against(server, tokenizer, choice, reference, prompt_ids):
    served_lp = choice.logprobs.token_logprobs[1:len(prompt_ids)]
    ref_lp = forward_logprobs(reference, prompt_ids)
    diffs = sorted(abs(s - float(ref_lp[i, prompt_ids[i + 1]])) for i, s in enumerate(served_lp))
    expected = tokenizer.decode(greedy_reference(reference, prompt_ids, GREEDY_TOKENS), skip_special_tokens=True)
    if server.engine.name == "huggingface":
        assert diffs[-1] < HF_MAX_LOGPROB_DIFF
        assert choice.text.endswith(expected)
    else:
        top1 = [max(t, key=t.get) for t in choice.logprobs.top_logprobs[1:len(prompt_ids)]]
        agree = sum(top1[i] == tokenizer.decode([int(ref_lp[i].argmax())]) for i in range(len(top1))) / len(top1)
        assert diffs[len(diffs) // 2] < KT_MEDIAN_LOGPROB_DIFF
        assert agree >= KT_MIN_TOP1_AGREEMENT


@pytest.mark.parametrize("name", ["attn", "all", "experts", "fused", "gguf"])
def test_adapter_output_equals_merged_reference(lora_server, adapters, tokenizer, name):
    prompt_ids = tokenizer.encode(PROMPT * 3)
    check_against(lora_server, tokenizer, served(lora_server, name, prompt_ids), adapters[name][1], prompt_ids)


def test_adapters_change_the_output_and_the_base_stays_unchanged(lora_server, adapters, reference_model, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT)
    base = served(lora_server, lora_server.engine.info.id, prompt_ids)
    check_against(lora_server, tokenizer, base, reference_model, prompt_ids)
    assert served(lora_server, "all", prompt_ids).text != base.text


def test_two_adapters_and_the_base_stream_at_once_without_cross_talk(lora_server, adapters, reference_model,
                                                                    tokenizer):
    jobs = [("attn", adapters["attn"][1]), ("all", adapters["all"][1]), (lora_server.engine.info.id, reference_model)]
    client = lora_server.async_openai()
    prompt_ids = tokenizer.encode(PROMPT)

    async def one(model):
        stream = await client.completions.create(model=model, prompt=prompt_ids, max_tokens=GREEDY_TOKENS,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(m) for m, _ in jobs)), timeout=240)

    for (model, reference), text in zip(jobs, asyncio.run(main())):
        expected = greedy_reference(reference, prompt_ids, GREEDY_TOKENS)
        assert text == tokenizer.decode(expected, skip_special_tokens=True), model


def test_listing_names_every_startup_adapter_with_its_parent(lora_server, adapters):
    models = {m.id: m for m in lora_server.openai().models.list().data}
    for name in adapters:
        assert models[name].parent == lora_server.engine.info.id


def teacher_forced_agreement(server, tokenizer, adapter, reference, text):
    """(median |dlogprob|, top-1 agreement) of the served prompt logprobs against the reference's."""
    prompt_ids = tokenizer.encode(text)
    choice = served(server, adapter, prompt_ids)
    ref_lp = forward_logprobs(reference, prompt_ids)
    served_lp = choice.logprobs.token_logprobs[1:len(prompt_ids)]
    diffs = sorted(abs(s - float(ref_lp[i, prompt_ids[i + 1]])) for i, s in enumerate(served_lp))
    top1 = [max(t, key=t.get) for t in choice.logprobs.top_logprobs[1:len(prompt_ids)]]
    agree = sum(top1[i] == tokenizer.decode([int(ref_lp[i].argmax())]) for i in range(len(top1))) / len(top1)
    return diffs[len(diffs) // 2], agree


# 8-bit experts (AMXINT8 with AMXInt8_SFT_MOE for the expert LoRA; FP8 with the LoRA rows in torch on
# avx2) quantize the expert weights, so only teacher-forced agreement is asked for. Measured over 60
# positions: see the module docstring.
INT8_MIN_TOP1_AGREEMENT = 0.85


def test_int8_expert_lora_agrees_with_the_merged_reference(demo_model_dir, adapters, tokenizer):
    require_kt_kernel()
    from engines.kt.experts.methods import best_method

    running = start_server(demo_model_dir, engine="ktransformers", kt_method=best_method(8),
                           adapters={"experts": str(adapters["experts"][0])})
    try:
        median, agree = teacher_forced_agreement(running, tokenizer, "experts", adapters["experts"][1], PROMPT * 6)
        print(f"INT8 experts adapter: median |dlogprob| {median:.4f}, top-1 agreement {agree:.3f}")
        assert agree >= INT8_MIN_TOP1_AGREEMENT
    finally:
        running.stop()
