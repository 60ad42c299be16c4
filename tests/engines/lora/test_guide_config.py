"""The LLaMA-Factory x KTransformers fine-tune guide serves its adapter with one YAML file; that file,
verbatim except for the model and adapter paths, starts ktserve and serves the adapter. Its rule file
(`examples/kt_optimize_rules/DeepSeek-V3-Chat-sft-amx-multi-gpu.yaml`: two GPUs, SFT experts, AMXInt8) is
found by file name among our kt_optimize_rules/; on a machine without its GPUs (CI) both fold onto the
CPU, and AMXInt8 becomes the closest method this CPU's kt-kernel build runs."""
from __future__ import annotations

import pytest

from tests.conftest import start_server_from_config
from tests.helpers import forward_logprobs, require_kt_kernel
from tests.lora_helpers import make_peft_adapter, write_fused_expert_lora

require_kt_kernel()

GUIDE_CONFIG = """\
model_name_or_path: {model}
adapter_name_or_path: {adapter}
template: deepseek
infer_backend: ktransformers  # choices: [huggingface, vllm, sglang, ktransformers]
trust_remote_code: true

use_kt: true # use KTransformers as LoRA sft backend to inference
kt_optimize_rule: examples/kt_optimize_rules/DeepSeek-V3-Chat-sft-amx-multi-gpu.yaml
cpu_infer: 32
chunk_size: 8192
"""
PROMPT = "The river flows through the valley and the mills turn while the farmers"
# Teacher-forced agreement with the adapter merged into the float32 model (as tests/engines/lora/test_lora_outputs.py
# asks of every adapter on this engine).
MEDIAN_LOGPROB_DIFF = 0.15
MIN_TOP1_AGREEMENT = 0.8


@pytest.fixture(scope="module")
def guide_server(tmp_path_factory, demo_model_dir, reference_model):
    root = tmp_path_factory.mktemp("guide")
    merged = make_peft_adapter(reference_model, "experts", root / "peft")
    config = reference_model.config
    adapter = write_fused_expert_lora(root / "peft", root / "saves" / "Kllama_deepseekV3", config.n_routed_experts,
                                      config.moe_intermediate_size)
    path = root / "kt_sft_inference.yaml"
    path.write_text(GUIDE_CONFIG.format(model=demo_model_dir, adapter=adapter))
    running = start_server_from_config(path)
    yield running, merged
    running.stop()


def test_the_guide_config_serves_its_adapter_under_the_directory_name(guide_server):
    running, _ = guide_server
    ids = [m.id for m in running.openai().models.list().data]
    assert "Kllama_deepseekV3" in ids


def test_the_guide_rule_file_is_found_by_name_and_its_method_is_one_this_cpu_runs(guide_server):
    from engines.kt.experts.methods import available_methods

    running, _ = guide_server
    details = running.http().get("/version").json()["engine_details"]
    assert details["kt_optimize_rule"] == "DeepSeek-V3-Chat-sft-amx-multi-gpu.yaml"
    assert details["experts_method_requested"] == "AMXINT8"
    assert details["experts_method"] in available_methods()


def test_the_guide_adapter_agrees_with_the_merged_model(guide_server, tokenizer):
    running, merged = guide_server
    ids = tokenizer.encode(PROMPT)
    reply = running.openai().completions.create(model="Kllama_deepseekV3", prompt=ids, max_tokens=0, echo=True,
                                                logprobs=1)
    lp = reply.choices[0].logprobs
    reference = forward_logprobs(merged, ids)
    diffs = sorted(abs(lp.token_logprobs[i] - float(reference[i - 1, ids[i]])) for i in range(1, len(ids)))
    top1 = [max(t, key=t.get) for t in lp.top_logprobs[1:]]
    agree = sum(top1[i] == tokenizer.decode([int(reference[i].argmax())]) for i in range(len(top1))) / len(top1)
    print(f"guide adapter: median |dlogprob| {diffs[len(diffs) // 2]:.4f}, top-1 agreement {agree:.3f}")
    assert diffs[len(diffs) // 2] < MEDIAN_LOGPROB_DIFF
    assert agree >= MIN_TOP1_AGREEMENT
