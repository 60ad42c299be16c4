"""Batch-invariant requests with attention on the GPU (CUDA graphs, FlashInfer where installed) and routed experts on
the CPU: a scored prompt and a completion with logprobs get the bits they get alone beside other requests (run on a
GPU machine: pytest -m gpu)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import start_server
from tests.helpers import INVARIANCE_PROMPT, alone_and_beside

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TARGET = INVARIANCE_PROMPT


@pytest.fixture(scope="module")
def kt_gpu(demo_model_dir):
    running = start_server(demo_model_dir, engine="ktransformers", max_concurrent=16)
    yield running
    running.stop()


@pytest.mark.parametrize("neighbours", [1, 3, 15])
def test_a_scored_prompt_gets_the_bits_it_gets_alone_beside_other_requests_on_the_gpu(kt_gpu, neighbours):
    alone, beside = alone_and_beside(kt_gpu, {"prompt": TARGET, "max_tokens": 0, "echo": True, "logprobs": 1},
                                     neighbours)
    assert beside["logprobs"]["token_logprobs"] == alone["logprobs"]["token_logprobs"]


def test_a_completion_with_logprobs_decodes_the_same_bits_beside_other_requests_on_the_gpu(kt_gpu):
    alone, beside = alone_and_beside(kt_gpu, {"prompt": TARGET, "max_tokens": 12, "temperature": 0, "logprobs": 0},
                                     15)
    assert beside["text"] == alone["text"]
    assert beside["logprobs"]["token_logprobs"] == alone["logprobs"]["token_logprobs"]


def test_a_v4_scored_prompt_gets_the_bits_it_gets_alone_beside_other_requests_on_the_gpu(v4_model_dir):
    running = start_server(v4_model_dir, engine="ktransformers", max_concurrent=8)
    try:
        alone, beside = alone_and_beside(running, {"prompt": TARGET, "max_tokens": 0, "echo": True, "logprobs": 1},
                                         3)
    finally:
        running.stop()
    assert beside["logprobs"]["token_logprobs"] == alone["logprobs"]["token_logprobs"]
