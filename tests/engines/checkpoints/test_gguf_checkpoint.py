"""GGUF checkpoints (llama.cpp's deepseek2 layout) served by the ktransformers engine through the OpenAI API: the
demo model written as GGUF, alone (config, tokenizer and chat template from the metadata) and beside its
Hugging Face folder (KTransformers' model_path + gguf_path), checked against transformers' DeepseekV3 run on
the same dequantized weights; and the errors a user meets with the wrong file."""
from __future__ import annotations

import dataclasses
import shutil
import statistics
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import start_server
from tests.helpers import forward_logprobs, require_kt_kernel
from tests.ops_support import ServerProcess

require_kt_kernel()

from engines.checkpoints.gguf import GGUFCheckpoint  # noqa: E402
from engines.demo_model import write_demo_gguf  # noqa: E402

TEXT = ("The history of the river begins in the mountains, where snow melts each spring and feeds a hundred small "
        "streams. They join in the valley, turn the old mills and slow down in the plain.")
# Served prompt logprobs against transformers in float32 on the dequantized weights, over the 39 positions of
# TEXT: the llamafile kernel quantizes activations to 8 bits and returns bf16, so logprobs differ a little
# everywhere and more where a routing choice flips on a near-tie (as in test_kt_engine.py). Measured: Q4_K
# experts on the avx512_bf16 build median 0.021, 90th percentile 0.06, max 0.79 (one flipped position); Q8_0
# on the avx2 build: see the test's printed line.
MEDIAN_BOUND, P90_BOUND = 0.05, 0.15


@pytest.fixture(scope="module")
def q4k_parts(tmp_path_factory):
    """Experts Q4_K, the other weights Q8_0, in two files, written by `ktserve make-demo-model`."""
    from server.cli import main

    out = tmp_path_factory.mktemp("gguf-q4k")
    assert main(["make-demo-model", str(out), "--format", "gguf", "--gguf-type", "Q4_K", "--split"]) == 0
    return sorted(out.glob("*.gguf"))


@pytest.fixture(scope="module")
def q4k_server(q4k_parts):
    running = start_server(q4k_parts[0], engine="ktransformers")
    yield running
    running.stop()


def reference_on(path, config=None) -> torch.nn.Module:
    """transformers' DeepSeek model with the GGUF's weights, dequantized to float32; `config`: the model's (default:
    the one the GGUF's metadata makes)."""
    from transformers import AutoModelForCausalLM

    checkpoint = GGUFCheckpoint(path)
    state = {}
    for name, tensor in checkpoint.tensors():
        if isinstance(tensor, torch.Tensor):
            state[name] = tensor
            continue
        gate, up, down = tensor.dequantized(torch.float32)
        state[f"{name}.gate_up_proj"], state[f"{name}.down_proj"] = torch.cat([gate, up], dim=1), down
    model = AutoModelForCausalLM.from_config(config or checkpoint.config(), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model.eval()


def logprob_diffs(url: str, model: str, tokenizer, reference) -> list[float]:
    """|served - reference| prompt logprob of each position of TEXT (teacher-forced)."""
    ids = tokenizer.encode(TEXT)
    # the ids, BOS included, so the echoed logprobs line up with them (a text prompt's added BOS is not echoed)
    with httpx.Client(base_url=url, timeout=120) as http:
        body = http.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 0, "echo": True,
                                                  "logprobs": 1}).json()
    assert "choices" in body, body
    served = body["choices"][0]["logprobs"]["token_logprobs"]
    expected = forward_logprobs(reference, ids)
    assert len(served) == len(ids) > 30
    return [abs(served[i] - float(expected[i - 1, ids[i]])) for i in range(1, len(ids))]


def check_logprobs(label: str, diffs: list[float]) -> None:
    p90 = sorted(diffs)[int(0.9 * len(diffs))]
    print(f"{label}: |logprob diff| median {statistics.median(diffs):.4f}, 90th percentile {p90:.4f}, max "
          f"{max(diffs):.4f} over {len(diffs)} positions")
    assert statistics.median(diffs) < MEDIAN_BOUND and p90 < P90_BOUND


def test_a_split_gguf_alone_serves_chat_with_its_own_tokenizer_and_template(q4k_server):
    client = q4k_server.openai()
    assert [m.id for m in client.models.list().data] == ["demo-model-Q4_K"]
    reply = client.chat.completions.create(model="demo-model-Q4_K", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 8
    # the chat template and special tokens came from the metadata: the prompt is DeepSeek-V3's
    prompt = q4k_server.engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                             add_generation_prompt=True)
    assert prompt == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>" and reply.usage.prompt_tokens == 4


def test_q4k_gguf_prompt_logprobs_match_transformers_on_its_dequantized_weights(q4k_server, q4k_parts):
    diffs = logprob_diffs(q4k_server.url, "demo-model-Q4_K", q4k_server.engine.tokenizer, reference_on(q4k_parts[0]))
    check_logprobs(f"Q4_K GGUF, {q4k_server.engine.info.details['cpu_variant']}", diffs)


def test_version_and_start_up_report_the_format_and_each_part_s_storage(q4k_server):
    with q4k_server.http() as http:
        version = http.get("/version").json()
    checkpoint = version["checkpoint"]
    assert checkpoint["format"] == "GGUF deepseek2 (2 files)"
    assert checkpoint["summary"].startswith("experts Q4_K in place (llamafile); attention float32 from Q8_0; ")
    assert checkpoint["storage"]["norms"] == "float32"
    assert version["engine_details"]["experts_method"] == "LLAMAFILE"


def test_the_metadata_tokenizer_encodes_as_the_original(q4k_parts, tokenizer):
    rebuilt = GGUFCheckpoint(q4k_parts[0]).tokenizer()
    texts = (TEXT, "数字 12345 和中文，ひらがな!", "<｜User｜>Hi<｜Assistant｜><think>\n", "  spaces\n\ttabs")
    for text in texts:
        assert rebuilt.encode(text) == tokenizer.encode(text)
        assert rebuilt.decode(rebuilt.encode(text), skip_special_tokens=True) == tokenizer.decode(
            tokenizer.encode(text), skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert rebuilt.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_the_metadata_config_is_the_original_config(q4k_parts, demo_model_dir):
    from transformers import AutoConfig

    original, rebuilt = AutoConfig.from_pretrained(demo_model_dir), GGUFCheckpoint(q4k_parts[0]).config()
    assert type(rebuilt) is type(original)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "first_k_dense_replace", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group",
                "topk_group", "norm_topk_prob", "routed_scaling_factor", "num_attention_heads", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings",
                "rope_parameters", "rms_norm_eps", "bos_token_id", "eos_token_id", "tie_word_embeddings"):
        assert getattr(rebuilt, key) == pytest.approx(getattr(original, key)), key


def test_experts_of_another_method_are_converted_from_the_blocks_and_cached(q4k_parts, tmp_path):
    from engines.checkpoints.gguf import GGUFExperts
    from engines.kt.experts.methods import best_method
    from engines.kt.experts.cpu import RoutedExpertsCPU
    from engines.checkpoints.source import StorageNotes
    from engines.kt.loader import ExpertPlacer

    checkpoint = GGUFCheckpoint(q4k_parts[0])
    layer = next(t for name, t in checkpoint.tensors() if isinstance(t, GGUFExperts))
    layer = dataclasses.replace(layer, prefix="experts")  # the module's name in the one-module model below
    gate, up, down = layer.dequantized(torch.float32)
    experts, hidden = gate.shape[0], gate.shape[2]

    def stage(cache) -> tuple[RoutedExpertsCPU, ExpertPlacer]:
        module = RoutedExpertsCPU(layer_idx=1, num_experts=experts, top_k=4, hidden_size=hidden,
                                  intermediate_size=gate.shape[1], method=best_method(8), max_tokens=16)
        model = torch.nn.Module()
        model.add_module("experts", module)
        return module, ExpertPlacer(model, torch.float32, lambda name: "cpu", StorageNotes(), cache)

    x = torch.randn(6, hidden, generator=torch.Generator().manual_seed(0))
    ids, weights = torch.arange(24).reshape(6, 4) % experts, torch.full((6, 4), 0.25)
    expected = sum(0.25 * torch.stack([down[e] @ (torch.nn.functional.silu(gate[e] @ x[t]) * (up[e] @ x[t]))
                                       for t, e in enumerate(ids[:, k])]) for k in range(4))
    first, placer = stage(tmp_path)
    placer.place(layer)
    assert first.method != "LLAMAFILE" and any(tmp_path.rglob("*"))
    assert placer.notes.report("GGUF").parts == (("experts", f"{first.method} from Q4_K"),)
    out = first(x, ids, weights).float()
    assert float((out - expected).norm() / expected.norm()) < 0.05
    # the second start finds the layer converted in the cache: the checkpoint's copy is then not read at all
    second, placer = stage(tmp_path)
    assert placer.preload() == {"experts"}
    assert torch.equal(second(x, ids, weights), first(x, ids, weights))


def test_a_q8_gguf_beside_its_hf_folder_serves_on_the_avx2_build(tmp_path, demo_model_dir, tokenizer):
    # older GGUFs keep kv_b whole; KTransformers' model_path + gguf_path keys, as a user's YAML gives them
    [gguf] = write_demo_gguf(tmp_path, {"experts": "Q8_0"}, kv_b="whole")
    config = tmp_path / "serve.yaml"
    config.write_text(f"model_path: {demo_model_dir}\ngguf_path: {gguf}\ninfer_backend: ktransformers\n")
    server = ServerProcess(str(config), env={"KT_KERNEL_CPU_VARIANT": "avx2"})
    try:
        server.wait_healthy()
        version = httpx.get(server.url + "/version", timeout=30).json()
        assert version["engine_details"]["cpu_variant"] == "avx2"
        assert version["checkpoint"]["summary"].startswith("experts Q8_0 in place (llamafile); attention float32 "
                                                           "from Q8_0; ")
        assert f"config and tokenizer from {demo_model_dir}" in version["checkpoint"]["format"]
        check_logprobs("Q8_0 GGUF, avx2", logprob_diffs(server.url, "demo-model-Q8_0", tokenizer, reference_on(gguf)))
    finally:
        server.kill()


def test_a_gguf_of_another_architecture_is_refused_naming_the_file(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "tiny-llama.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(RuntimeError, match=f"model: {path} is a GGUF of architecture 'llama'; ktserve serves "
                                           "'deepseek2' GGUFs"):
        start_server(path, engine="ktransformers")


def test_a_tensor_type_that_cannot_be_read_is_named_with_its_tensor_and_file(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "odd-types.gguf"
    writer = gguf.GGUFWriter(path, "deepseek2")
    q8_k = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K][1]
    writer.add_tensor("blk.0.attn_q_a.weight", np.zeros((4, q8_k), dtype=np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"tensor blk.0.attn_q_a.weight of {path.name} is stored as Q8_K, a type"):
        list(GGUFCheckpoint(path).tensors())


def test_the_huggingface_engine_names_a_gguf_it_cannot_read(q4k_parts):
    with pytest.raises(RuntimeError, match="is a GGUF checkpoint, which the huggingface engine does not read"):
        start_server(q4k_parts[0], engine="huggingface")


def test_a_config_file_names_the_gguf_as_ktransformers_does(tmp_path):
    from server.settings import load_settings

    beside, alone = tmp_path / "beside.yaml", tmp_path / "alone.yaml"
    beside.write_text("model_path: /models/R1\ngguf_path: /models/R1-GGUF\n")
    alone.write_text("gguf_path: /models/R1-GGUF/r1-00001-of-00002.gguf\n")
    settings = load_settings(str(beside), env={})
    assert (settings.model, settings.gguf_path) == ("/models/R1", "/models/R1-GGUF")
    settings = load_settings(str(alone), env={})  # no folder beside: the GGUF is the model
    assert (settings.model, settings.gguf_path) == ("/models/R1-GGUF/r1-00001-of-00002.gguf", None)


def test_a_missing_split_part_is_named(tmp_path, q4k_parts):
    shutil.copy(q4k_parts[0], tmp_path / q4k_parts[0].name)
    with pytest.raises(ValueError, match="split GGUF part demo-model-Q4_K-00002-of-00002.gguf is missing"):
        GGUFCheckpoint(tmp_path / q4k_parts[0].name)
    with pytest.raises(ValueError, match="is part 2 of a split GGUF; name the first part"):
        GGUFCheckpoint(q4k_parts[1])


def test_a_layer_s_experts_read_again_come_from_the_gguf_dequantized(q4k_parts):
    # expert LoRA and the GPU's streamed copies re-read a layer's experts from the checkpoint kt-kernel was given
    from engines.checkpoints.gguf import GGUFExperts
    from engines.kt.loader import read_layer_experts

    layer = next(t for _, t in GGUFCheckpoint(q4k_parts[0]).tensors() if isinstance(t, GGUFExperts))
    gate, up, down = layer.dequantized(torch.float32)
    again = read_layer_experts(q4k_parts[0], layer.prefix, gate.shape[0], first=3)
    for read, whole in zip(again, (gate, up, down)):
        assert read.shape[0] == 3 and torch.equal(read.float(), whole[:3].to(torch.bfloat16).float())


def test_one_picker_opens_a_gguf_file_its_folder_or_gguf_path_and_else_safetensors(q4k_parts, demo_model_dir):
    from engines.checkpoints.formats import open_source
    from engines.checkpoints.source import SafetensorsSource

    for path in (q4k_parts[0], q4k_parts[0].parent):
        assert isinstance(open_source(path), GGUFCheckpoint)
    beside = open_source(demo_model_dir, gguf_path=q4k_parts[0])  # KTransformers' model_path + gguf_path
    assert isinstance(beside, GGUFCheckpoint) and beside.hf_dir == demo_model_dir
    assert isinstance(open_source(demo_model_dir), SafetensorsSource)


def test_make_demo_model_refuses_an_mtp_layer_in_gguf(tmp_path, capsys):
    from server.cli import main

    assert main(["make-demo-model", str(tmp_path), "--format", "gguf", "--mtp", "random"]) == 2
    assert "--mtp: the GGUF demo model has no multi-token-prediction layer" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_a_gguf_written_for_a_vocabulary_smaller_than_its_tokenizer_reads_back(tmp_path, demo_model_dir):
    """A model whose vocab_size cuts the tokenizer (V2-Lite: 102,400 of DeepSeek's 128k tokens): the file keeps
    only the merges its vocabulary still holds, so its tokenizer builds and encodes within the vocabulary."""
    import gguf

    from engines.checkpoints.gguf.files import GGUFFiles
    from engines.checkpoints.gguf.tokenizer import build_tokenizer
    from engines.checkpoints.gguf.writer import _write_tokenizer

    size = 102400
    path = tmp_path / "tokenizer-only.gguf"
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    _write_tokenizer(writer, Path(demo_model_dir), {"vocab_size": size})
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    files = GGUFFiles.open(path)
    tokenizer = build_tokenizer(files.value, str(path))
    ids = tokenizer.encode("The sergeant's unconventional manoeuvres bewildered everyone.", add_special_tokens=False)
    assert ids and max(ids) < size
    assert tokenizer.decode(ids) == "The sergeant's unconventional manoeuvres bewildered everyone."


def test_a_gguf_whose_merges_name_a_token_it_lacks_is_refused_naming_the_file(tmp_path):
    import gguf

    from engines.checkpoints.gguf.files import GGUFFiles
    from engines.checkpoints.gguf.tokenizer import build_tokenizer

    path = tmp_path / "broken-tokenizer.gguf"
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("deepseek-v3")
    writer.add_token_list(["a", "b", "ab", "<eos>"])
    writer.add_token_types([1, 1, 1, 3])
    writer.add_token_merges(["a b", "a zz"])  # "zz" is not in the vocabulary
    writer.add_eos_token_id(3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"broken-tokenizer\.gguf: its tokenizer metadata does not make a tokenizer"):
        build_tokenizer(GGUFFiles.open(path).value, str(path))
