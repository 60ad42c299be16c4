"""DeepSeek-V3.2 in the ktransformers engine on the CPU: the tiny V3.2 demo in DeepSeek's released layout (FP8
with weight_scale_inv, the lightning indexer, an MTP layer) served through the OpenAI API and checked against
transformers' DeepseekV32ForCausalLM run on the dequantized weights; chats in V3.2's own format
(tests/engines/kt/families/deepseek_v32/test_v32_chat.py checks the format itself). The prompts run past the demo's
index_topk (64), so the indexer's selection decides which positions attention sees."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import start_server
from tests.helpers import (RIVER_TEXT, completion_text, completions_together, greedy_reference, logprob_diffs,
                     prompt_of_length, require_kt_kernel)

require_kt_kernel()

from engines.kt.families.deepseek_v32.demo_model import INDEX_TOPK  # noqa: E402

TORCH_EXPERTS_RULE = Path(__file__).parents[4] / "data" / "kt_rules" / "DeepSeek-V3.2-torch-experts.yaml"
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
# median 0.0057, 90th percentile 0.020, max 0.87, top-1 agreement 99.3% on the avx512_bf16 build; 0.0058,
# 0.019, 0.88 and 99.3% on the avx2 build. See the README.
KT_MEDIAN_LOGPROB_DIFF = 0.03
KT_MIN_TOP1_AGREEMENT = 0.97


@pytest.fixture(scope="module")
def kt_v32(v32_dir):
    running = start_server(v32_dir, engine="ktransformers", kt_method="BF16", reasoning_parser="deepseek_r1")
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
    return prompt_of_length(tokenizer, RIVER_TEXT, length)


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
                                                                              v32_reference):
    diffs, agree = logprob_diffs(torch_experts, v32_tokenizer, v32_reference, prompt(v32_tokenizer, CONTEXT))
    assert sum(d < EXACT_LOGPROB_DIFF for d in diffs) >= EXACT_MIN_SHARE * len(diffs)
    assert max(diffs) < NEAR_TIE_MAX_LOGPROB_DIFF
    assert agree == 1.0


def test_prompt_logprobs_with_kt_kernel_experts_match_transformers(kt_v32, v32_tokenizer, v32_reference):
    assert kt_v32.engine.info.details["model_family"] == "deepseek_v32"
    diffs, agree = logprob_diffs(kt_v32, v32_tokenizer, v32_reference, prompt(v32_tokenizer, CONTEXT))
    assert sorted(diffs)[len(diffs) // 2] < KT_MEDIAN_LOGPROB_DIFF
    assert agree >= KT_MIN_TOP1_AGREEMENT


def test_greedy_decode_past_index_topk_equals_transformers(torch_experts, v32_tokenizer, v32_reference):
    text, ids = prompt(v32_tokenizer, 150)
    expected = greedy_reference(v32_reference, ids, 16)
    assert completion_text(torch_experts, text) == v32_tokenizer.decode(expected, skip_special_tokens=True)


def test_streamed_text_equals_the_whole_reply(kt_v32, v32_tokenizer):
    text, _ = prompt(v32_tokenizer, 120)
    assert completion_text(kt_v32, text, 16, stream=True) == completion_text(kt_v32, text, 16)


def test_requests_decoded_together_give_what_each_gives_alone(torch_experts, v32_tokenizer):
    texts = [prompt(v32_tokenizer, length)[0] for length in (40, 90, 170, 260)]
    alone = [completion_text(torch_experts, text) for text in texts]
    assert completions_together(torch_experts, texts) == alone
    torch_experts.wait_idle()
    assert torch_experts.engine.stats().kv_used_tokens == 0


def test_an_fp8_weight_without_its_scale_or_with_a_misshapen_one_is_an_error_naming_it(tmp_path):
    import json

    from safetensors.torch import save_file

    from engines.checkpoints.fp8 import quantize_blocks
    from engines.checkpoints.source import SafetensorsSource

    weight, scale = quantize_blocks(torch.randn(256, 128))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}))
    save_file({"a.weight": weight, "a.weight_scale_inv": scale, "b.weight": weight.clone()},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="b.weight"):
        list(SafetensorsSource(tmp_path).items(num_experts=1))
    save_file({"a.weight": weight, "a.weight_scale_inv": scale[:1]}, str(tmp_path / "model.safetensors"))
    (stored,) = SafetensorsSource(tmp_path).items(num_experts=1)
    with pytest.raises(ValueError, match=r"a.weight: FP8 block scale has shape \(1, 1\)"):
        stored.load("cpu", torch.bfloat16)


def test_version_says_the_fp8_release_and_how_the_indexer_and_experts_are_held(kt_v32):
    checkpoint = kt_v32.http().get("/version").json()["checkpoint"]
    assert checkpoint["format"] == "safetensors, FP8 e4m3 in 128x128 blocks"
    # kt_method=BF16 converts the FP8 experts; attention (the indexer's wq_b and wk among it) is dequantized
    assert checkpoint["storage"]["experts"] == "BF16 from FP8"
    assert "from FP8" in checkpoint["storage"]["attention"]


def test_chats_are_rendered_in_v32_s_own_format_tools_and_thinking_included(kt_v32, v32_tokenizer):
    from engines.kt.families.deepseek_v32.chat import V32ChatFormat

    from .test_v32_chat import CONVERSATIONS, WEATHER

    body = {"messages": CONVERSATIONS[2], "tools": [WEATHER], "chat_template_kwargs": {"thinking": True}}
    with kt_v32.http() as http:
        tokens = http.post("/tokenize", json=body).json()["tokens"]
    expected = V32ChatFormat().encode(CONVERSATIONS[2], tools=[WEATHER], thinking=True)
    assert tokens == v32_tokenizer.encode(expected, add_special_tokens=False)


def test_a_thinking_chat_answers_in_reasoning_content_streamed_as_whole(kt_v32):
    client, model = kt_v32.openai(), kt_v32.engine.info.id
    messages = [{"role": "user", "content": "Say something."}]
    thinking = {"chat_template_kwargs": {"thinking": True}}
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                           extra_body=thinking).choices[0].message
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                                 extra_body=thinking, stream=True))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    assert whole.reasoning_content and streamed == whole.reasoning_content
    assert not getattr(plain.choices[0].message, "reasoning_content", None) and plain.choices[0].message.content
