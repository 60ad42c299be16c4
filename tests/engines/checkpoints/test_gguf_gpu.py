"""A GGUF checkpoint on a GPU machine (pytest -m gpu): attention and the other dequantized weights on CUDA in
bf16, the routed experts read in place by kt-kernel's llamafile kernel on the CPU. Asserts agreement with
transformers on the dequantized weights; prints the figures as JSON."""
from __future__ import annotations

import json
import statistics

import pytest
import torch

from tests.conftest import start_server
from .test_gguf_checkpoint import logprob_diffs, reference_on

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# bf16 on the GPU adds its rounding to the kernel's 8-bit activations: test_kt_gpu.py's bound for BF16 experts
# on the safetensors demo model is a median of 0.1.
GPU_MEDIAN_LOGPROB_DIFF = 0.1


@pytest.fixture(scope="module")
def gguf_on_gpu(tmp_path_factory):
    from engines.demo_model import write_demo_gguf

    parts = write_demo_gguf(tmp_path_factory.mktemp("gguf-gpu"), {"experts": "Q4_K"}, split=True)
    running = start_server(parts[0], engine="ktransformers")
    yield running, parts
    running.stop()


def test_gguf_on_gpu_reads_experts_in_place_and_attention_on_cuda(gguf_on_gpu):
    server, _ = gguf_on_gpu
    details = server.engine.info.details
    assert details["experts_method"] == "LLAMAFILE"
    assert server.engine.info.checkpoint.summary().startswith("experts Q4_K in place (llamafile); attention bf16 "
                                                               "from Q8_0; ")
    attention = server.engine._runner.model.model.layers[0].self_attn
    assert next(attention.parameters()).is_cuda


def test_gguf_on_gpu_prompt_logprobs_agree_with_transformers(gguf_on_gpu):
    server, parts = gguf_on_gpu
    diffs = logprob_diffs(server.url, server.engine.info.id, server.engine.tokenizer, reference_on(parts[0]))
    print(json.dumps({"gguf_gpu_median_logprob_diff": statistics.median(diffs), "gguf_gpu_max_logprob_diff":
                      max(diffs)}))
    assert statistics.median(diffs) < GPU_MEDIAN_LOGPROB_DIFF


def test_gguf_on_gpu_decodes_greedily_as_often_as_asked(gguf_on_gpu):
    server, _ = gguf_on_gpu
    replies = [server.openai().chat.completions.create(model=server.engine.info.id, temperature=0, max_tokens=24,
                                                       messages=[{"role": "user", "content": "Tell me about rivers."}])
               for _ in range(2)]
    assert replies[0].usage.completion_tokens == 24
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
