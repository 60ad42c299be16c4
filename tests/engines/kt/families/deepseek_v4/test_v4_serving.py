"""DeepSeek-V4 as released, served by the ktransformers engine on the CPU and checked against transformers'
`DeepseekV4ForCausalLM` in float32 on the dequantized weights (tests/engines/kt/families/deepseek_v4/v4_helpers.py): a
tiny random V4 in the released layout (original names, FP8 + UE8M0, MXFP4 experts, an MTP layer, hash tables), a real
server, the official client. Prompts are long enough (> 128 tokens) to reach the heavily compressed layer's first
entry."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from .v4_helpers import (V4_LOGPROB_TOLERANCE, V4_NEAR_TIE_TOLERANCE, Choices, diffs_off_and_on_ties,
                        flipped_near_ties, reference_logprobs, v4_reference_model)

ROOT = Path(__file__).resolve().parents[5]
PROMPT = ("The old lighthouse keeper counted the ships that passed each night, writing their names in a "
          "leather book whose pages had turned yellow with salt and time. ") * 5
OTHER_PROMPT = "Seventeen ravens sat on the fence behind the mill, and the miller's daughter gave each a name. " * 3


@pytest.fixture(scope="module")
def v4_reference(v4_model_dir):
    return v4_reference_model(v4_model_dir)


def complete(server, **kwargs):
    kwargs.setdefault("model", server.engine.info.id)
    kwargs.setdefault("temperature", 0)
    return server.openai().completions.create(**kwargs)


def test_v4_loads_through_its_family_with_mxfp4_experts(v4_server):
    details = v4_server.engine.info.details
    assert v4_server.engine.info.architecture == "DeepseekV4ForCausalLM"
    assert details["model_family"] == "deepseek_v4" and details["experts_method"] == "MXFP4"
    assert details["kt_optimize_rule"] == "DeepSeek-V4-CPU.yaml"


def test_v4_hyper_connections_on_the_cpu_keep_transformers_forward(v4_server):
    from engines.kt.families.deepseek_v4.hyper import is_fused

    assert v4_server.engine.info.details["hyper_connections"] == "transformers' modules: none on a GPU"
    layer = v4_server.engine._runner.model.model.layers[0]
    assert not is_fused(layer.attn_hc) and not is_fused(layer.ffn_hc)


def test_v4_prompt_logprobs_match_the_transformers_reference(v4_server, v4_reference):
    """Within rounding, but where the served model's top-k picked otherwise at one of the reference's near ties
    (v4_helpers: V4_NEAR_TIE_GAP), which happens at few positions."""
    ids = v4_server.engine.tokenizer.encode(PROMPT)
    assert len(ids) > 128
    with Choices(v4_server.engine._runner.model) as served_choices:
        reply = complete(v4_server, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    with Choices(v4_reference, gaps=True) as reference_choices:
        reference = reference_logprobs(v4_reference, ids)
    ties = flipped_near_ties(served_choices, reference_choices)
    off, on = diffs_off_and_on_ties(reply.choices[0].logprobs.token_logprobs, reference, ids, ties)
    assert max(off) < V4_LOGPROB_TOLERANCE
    assert max(on, default=0.0) < V4_NEAR_TIE_TOLERANCE and len(on) <= len(ids) // 20


def test_v4_greedy_decode_and_its_logprobs_match_the_reference(v4_server, v4_reference):
    """Decoding runs the cached path (one token a step over the per-sequence V4 cache)."""
    ids = v4_server.engine.tokenizer.encode(PROMPT)
    reply = complete(v4_server, prompt=ids, max_tokens=10, logprobs=1)
    with torch.inference_mode():
        expected = v4_reference.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):]
    assert reply.choices[0].text == v4_server.engine.tokenizer.decode(expected)
    full = ids + expected.tolist()
    reference = reference_logprobs(v4_reference, full)
    served = reply.choices[0].logprobs.token_logprobs
    for k, logprob in enumerate(served):
        position = len(ids) + k
        assert logprob == pytest.approx(float(reference[position - 1, full[position]]), abs=V4_LOGPROB_TOLERANCE)


def test_v4_streamed_completion_equals_the_non_streamed_one(v4_server):
    whole = complete(v4_server, prompt=PROMPT, max_tokens=8).choices[0].text
    chunks = list(complete(v4_server, prompt=PROMPT, max_tokens=8, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole


def test_v4_two_requests_batched_together_equal_their_solo_runs(v4_server):
    solo = [complete(v4_server, prompt=p, max_tokens=8).choices[0].text for p in (PROMPT, OTHER_PROMPT)]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda p: complete(v4_server, prompt=p, max_tokens=8).choices[0].text,
                                 (PROMPT, OTHER_PROMPT)))
    assert together == solo


def test_v4_on_the_avx2_build_logprobs_match_the_reference(v4_model_dir):
    """kt-kernel's avx2 build (AVX2MXFP4_MOE), in a child process: prompt chunks then decode steps."""
    env = {**os.environ, "KT_KERNEL_CPU_VARIANT": "avx2", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "tests.engines.kt.families.deepseek_v4.v4_helpers",
                          str(v4_model_dir), "36"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    measured = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    assert measured["variant"] == "avx2"
    assert measured["max_diff"] < V4_LOGPROB_TOLERANCE
