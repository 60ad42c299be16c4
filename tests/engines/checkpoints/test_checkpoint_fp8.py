"""DeepSeek's FP8 releases served as downloaded: the demo model written in that layout (every projection as
float8_e4m3fn with a float32 `weight_scale_inv` per 128x128 block, `quantization_config` in config.json, an MTP
layer `model.layers.<num_hidden_layers>`) must serve what transformers computes on the dequantized weights."""
from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.conftest import start_server
from tests.helpers import forward_logprobs, require_kt_kernel

require_kt_kernel()

from engines.checkpoints.fp8 import dequantize_blocks  # noqa: E402
from engines.checkpoints.source import SafetensorsSource  # noqa: E402
from engines.kt.families.deepseek_mla.demo_model import make_demo_model  # noqa: E402
from engines.kt.experts import methods as expert_methods  # noqa: E402
from engines.kt.experts.cpu import RoutedExpertsCPU  # noqa: E402

# kt-kernel's FP8 kernel reads the released blocks and rounds activations to bf16, while transformers computes in
# float32 on the same dequantized weights. Measured on the FP8 demo over 299 teacher-forced positions: median
# |logprob diff| 0.0058 and max 0.0236 (avx512_bf16 build), 0.0050 / 0.0236 (avx2); the experts converted to
# BF16 at load: 0.0071 / 0.087 and 0.0074 / 0.086. The bounds leave room for thread-count differences.
MEDIAN_LOGPROB_DIFF = 0.02
MAX_LOGPROB_DIFF = 0.1
TEXT = ("The history of the river begins in the mountains, where snow melts each spring and feeds a hundred "
        "small streams. They join in the valley, turn the old mills, pass the market towns and slow down in the "
        "plain, where farmers have dug canals for a thousand years. ") * 6
LAYERS = 4  # the demo model's num_hidden_layers: its FP8 release adds layer 4, the MTP layer


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return make_demo_model(tmp_path_factory.mktemp("fp8") / "demo-fp8", fmt="fp8")


@pytest.fixture(scope="module")
def fp8_reference(fp8_dir, tmp_path_factory):
    """transformers' DeepseekV3 in float32 on the FP8 release's weights dequantized (MTP layer left out)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("fp8-dequantized")
    tensors = {}
    for shard in sorted(fp8_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    weights = {}
    for name, tensor in tensors.items():
        if name.startswith(f"model.layers.{LAYERS}.") or name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        weights[name] = tensor if scale is None else dequantize_blocks(tensor, scale, torch.float32)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def kt_fp8(fp8_dir):
    running = start_server(fp8_dir, engine="ktransformers")
    yield running
    running.stop()


def logprob_diffs(server, tokenizer, reference) -> list[float]:
    text = tokenizer.decode(tokenizer.encode(TEXT)[:300], skip_special_tokens=True)
    ids = tokenizer.encode(text)
    # the ids, BOS included, so the echoed logprobs line up with them (a text prompt's added BOS is not echoed)
    reply = server.openai().completions.create(model=server.engine.info.id, prompt=ids, max_tokens=0, echo=True,
                                               logprobs=1)
    served, expected = reply.choices[0].logprobs.token_logprobs, forward_logprobs(reference, ids)
    return sorted(abs(served[i] - float(expected[i - 1, ids[i]])) for i in range(1, len(ids)))


def test_fp8_release_prompt_logprobs_match_transformers_on_its_dequantized_weights(kt_fp8, tokenizer,
                                                                                    fp8_reference):
    diffs = logprob_diffs(kt_fp8, tokenizer, fp8_reference)
    assert diffs[len(diffs) // 2] < MEDIAN_LOGPROB_DIFF
    assert diffs[-1] < MAX_LOGPROB_DIFF


def test_version_says_the_checkpoint_format_and_each_parts_storage(kt_fp8):
    checkpoint = kt_fp8.http().get("/version").json()["checkpoint"]
    assert checkpoint["format"] == "safetensors, FP8 e4m3 in 128x128 blocks"
    # the CPU placement computes in float32; FP8 projections are dequantized to it, the experts stay FP8
    assert checkpoint["storage"]["experts"] == "FP8 in place"
    assert checkpoint["storage"]["attention"] == "float32 from FP8"
    assert checkpoint["storage"]["mlp"] == "float32 from FP8"
    assert "experts FP8 in place; attention float32 from FP8" in checkpoint["summary"]


def test_huggingface_engine_serves_the_fp8_release_dequantized(fp8_dir, tokenizer, fp8_reference):
    running = start_server(fp8_dir, engine="huggingface", dtype="float32")
    try:
        diffs = logprob_diffs(running, tokenizer, fp8_reference)
        storage = running.http().get("/version").json()["checkpoint"]["storage"]
    finally:
        running.stop()
    assert diffs[-1] < 1e-3
    assert storage == {"weights": "float32 from FP8"}


def test_the_mtp_layer_is_skipped_with_one_log_line(fp8_dir, caplog):
    with caplog.at_level(logging.INFO, logger="ktserve.checkpoints"):
        names = [getattr(item, "name", getattr(item, "prefix", "")) for item in
                 SafetensorsSource(fp8_dir, LAYERS).items(num_experts=16)]
    assert names and not [n for n in names if n.startswith(f"model.layers.{LAYERS}.")]
    skipped = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(skipped) == 1 and f"layer(s) {LAYERS} skipped" in skipped[0]


def test_fp8_experts_convert_at_load_to_the_method_a_rule_asks_for(fp8_dir):
    experts = SafetensorsSource(fp8_dir).layer_experts("model.layers.1.mlp.experts", 16)
    kwargs = dict(layer_idx=1, num_experts=16, top_k=4, hidden_size=256, intermediate_size=256, threads=1)
    converted, reference = RoutedExpertsCPU(method="BF16", **kwargs), RoutedExpertsCPU(method="BF16", **kwargs)
    assert converted.load_stored(experts) == "BF16 from FP8"
    reference.load_weights(*experts.dequantized())
    hidden = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    ids, weights = torch.randint(0, 16, (5, 4), generator=torch.Generator().manual_seed(1)), torch.rand(5, 4)
    assert torch.equal(converted.forward(hidden, ids, weights), reference.forward(hidden, ids, weights))


def test_fp8_experts_reach_the_fp8_kernel_as_released(fp8_dir):
    experts = SafetensorsSource(fp8_dir).layer_experts("model.layers.1.mlp.experts", 16)
    layer = RoutedExpertsCPU(method="FP8", layer_idx=1, num_experts=16, top_k=4, hidden_size=256,
                             intermediate_size=256, threads=1)
    assert layer.load_stored(experts) == "FP8 in place"
    gate, up, down = (t.float() for t in experts.dequantized())
    hidden = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    ids, weights = torch.tensor([[0, 5, 9, 15]] * 3), torch.full((3, 4), 0.25)
    x = hidden.float()
    expected = sum(0.25 * ((torch.nn.functional.silu(x @ gate[e].T) * (x @ up[e].T)) @ down[e].T)
                   for e in (0, 5, 9, 15))
    out = layer.forward(hidden, ids, weights).float()
    assert (out - expected).abs().max() < 0.02 * expected.abs().max()


def test_an_fp8_checkpoint_on_a_build_without_an_fp8_kernel_takes_the_method_tables_fallback(fp8_dir, monkeypatch):
    kernel_class = expert_methods.kernel_class
    monkeypatch.setattr(expert_methods, "kernel_class", lambda m: None if m == "FP8" else kernel_class(m))
    wanted = expert_methods.default_method(SafetensorsSource(fp8_dir).experts_form)
    shape = expert_methods.ExpertShape(256, 256, 3 * 16 * 3 * 256 * 256)
    choice = expert_methods.choose_method(wanted, shape=shape)
    runnable = [m for m in expert_methods.FALLBACKS["FP8"] if expert_methods.unavailable_reason(m) is None]
    assert (wanted, choice.method) == ("FP8", runnable[0])
    assert "asks for FP8" in choice.reason and choice.method in choice.reason


def test_a_shard_missing_from_the_index_is_named_with_the_fix(fp8_dir, tmp_path):
    lost = sorted(fp8_dir.glob("*.safetensors"))[1].name
    for path in fp8_dir.iterdir():
        if path.name != lost:
            (tmp_path / path.name).symlink_to(path)
    with pytest.raises(ValueError, match=rf"{re.escape(lost)}.*download"):
        SafetensorsSource(tmp_path)


def test_a_quantization_method_ktserve_does_not_read_is_named(fp8_dir, tmp_path):
    shutil.copy(fp8_dir / "config.json", tmp_path / "config.json")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quant_method 'awq'.*does not read"):
        SafetensorsSource(tmp_path)


def test_a_deepseek_v3_architecture_under_its_own_model_type_loads_as_deepseek_v3(fp8_dir, tmp_path):
    from engines.kt.engine import architecture_config

    config = json.loads((fp8_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2", "n_routed_experts": 384}))
    loaded, arch = architecture_config(tmp_path)
    assert (type(loaded).__name__, arch, loaded.n_routed_experts) == ("DeepseekV3Config", "DeepseekV3ForCausalLM", 384)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_fp8_projections_are_dequantized_there_to_bf16(fp8_dir, tokenizer, fp8_reference):
    running = start_server(fp8_dir, engine="ktransformers")
    try:
        diffs = logprob_diffs(running, tokenizer, fp8_reference)
        storage = running.http().get("/version").json()["checkpoint"]["storage"]
    finally:
        running.stop()
    print(json.dumps({"fp8_gpu_median_logprob_diff": diffs[len(diffs) // 2], "fp8_gpu_max_logprob_diff": diffs[-1]}))
    assert (storage["experts"], storage["attention"], storage["mlp"]) == ("FP8 in place", "bf16 from FP8",
                                                                           "bf16 from FP8")
    # the whole non-expert model in bf16, as tests/engines/kt/test_kt_gpu.py measures
    assert diffs[len(diffs) // 2] < 0.1
