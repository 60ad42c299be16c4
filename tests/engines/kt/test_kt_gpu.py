"""The KT engine with attention on CUDA and routed experts on the CPU (run on a GPU machine: pytest -m gpu).

Prints the demo model's decode speed; asserts only agreement, never time."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from tests.conftest import start_server
from tests.helpers import (GPU_MEDIAN_LOGPROB_DIFF, GPU_MIN_TOP1_AGREEMENT, chat_prompt_ids, forward_logprobs,
                           greedy_reference)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TEXT = ("The history of the river begins in the mountains, where snow melts each spring and feeds a hundred "
        "small streams. They join in the valley, turn the old mills and slow down in the plain. ") * 6


@pytest.fixture(scope="module")
def kt_gpu(demo_model_dir):
    running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16")
    yield running
    running.stop()


def test_stream_ordered_experts_equal_the_blocking_path():
    from engines.kt.experts.cpu import RoutedExpertsCPU

    torch.manual_seed(0)
    experts = RoutedExpertsCPU(layer_idx=90, num_experts=16, top_k=4, hidden_size=256, intermediate_size=256,
                               method="BF16", max_tokens=64)
    experts.load_weights(*(torch.randn(16, 256, 256, dtype=torch.bfloat16) * 0.05 for _ in range(3)))
    hidden = torch.randn(9, 256, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(9)])
    weights = torch.rand(9, 4)
    on_cpu = experts(hidden, ids, weights)
    on_gpu = experts(hidden.cuda(), ids.cuda(), weights.cuda())
    torch.cuda.synchronize()
    assert on_gpu.is_cuda
    assert torch.equal(on_gpu.cpu(), on_cpu)


def test_a_padded_stream_ordered_call_equals_the_unpadded_blocking_one():
    from engines.kt.experts.cpu import RoutedExpertsCPU

    torch.manual_seed(0)
    weights = [torch.randn(16, 256, 256, dtype=torch.bfloat16) * 0.05 for _ in range(3)]
    layers = []
    for pad_from in (1, 0):
        layer = RoutedExpertsCPU(layer_idx=91, num_experts=16, top_k=4, hidden_size=256, intermediate_size=256,
                                 method="AMXINT8", max_tokens=64, pad_from=pad_from)
        layer.load_weights(*weights)
        layers.append(layer)
    padded, plain = layers
    assert 9 in padded.padded_tokens()

    def call(layer, tokens, device):
        hidden = torch.randn(tokens, 256, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(16)[:4] for _ in range(tokens)])
        weights = torch.rand(tokens, 4)
        return layer(hidden.to(device), ids.to(device), weights.to(device)), (hidden, ids, weights)

    call(padded, 40, "cuda")  # the stream's pinned rows now hold real experts past row 9
    on_gpu, inputs = call(padded, 9, "cuda")
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), plain(*inputs))  # AMXINT8's two paths agree to the bit


def test_padded_decode_steps_give_the_tokens_of_unpadded_ones(demo_model_dir):
    def greedy(pad_from: int) -> list[str]:
        running = start_server(demo_model_dir, engine="ktransformers", kt_method="AMXINT8",
                               kt_expert_pad_from=pad_from)
        try:
            reply = running.openai().chat.completions.create(
                model=running.engine.info.id, messages=[{"role": "user", "content": "Tell me about rivers."}],
                temperature=0, max_tokens=24, n=3, seed=1)
            assert running.engine.info.details.get("expert_pad_from") == (str(pad_from) if pad_from else None)
            return [c.message.content for c in reply.choices]
        finally:
            running.stop()

    assert greedy(1) == greedy(0)  # three sequences a step, padded to the matrix path's 17 rows, in CUDA graphs


def test_attention_runs_on_the_gpu_and_experts_on_the_cpu(kt_gpu):
    runner = kt_gpu.engine._runner
    assert all(d.type == "cuda" for d in runner.layer_devices)
    assert runner._experts, "no routed experts were placed in kt-kernel"


def test_rms_norms_on_the_gpu_run_fused(kt_gpu):
    from engines.kt.placement.operators import FusedRMSNorm

    norms = [m for m in kt_gpu.engine._runner.model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(isinstance(m, FusedRMSNorm) and m.weight.is_cuda for m in norms)


def test_a_fused_rms_norm_is_one_kernel_on_the_gpu():
    from torch.profiler import ProfilerActivity, profile

    from engines.kt.placement.operators import FusedRMSNorm

    norm = FusedRMSNorm(torch.nn.Parameter(torch.rand(2048, dtype=torch.bfloat16, device="cuda")), 1e-6)
    x = torch.randn(4, 2048, dtype=torch.bfloat16, device="cuda")
    norm(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        norm(x)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, [e.name for e in kernels]


def test_gpu_prompt_logprobs_agree_with_transformers(kt_gpu, tokenizer, reference_model):
    ids = tokenizer.encode(tokenizer.decode(tokenizer.encode(TEXT)[:300], skip_special_tokens=True))
    reply = kt_gpu.openai().completions.create(model=kt_gpu.engine.info.id, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = reply.choices[0].logprobs
    reference = forward_logprobs(reference_model, ids)
    diffs = sorted(abs(lp.token_logprobs[i] - float(reference[i - 1, ids[i]])) for i in range(1, len(ids)))
    agree = sum(max(lp.top_logprobs[i], key=lp.top_logprobs[i].get) ==
                tokenizer.decode([int(reference[i - 1].argmax())]) for i in range(1, len(ids))) / (len(ids) - 1)
    print(json.dumps({"gpu_median_logprob_diff": diffs[len(diffs) // 2], "gpu_top1_agreement": agree}))
    assert diffs[len(diffs) // 2] < GPU_MEDIAN_LOGPROB_DIFF
    assert agree >= GPU_MIN_TOP1_AGREEMENT


def test_gpu_greedy_tokens_agree_with_transformers(kt_gpu, tokenizer, reference_model):
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    reply = kt_gpu.openai().chat.completions.create(model=kt_gpu.engine.info.id, messages=messages,
                                                    temperature=0, max_tokens=32, logprobs=True)
    served = [e.token for e in reply.choices[0].logprobs.content]
    expected = greedy_reference(reference_model, chat_prompt_ids(tokenizer, messages), 32)
    same = next((i for i, (a, b) in enumerate(zip(served, [tokenizer.decode([t]) for t in expected])) if a != b), 32)
    print(json.dumps({"gpu_greedy_identical_prefix": same}))
    assert same >= 16


def test_demo_decode_speed_is_reported(kt_gpu):
    from engines.base import GenerationRequest, SamplingParams

    async def decode() -> dict:
        prompt = kt_gpu.engine.tokenizer.encode("Hello")
        handle = kt_gpu.engine.submit(GenerationRequest(prompt_token_ids=prompt, sampling=SamplingParams(
            max_tokens=128, temperature=0, ignore_eos=True)))
        first = last = None
        count = 0
        async for out in handle:
            now = time.perf_counter()
            first = first or now
            last = now
            count += len(out.token_ids)
        return {"demo_decode_tokens_per_s": (count - 1) / (last - first)}

    figures = asyncio.run(asyncio.wait_for(decode(), timeout=120))
    print(json.dumps(figures))
    assert figures["demo_decode_tokens_per_s"] > 0



def test_cuda_graph_decode_equals_eager_decode(demo_model_dir):
    def greedy(**settings):
        running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16", **settings)
        try:
            reply = running.openai().chat.completions.create(
                model=running.engine.info.id, messages=[{"role": "user", "content": "Tell me about rivers."}],
                temperature=0, max_tokens=24, n=3, seed=1)
            return [c.message.content for c in reply.choices]
        finally:
            running.stop()

    assert greedy(kt_use_cuda_graph=True) == greedy(kt_use_cuda_graph=False)


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_step_times_measure_the_gpu_stream_waiting_on_cpu_experts(demo_model_dir, graphs):
    running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16", kt_use_cuda_graph=graphs)
    try:
        before = running.engine.stats()
        running.openai().completions.create(model=running.engine.info.id, prompt="Hello", max_tokens=16,
                                            temperature=0)
        running.wait_idle()
        after = running.engine.stats()
    finally:
        running.stop()
    step, wait, expert, gpu = (getattr(after.times, k) - getattr(before.times, k)
                               for k in ("step", "expert_wait", "expert", "gpu"))
    print(json.dumps({"graphs": graphs, "step_s": step, "gpu_s": gpu, "expert_wait_s": wait, "expert_s": expert}))
    assert gpu > 0 and 0 < wait <= expert
    assert gpu + wait <= step
