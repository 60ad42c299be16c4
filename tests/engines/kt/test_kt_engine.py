"""The ktransformers engine on the demo model, CPU only: attention (MLA over the latent cache) in torch,
routed experts in kt-kernel. It must agree with transformers run directly on the same checkpoint."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import start_server
from tests.helpers import require_kt_kernel, chat_prompt_ids, forward_logprobs, greedy_reference

require_kt_kernel()

from engines.kt.experts.methods import best_method  # noqa: E402

# The 8-bit experts method of this CPU's kt-kernel build: AMXINT8 where the build has it, FP8 on avx2.
INT8 = best_method(8)

# kt-kernel's BF16 kernels round activations to bf16 while transformers on the CPU computes in float32, so
# prompt logprobs differ a little everywhere and more where a routing decision flips on a near-tie.
# Measured on demo-model-v3 over 1,016 teacher-forced positions: top-1 agreement 99.6% (BF16) and 98.7%
# (INT8); 6/6 (BF16) and 5/6 (INT8) greedy 32-token completions identical. The bounds below leave room for
# thread-count differences.
BF16_MEDIAN_LOGPROB_DIFF = 0.03
BF16_MIN_TOP1_AGREEMENT = 0.98
INT8_MIN_TOP1_AGREEMENT = 0.95
LONG_TEXT = ("The history of the river begins in the mountains, where snow melts each spring and feeds a "
             "hundred small streams. They join in the valley, turn the old mills, pass the market towns and "
             "slow down in the plain, where farmers have dug canals for a thousand years. ") * 6


@pytest.fixture(scope="module")
def kt_bf16(demo_model_dir):
    running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def kt_int8(demo_model_dir):
    running = start_server(demo_model_dir, engine="ktransformers", kt_method=INT8)
    yield running
    running.stop()


def prompt_logprobs(server, text: str | list[int], top: int = 1):
    reply = server.openai().completions.create(model=server.engine.info.id, prompt=text, max_tokens=0,
                                               echo=True, logprobs=top)
    return reply.choices[0].logprobs


def teacher_forced(server, tokenizer, reference_model, length: int):
    """The served prompt logprobs of a long text and transformers' full forward pass over the same ids."""
    text = tokenizer.decode(tokenizer.encode(LONG_TEXT)[:length], skip_special_tokens=True)
    ids = tokenizer.encode(text)
    # the ids, BOS included, so the echoed logprobs line up with them (a text prompt's added BOS is not echoed)
    return ids, prompt_logprobs(server, ids), forward_logprobs(reference_model, ids)


def top1_agreement(tokenizer, ids, served, reference) -> float:
    agree = 0
    for i in range(1, len(ids)):
        served_best = max(served.top_logprobs[i], key=served.top_logprobs[i].get)
        agree += served_best == tokenizer.decode([int(reference[i - 1].argmax())])
    return agree / (len(ids) - 1)


def test_bf16_prompt_logprobs_match_transformers(kt_bf16, tokenizer, reference_model):
    ids, served, reference = teacher_forced(kt_bf16, tokenizer, reference_model, 300)
    diffs = sorted(abs(served.token_logprobs[i] - float(reference[i - 1, ids[i]])) for i in range(1, len(ids)))
    assert diffs[len(diffs) // 2] < BF16_MEDIAN_LOGPROB_DIFF
    assert top1_agreement(tokenizer, ids, served, reference) >= BF16_MIN_TOP1_AGREEMENT


def test_bf16_greedy_32_tokens_equal_transformers(kt_bf16, tokenizer, reference_model):
    for content in ("Tell me about rivers.", "Write a haiku about the sea.", "1, 2, 3,"):
        messages = [{"role": "user", "content": content}]
        reply = kt_bf16.openai().chat.completions.create(model=kt_bf16.engine.info.id, messages=messages,
                                                         temperature=0, max_tokens=32)
        expected = greedy_reference(reference_model, chat_prompt_ids(tokenizer, messages), 32)
        assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)


def test_int8_teacher_forced_top1_agrees_with_transformers(kt_int8, tokenizer, reference_model):
    ids, served, reference = teacher_forced(kt_int8, tokenizer, reference_model, 300)
    assert len(ids) - 1 >= 256
    assert top1_agreement(tokenizer, ids, served, reference) >= INT8_MIN_TOP1_AGREEMENT


def test_prompt_longer_than_chunk_size_gives_the_one_chunk_output(demo_model_dir, tokenizer, reference_model):
    running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16", chunk_size=16)
    try:
        messages = [{"role": "user", "content": LONG_TEXT[:400]}]
        prompt = chat_prompt_ids(tokenizer, messages)
        assert len(prompt) > 3 * 16
        reply = running.openai().chat.completions.create(model=running.engine.info.id, messages=messages,
                                                         temperature=0, max_tokens=16)
        expected = greedy_reference(reference_model, prompt, 16)
        assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    finally:
        running.stop()


def test_requests_beyond_kt_maxlen_are_400(demo_model_dir):
    running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16", max_model_len=64)
    try:
        with running.http() as http:
            r = http.post("/v1/completions", json={"prompt": LONG_TEXT, "max_tokens": 4})
        assert r.status_code == 400 and "64" in r.json()["error"]["message"]
    finally:
        running.stop()


def test_kv_cache_is_all_free_after_requests(kt_bf16):
    kt_bf16.openai().completions.create(model=kt_bf16.engine.info.id, prompt="Hello", max_tokens=5)
    kt_bf16.wait_idle()
    assert kt_bf16.engine.stats().kv_used_tokens == 0


def test_step_times_split_the_wait_on_cpu_experts_from_the_rest(kt_bf16):
    before = kt_bf16.engine.stats()
    kt_bf16.openai().completions.create(model=kt_bf16.engine.info.id, prompt="Hello", max_tokens=6)
    kt_bf16.wait_idle()
    after = kt_bf16.engine.stats()
    step, wait, expert = (getattr(after.times, k) - getattr(before.times, k)
                          for k in ("step", "expert_wait", "expert"))
    # without a GPU the experts block Python: the wait is part of the experts' time, both part of the steps
    assert 0 < wait <= expert < step
    assert after.times.gpu == 0


def test_weight_cache_skips_quantization_and_serves_the_same(demo_model_dir, tmp_path):
    def scores():
        running = start_server(demo_model_dir, engine="ktransformers", kt_method=INT8,
                               kt_weight_cache=str(tmp_path))
        try:
            return prompt_logprobs(running, LONG_TEXT[:300]).token_logprobs
        finally:
            running.stop()

    first = scores()
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written and any(p.suffix in (".kt", ".safetensors") for p in (tmp_path / written[0]).rglob("*"))
    assert scores() == first


def test_without_a_gpu_prompts_keep_their_experts_on_the_cpu_in_2048_token_chunks_by_default(kt_bf16):
    assert kt_bf16.engine.info.details["gpu_prefill_tokens"] == ("0: every routed expert of a prompt on the CPU (no GPU "
                                                                 "in the placement)")
    assert kt_bf16.engine.config.chunk_size == 2048


def test_streamed_experts_without_a_gpu_say_so_and_serve_from_the_cpu(demo_model_dir, caplog):
    with caplog.at_level("WARNING", logger="ktserve.engine.kt"):
        running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16", kt_gpu_prefill_tokens=16)
    try:
        assert "kt_gpu_prefill_tokens=16: no CPU-expert layer sends its output to a GPU" in caplog.text
        assert running.engine.info.details["gpu_prefill_tokens"].startswith("0: ")
        assert prompt_logprobs(running, LONG_TEXT[:300]).token_logprobs[1] < 0
    finally:
        running.stop()


def test_experts_asked_into_gpu_memory_without_a_gpu_say_so_and_serve_from_the_cpu(demo_model_dir, caplog):
    with caplog.at_level("WARNING", logger="ktserve.engine.kt"):
        running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16", kt_gpu_resident_experts=4)
    try:
        assert "kt_gpu_resident_experts=4: no CPU-expert layer sends its output to a GPU" in caplog.text
        assert running.engine.info.details["gpu_resident_experts"] == "0"
        assert prompt_logprobs(running, LONG_TEXT[:300]).token_logprobs[1] < 0
    finally:
        running.stop()


def test_a_streaming_budget_too_small_for_one_expert_says_so_and_serves_from_the_cpu(demo_model_dir, caplog):
    with caplog.at_level("WARNING", logger="ktserve.engine.kt"):
        running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16", kt_gpu_prefill_tokens=16,
                               kt_gpu_prefill_memory=1e-6)
    try:
        assert "kt_gpu_prefill_memory=1e-06 GB holds no expert's copy" in caplog.text
        assert "no CPU-expert layer sends its output to a GPU" not in caplog.text  # said once, for the budget
        assert "gpu_prefill_experts" not in running.engine.info.details
        assert prompt_logprobs(running, LONG_TEXT[:300]).token_logprobs[1] < 0
    finally:
        running.stop()


def test_decode_steps_padded_to_the_matrix_kernels_give_the_unpadded_tokens(demo_model_dir):
    from engines.kt.experts.methods import pads_to_matrix

    if not pads_to_matrix(INT8):
        pytest.skip(f"this build's {INT8} kernel has no matrix switch to pad across")

    def greedy(pad_from: int) -> tuple[list[str], str | None]:
        running = start_server(demo_model_dir, engine="ktransformers", kt_method=INT8, kt_expert_pad_from=pad_from,
                               kt_decode_kernel="off")  # decode steps of three rows: kt-kernel's to pad
        try:
            reply = running.openai().chat.completions.create(
                model=running.engine.info.id, messages=[{"role": "user", "content": "Tell me about rivers."}],
                temperature=0, max_tokens=16, n=3, seed=1)
            return [c.message.content for c in reply.choices], running.engine.info.details.get("expert_pad_from")
        finally:
            running.stop()

    padded, plain = greedy(1), greedy(0)
    assert (padded[1], plain[1]) == ("1", None)  # /version says from how many tokens calls go padded
    assert padded[0] == plain[0]  # steps of three sequences went padded to the 17 rows of the matrix path


def test_router_weights_stay_float32_in_a_bf16_model_as_transformers_keeps_them(demo_model_dir):
    running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16", dtype="bfloat16")
    try:
        layers = running.engine._runner.model.model.layers
        moe = [layer.mlp for layer in layers if hasattr(layer.mlp, "gate")]
        assert moe and all(m.gate.weight.dtype == torch.float32 for m in moe)
        assert layers[0].self_attn.o_proj.weight.dtype == torch.bfloat16
        reply = running.openai().completions.create(model=running.engine.info.id, prompt="Rivers", max_tokens=4,
                                                    temperature=0, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 4
    finally:
        running.stop()
