"""Streamed experts on a GPU (`kt_gpu_prefill_tokens`, engines/kt/experts/streaming.py): prompt chunks split
each layer's routed experts between the GPU (int8 weights streamed from pinned host memory) and kt-kernel
(run on a GPU machine: pytest -m gpu). Asserts agreement, never time."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.conftest import start_server
from tests.helpers import forward_logprobs
from tests.engines.kt.test_kt_gpu import GPU_MEDIAN_LOGPROB_DIFF, GPU_MIN_TOP1_AGREEMENT, TEXT

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def experts_layer(streamer, layer_idx=90, held=None):
    from engines.kt.experts.cpu import RoutedExpertsCPU

    torch.manual_seed(0)
    experts = RoutedExpertsCPU(layer_idx=layer_idx, num_experts=24, top_k=4, hidden_size=256,
                               intermediate_size=256, method="BF16", max_tokens=64, gpu_device="cuda",
                               streamer=streamer, stream_tokens=8, stream_experts=held)
    experts.load_weights(*(torch.randn(24, 256, 256, dtype=torch.bfloat16) * 0.05 for _ in range(3)))
    return experts


def routed(tokens):
    hidden = torch.randn(tokens, 256, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(24)[:4] for _ in range(tokens)])
    return hidden, ids, torch.rand(tokens, 4)


@pytest.mark.parametrize("pcie_share", [1.0, 0.5], ids=["all-on-the-gpu", "split-with-the-cpu"])
def test_a_streamed_chunk_equals_the_experts_on_the_cpu(pcie_share):
    from engines.kt.experts.streaming import ExpertStreamer

    streamer = ExpertStreamer(torch.device("cuda"))
    experts, alone = experts_layer(streamer), experts_layer(None, layer_idx=91)  # the same weights, no streamer
    # the split follows the copy rate: make copying free, or take about as long as the CPU side (0.4 ms)
    streamer.pcie_bytes_per_s = float("inf") if pcie_share == 1.0 else 1e10  # ~ the CPU side's time
    hidden, ids, weights = routed(40)
    on_cpu = alone(hidden, ids, weights).float()  # a layer with a streamer streams CPU inputs' chunks too
    split = experts._streamed_experts(40)
    on_gpu = experts(hidden.cuda(), ids.cuda(), weights.cuda()).float().cpu()
    assert (split == 24) if pcie_share == 1.0 else (0 < split < 24)
    assert streamer.stats.experts == split
    assert (on_gpu - on_cpu).norm() <= 2e-2 * on_cpu.norm()


def test_a_chunk_streams_only_the_experts_a_budget_holds_and_equals_the_cpu():
    from engines.kt.experts.streaming import ExpertStreamer

    streamer = ExpertStreamer(torch.device("cuda"))
    experts = experts_layer(streamer, held=10)  # kt_gpu_prefill_memory: copies of the first 10 of 24
    alone = experts_layer(None, layer_idx=91)
    streamer.pcie_bytes_per_s = float("inf")  # the balance alone would give the GPU all 24
    hidden, ids, weights = routed(40)
    on_cpu = alone(hidden, ids, weights).float()
    on_gpu = experts(hidden.cuda(), ids.cuda(), weights.cuda()).float().cpu()
    assert experts._streamed_experts(40) == 10 and streamer.stats.experts == 10
    assert (on_gpu - on_cpu).norm() <= 2e-2 * on_cpu.norm()


def test_decode_sized_calls_stay_on_the_cpu():
    from engines.kt.experts.streaming import ExpertStreamer

    streamer = ExpertStreamer(torch.device("cuda"))
    experts = experts_layer(streamer)
    hidden, ids, weights = routed(4)  # below stream_tokens
    experts(hidden.cuda(), ids.cuda(), weights.cuda())
    torch.cuda.synchronize()
    assert streamer.stats.chunks == 0


@pytest.fixture(scope="module")
def streamed_server(demo_model_dir):
    running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16", kt_gpu_prefill_tokens=16)
    yield running
    running.stop()


def test_prompt_logprobs_with_streamed_experts_agree_with_transformers(streamed_server, tokenizer,
                                                                     reference_model):
    from engines.kt.experts.cpu import RoutedExpertsCPU

    layers = [m for m in streamed_server.engine._runner.model.modules()
              if isinstance(m, RoutedExpertsCPU) and m.streamer is not None]
    assert layers, "no expert layer streams to the GPU"
    streamer = layers[0].streamer
    before = streamer.stats.chunks
    ids = tokenizer.encode(tokenizer.decode(tokenizer.encode(TEXT)[:300], skip_special_tokens=True))
    reply = streamed_server.openai().completions.create(
        model=streamed_server.engine.info.id, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    lp = reply.choices[0].logprobs
    reference = forward_logprobs(reference_model, ids)
    diffs = sorted(abs(lp.token_logprobs[i] - float(reference[i - 1, ids[i]])) for i in range(1, len(ids)))
    agree = sum(max(lp.top_logprobs[i], key=lp.top_logprobs[i].get) ==
                tokenizer.decode([int(reference[i - 1].argmax())]) for i in range(1, len(ids))) / (len(ids) - 1)
    print(json.dumps({"streamed_median_logprob_diff": diffs[len(diffs) // 2], "streamed_top1_agreement": agree,
                      "streamed_layer_calls": streamer.stats.chunks - before}))
    assert streamer.stats.chunks - before == len(layers)  # one prompt chunk: every layer streamed once
    text = httpx.get(streamed_server.url + "/metrics", timeout=10).text
    metrics = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("ktserve_streamed_expert"))
    assert float(metrics["ktserve_streamed_expert_calls_total"]) == streamer.stats.chunks
    assert float(metrics["ktserve_streamed_expert_bytes_total"]) == streamer.stats.bytes > 0
    assert diffs[len(diffs) // 2] < GPU_MEDIAN_LOGPROB_DIFF
    assert agree >= GPU_MIN_TOP1_AGREEMENT


@pytest.fixture(scope="module")
def decode_streaming_server(demo_model_dir):
    # its requests ask for logprobs yet must share decode steps, which batch-invariant requests never do
    running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16", kt_gpu_prefill_tokens=4,
                           max_concurrent=8, batch_invariant="off")
    yield running
    running.stop()


def test_decode_steps_of_enough_sequences_stream_their_experts_outside_the_graphs(decode_streaming_server,
                                                                                  monkeypatch):
    from engines.kt.experts.cpu import RoutedExpertsCPU

    server = decode_streaming_server
    runner = server.engine._runner
    assert runner.graphs.batch_sizes[-1] == 3  # steps of 4 or more sequences run eagerly
    layers = [m for m in runner.model.modules() if isinstance(m, RoutedExpertsCPU) and m.streamer is not None]
    streamer = layers[0].streamer
    # steps of fewer sequences replay graphs in which the GPU reads its share of the experts from host memory
    # (kt_gpu_read_experts, on by default): the lone sequence below is decoded that way
    assert all(layer.mapped_experts(1) > 0 for layer in layers)
    # every step the runner takes: (tokens, all of them decode tokens, replayed from a CUDA graph, layer calls
    # that streamed experts). A layer call streams only when one of the step's tokens chose an expert of the
    # GPU's share, and six greedy choices of one prompt route alike, so a six-sequence step streamed in 1-3 of
    # the demo model's 3 MoE layers (H100, 2026-11-25: 24 to 36 streamed calls over 15 such steps).
    steps: list[tuple[int, bool, bool, int]] = []
    execute = runner.execute

    def recorded(chunks):
        calls = streamer.stats.chunks
        out = execute(chunks)
        steps.append((sum(c.num_tokens for c in chunks), all(c.num_tokens == 1 for c in chunks), runner._replayed,
                      streamer.stats.chunks - calls))
        return out
    monkeypatch.setattr(runner, "execute", recorded)

    def greedy(n: int) -> list[list[float]]:
        # ignore_eos: each sequence decodes its 16 tokens, whatever it picks
        reply = server.openai().completions.create(model=server.engine.info.id, prompt=TEXT[:200], max_tokens=16,
                                                   n=n, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
        return [c.logprobs.token_logprobs for c in reply.choices]

    alone = greedy(1)[0]  # one sequence: graph replays, experts on the CPU and read from host memory
    assert steps[0][3] == len(layers)  # the prompt's chunk streamed in every layer
    assert all(replayed and calls == 0 for _, decoding, replayed, calls in steps[1:] if decoding)
    steps.clear()
    together = greedy(6)  # six sequences a step: eager, part of the experts streamed to the GPU
    print(json.dumps({"tokens": [len(t) for t in together], "steps": steps}))
    wide = [(replayed, calls) for tokens, decoding, replayed, calls in steps if decoding and tokens >= 4]
    assert len(wide) >= 5  # six sequences of 16 tokens: most of their steps decode four or more together
    assert not any(replayed for replayed, _ in wide)
    assert sum(calls for _, calls in wide) >= len(wide)
    # a greedy choice matches the lone sequence while their tokens agree (int8 experts on the GPU against bf16
    # ones on the CPU)
    same = next((k for k, (a, b) in enumerate(zip(alone, together[0])) if abs(a - b) > 0.5), len(alone))
    diffs = sorted(abs(a - b) for a, b in zip(alone[:same], together[0][:same]))
    print(json.dumps({"decode_streamed_same_positions": same, "median_diff": diffs[len(diffs) // 2]}))
    assert same >= 4 and diffs[len(diffs) // 2] < GPU_MEDIAN_LOGPROB_DIFF
