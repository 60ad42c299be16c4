"""Batch-invariant requests (engines/runtime/batch_invariance.py): a request that returns logprobs or scores gets
the same bits alone and beside any other requests, on the ktransformers engine (CPU here; the GPU machine runs
tests/engines/runtime/test_batch_invariance_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import start_server
from tests.helpers import INVARIANCE_PROMPT, alone_and_beside, require_kt_kernel

require_kt_kernel()

from engines.kt.experts.cpu import RoutedExpertsCPU  # noqa: E402
from engines.kt.experts.methods import available_methods  # noqa: E402

TARGET = INVARIANCE_PROMPT


@pytest.fixture(scope="module")
def kt(demo_model_dir):
    running = start_server(demo_model_dir, engine="ktransformers", max_concurrent=16)
    yield running
    running.stop()


@pytest.mark.parametrize("method", available_methods())
def test_kt_kernel_computes_a_row_alike_at_every_call_size(method):
    """Why the experts need no special path: each row's output is the same bits alone and among 1-99 other rows,
    wherever it sits among them (kt-kernel's vector and matrix paths both)."""
    experts_count, top_k, hidden_size = 16, 4, 256
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(experts_count, hidden_size, hidden_size, generator=g) / 16).bfloat16() for _ in range(3)]
    experts = RoutedExpertsCPU(layer_idx=0, num_experts=experts_count, top_k=top_k, hidden_size=hidden_size,
                               intermediate_size=hidden_size, method=method, max_tokens=128)
    experts.load_weights(*weights)
    hidden = torch.randn(100, hidden_size, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(experts_count, generator=g)[:top_k] for _ in range(100)])
    routing = torch.rand(100, top_k, generator=g)
    alone = experts(hidden[:1], ids[:1], routing[:1])[0]
    for n in (2, 4, 17, 43, 100):
        assert torch.equal(experts(hidden[:n], ids[:n], routing[:n])[0], alone), f"first of {n}"
        last = [torch.cat([t[1:n], t[:1]]) for t in (hidden, ids, routing)]
        assert torch.equal(experts(*last)[-1], alone), f"last of {n}"


@pytest.mark.parametrize("neighbours", [1, 3, 15])
def test_a_scored_prompt_gets_the_bits_it_gets_alone_beside_other_requests(kt, neighbours):
    alone, beside = alone_and_beside(kt, {"prompt": TARGET, "max_tokens": 0, "echo": True, "logprobs": 1},
                                     neighbours)
    assert beside["logprobs"]["token_logprobs"] == alone["logprobs"]["token_logprobs"]


def test_a_completion_with_logprobs_decodes_the_same_tokens_and_bits_beside_other_requests(kt):
    request = {"prompt": TARGET, "max_tokens": 12, "temperature": 0, "logprobs": 0}
    alone, beside = alone_and_beside(kt, request, 15)
    assert beside["text"] == alone["text"]
    assert beside["logprobs"]["token_logprobs"] == alone["logprobs"]["token_logprobs"]


def test_an_embedding_is_the_same_bits_alone_and_among_other_inputs(kt):
    client = kt.openai()
    alone = client.embeddings.create(model=kt.engine.info.id, input=TARGET).data[0].embedding
    among = client.embeddings.create(model=kt.engine.info.id, input=["A short one.", TARGET, TARGET * 3]).data
    assert among[1].embedding == alone


def test_the_version_says_which_requests_are_batch_invariant(kt):
    assert kt.engine.info.details["batch_invariant"] == "scores"


def test_an_unknown_batch_invariant_setting_is_refused_naming_the_key(demo_model_dir):
    from server.settings import load_settings

    with pytest.raises(ValueError, match="batch_invariant"):
        load_settings(None, {"model": str(demo_model_dir), "batch_invariant": "sometimes"}, env={})


def test_a_v4_scored_prompt_gets_the_bits_it_gets_alone_beside_other_requests(v4_server):
    alone, beside = alone_and_beside(v4_server, {"prompt": TARGET, "max_tokens": 0, "echo": True, "logprobs": 1},
                                     3)
    assert beside["logprobs"]["token_logprobs"] == alone["logprobs"]["token_logprobs"]
