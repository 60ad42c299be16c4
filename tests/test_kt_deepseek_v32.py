"""DeepSeek-V3.2 in the ktransformers engine on the CPU: the tiny V3.2 demo in DeepSeek's released layout (FP8
with weight_scale_inv, the lightning indexer, an MTP layer) served through the OpenAI API and checked against
transformers' DeepseekV32ForCausalLM run on the dequantized weights. The prompts run past the demo's
index_topk (64), so the indexer's selection decides which positions attention sees."""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import start_server
from helpers import forward_logprobs, greedy_reference, require_kt_kernel

require_kt_kernel()

from engines.kt.families.deepseek_v32.demo_model import INDEX_TOPK  # noqa: E402

TORCH_EXPERTS_RULE = Path(__file__).parent / "data" / "kt_rules" / "DeepSeek-V3.2-torch-experts.yaml"
TEXT = ("The history of the river begins in the mountains, where snow melts each spring and feeds a hundred "
        "small streams. They join in the valley, turn the old mills, pass the market towns and slow down in the "
        "plain, where farmers have dug canals for a thousand years. ") * 6
CONTEXT = 300  # tokens, well past INDEX_TOPK
# With the experts in float32 torch, only our attention, indexer and caches differ from transformers. Prefilled
# in one chunk the 299 positions agree to 1.5e-5 at most. In chunks of 96 the indexer's score matmuls take
# other shapes, so their float32 rounding differs, and where a query's 64th and 65th scores are that close the
# two pick different positions: measured 298 positions within 1.5e-5 and one (269) at 0.015 (avx512_bf16).
EXACT_LOGPROB_DIFF = 1e-4
EXACT_MIN_SHARE = 0.98  # of positions within EXACT_LOGPROB_DIFF
NEAR_TIE_MAX_LOGPROB_DIFF = 0.1
# kt-kernel's BF16 experts round activations to bf16; past INDEX_TOPK that can tip the indexer's choice of a
# position at the edge of the top 64, which moves that token's logprob further. Measured over 299 positions:
# median 0.0057, 90th percentile 0.020, max 0.87, top-1 agreement 99.3% (avx512_bf16 build); see the README.
KT_MEDIAN_LOGPROB_DIFF = 0.03
KT_MIN_TOP1_AGREEMENT = 0.97


@pytest.fixture(scope="module")
def v32_dir(tmp_path_factory) -> Path:
    from engines.demo_model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("v32"), arch="deepseek_v32")


@pytest.fixture(scope="module")
def reference(v32_dir, tmp_path_factory):
    """transformers' DeepseekV32ForCausalLM in float32 on the dequantized weights (the MTP layer left out)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from engines.kt.families.deepseek_v32.checkpoint import dequantized
    from engines.kt.loader import checkpoint_files, iter_tensors

    out = tmp_path_factory.mktemp("v32-dequantized")
    config = json.loads((v32_dir / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    mtp = f"model.layers.{config['num_hidden_layers']}."
    weights = {n: t for n, t in dequantized(iter_tensors(checkpoint_files(v32_dir))) if not n.startswith(mtp)}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(v32_dir / name, out / name)
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def v32_tokenizer(v32_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(v32_dir)


@pytest.fixture(scope="module")
def kt_v32(v32_dir):
    running = start_server(v32_dir, engine="ktransformers", kt_method="BF16")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def torch_experts(v32_dir):
    """The experts in transformers' float32 module; prompts prefill in chunks of 96, past INDEX_TOPK."""
    running = start_server(v32_dir, engine="ktransformers", kt_optimize_rule=str(TORCH_EXPERTS_RULE), chunk_size=96,
                           max_concurrent=4)
    yield running
    running.stop()


def prompt(tokenizer, length: int) -> tuple[str, list[int]]:
    text = tokenizer.decode(tokenizer.encode(TEXT)[1:length], skip_special_tokens=True)
    return text, tokenizer.encode(text)


def served_logprobs(server, text: str):
    reply = server.openai().completions.create(model=server.engine.info.id, prompt=text, max_tokens=0, echo=True,
                                               logprobs=1)
    return reply.choices[0].logprobs


def logprob_diffs(server, tokenizer, reference, length: int) -> tuple[list[float], float]:
    """|served - reference| at every prompt position, and the top-1 agreement."""
    text, ids = prompt(tokenizer, length)
    assert len(ids) > INDEX_TOPK
    served, expected = served_logprobs(server, text), forward_logprobs(reference, ids)
    diffs = [abs(served.token_logprobs[i] - float(expected[i - 1, ids[i]])) for i in range(1, len(ids))]
    agree = sum(max(served.top_logprobs[i], key=served.top_logprobs[i].get)
                == tokenizer.decode([int(expected[i - 1].argmax())]) for i in range(1, len(ids)))
    return diffs, agree / (len(ids) - 1)


def completion(server, text: str, tokens: int = 16, stream: bool = False) -> str:
    client = server.openai()
    kwargs = dict(model=server.engine.info.id, prompt=text, max_tokens=tokens, temperature=0)
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)


def test_the_demo_is_written_in_the_released_fp8_layout(v32_dir):
    from safetensors import safe_open

    config = json.loads((v32_dir / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("deepseek_v32", ["DeepseekV32ForCausalLM"])
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    names = json.loads((v32_dir / "model.safetensors.index.json").read_text())["weight_map"]
    layer = "model.layers.1.self_attn"
    with safe_open(str(v32_dir / names[f"{layer}.indexer.wq_b.weight"]), "pt") as f:
        assert f.get_tensor(f"{layer}.indexer.wq_b.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor(f"{layer}.indexer.wq_b.weight_scale_inv").shape == (
            config["index_n_heads"] * config["index_head_dim"] // 128, config["q_lora_rank"] // 128)
    with safe_open(str(v32_dir / names[f"{layer}.indexer.weights_proj.weight"]), "pt") as f:
        assert f.get_tensor(f"{layer}.indexer.weights_proj.weight").dtype == torch.bfloat16
    mtp = f"model.layers.{config['num_hidden_layers']}"
    assert {f"{mtp}.eh_proj.weight_scale_inv", f"{mtp}.self_attn.indexer.wk.weight",
            f"{mtp}.mlp.experts.0.up_proj.weight", f"{mtp}.shared_head.head.weight"} <= set(names)


def test_prompt_logprobs_equal_transformers_past_index_topk_in_prefill_chunks(torch_experts, v32_tokenizer,
                                                                              reference):
    diffs, agree = logprob_diffs(torch_experts, v32_tokenizer, reference, CONTEXT)
    assert sum(d < EXACT_LOGPROB_DIFF for d in diffs) >= EXACT_MIN_SHARE * len(diffs)
    assert max(diffs) < NEAR_TIE_MAX_LOGPROB_DIFF
    assert agree == 1.0


def test_prompt_logprobs_with_kt_kernel_experts_match_transformers(kt_v32, v32_tokenizer, reference):
    assert kt_v32.engine.info.details["model_family"] == "deepseek_v32"
    diffs, agree = logprob_diffs(kt_v32, v32_tokenizer, reference, CONTEXT)
    assert sorted(diffs)[len(diffs) // 2] < KT_MEDIAN_LOGPROB_DIFF
    assert agree >= KT_MIN_TOP1_AGREEMENT


def test_greedy_decode_past_index_topk_equals_transformers(torch_experts, v32_tokenizer, reference):
    text, ids = prompt(v32_tokenizer, 150)
    expected = greedy_reference(reference, ids, 16)
    assert completion(torch_experts, text) == v32_tokenizer.decode(expected, skip_special_tokens=True)


def test_streamed_text_equals_the_whole_reply(kt_v32, v32_tokenizer):
    text, _ = prompt(v32_tokenizer, 120)
    assert completion(kt_v32, text, 24, stream=True) == completion(kt_v32, text, 24)


def test_requests_decoded_together_give_what_each_gives_alone(torch_experts, v32_tokenizer):
    texts = [prompt(v32_tokenizer, length)[0] for length in (40, 90, 170, 260)]
    alone = [completion(torch_experts, text) for text in texts]
    client = torch_experts.async_openai()

    async def one(text):
        reply = await client.completions.create(model=torch_experts.engine.info.id, prompt=text, max_tokens=16,
                                                temperature=0)
        return reply.choices[0].text

    async def together():
        return await asyncio.wait_for(asyncio.gather(*(one(t) for t in texts)), timeout=120)

    assert asyncio.run(together()) == alone
    torch_experts.wait_idle()
    assert torch_experts.engine.stats().kv_used_tokens == 0
