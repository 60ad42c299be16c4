"""The demo model is an ordinary, deterministic DeepSeek-V3 checkpoint that transformers loads as-is."""
import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import engines.kt.families.deepseek_mla.demo_model as demo_model
from engines.kt.families.deepseek_mla.demo_model import (DEMO_MODEL_NAME, DEMO_SEED, default_demo_model_dir, demo_config,
                                                         ensure_demo_model, make_demo_model)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def twin_dir(tmp_path_factory) -> Path:
    """A second, independent build with the same seed."""
    return make_demo_model(tmp_path_factory.mktemp("twin"), seed=DEMO_SEED)


@pytest.fixture(scope="module")
def model(demo_dir):
    return AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()


def random_prompts(rows: int, length: int) -> torch.Tensor:
    return torch.randint(3, 128000, (rows, length), generator=torch.Generator().manual_seed(1))


def file_hashes(directory: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir())}


def greedy(model, prompt: torch.Tensor, tokens: int = 16) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt[None], max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             pad_token_id=1)
    return out[0, prompt.numel():].tolist()


def test_overrides_replace_config_keys():
    assert demo_config(num_hidden_layers=2)["num_hidden_layers"] == 2
    assert demo_config()["num_hidden_layers"] == 4


def test_config_loads_as_deepseek_v3_with_yarn_rope(demo_dir):
    config = AutoConfig.from_pretrained(demo_dir)
    assert config.model_type == "deepseek_v3"
    assert (config.vocab_size, config.hidden_size, config.n_routed_experts, config.first_k_dense_replace) == (
        129280, 256, 16, 1)
    rope = config.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 1024)


def test_weights_are_sharded_under_real_deepseek_v3_names(demo_dir):
    weight_map = json.loads((demo_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) >= 2
    for name in ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                 "model.layers.1.mlp.gate.weight",
                 "model.layers.1.mlp.gate.e_score_correction_bias",
                 "model.layers.3.mlp.experts.15.down_proj.weight",
                 "model.layers.3.mlp.shared_experts.up_proj.weight"]:
        assert name in weight_map, name
    assert all((demo_dir / shard).is_file() for shard in set(weight_map.values()))


def test_model_loads_with_no_missing_or_unexpected_keys(demo_dir):
    loaded, info = AutoModelForCausalLM.from_pretrained(demo_dir, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    assert loaded.dtype == torch.bfloat16
    assert loaded.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0


def test_tokenizer_is_the_fast_deepseek_tokenizer_with_bos(demo_dir):
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    assert tokenizer.is_fast
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.model_max_length) == (0, 1, 4096)
    assert tokenizer("Hello world").input_ids == [0, 19923, 2058]


def test_tokenizer_renders_the_deepseek_v3_chat_template(demo_dir):
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>"


def test_same_seed_gives_byte_identical_files(demo_dir, twin_dir):
    assert file_hashes(demo_dir) == file_hashes(twin_dir)


def test_different_seed_gives_different_weights(demo_dir, tmp_path):
    other = file_hashes(make_demo_model(tmp_path, seed=DEMO_SEED + 1))
    ours = file_hashes(demo_dir)
    assert other["config.json"] == ours["config.json"]
    assert all(other[name] != ours[name] for name in ours if name.endswith(".safetensors"))


def test_default_dir_is_under_ktserve_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("KTSERVE_CACHE_DIR", str(tmp_path))
    assert default_demo_model_dir() == tmp_path / DEMO_MODEL_NAME


def test_default_dir_falls_back_to_home_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("KTSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_demo_model_dir() == tmp_path / ".cache" / "ktserve" / DEMO_MODEL_NAME


def test_ensure_demo_model_builds_once_then_reuses(monkeypatch, tmp_path, demo_dir):
    monkeypatch.setenv("KTSERVE_CACHE_DIR", str(tmp_path))
    first = ensure_demo_model()
    stamp = (first / "config.json").stat().st_mtime_ns
    assert ensure_demo_model() == first == tmp_path / DEMO_MODEL_NAME
    assert (first / "config.json").stat().st_mtime_ns == stamp
    assert file_hashes(first) == file_hashes(demo_dir)
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_MODEL_NAME]


def test_ensure_demo_model_leaves_a_cache_everyone_can_read(monkeypatch, tmp_path):
    monkeypatch.setenv("KTSERVE_CACHE_DIR", str(tmp_path))
    built = ensure_demo_model()
    assert built.stat().st_mode & 0o777 == 0o755
    assert all(f.stat().st_mode & 0o444 == 0o444 for f in built.iterdir())


def test_ensure_demo_model_keeps_the_winner_when_another_process_finishes_first(monkeypatch, tmp_path):
    monkeypatch.setenv("KTSERVE_CACHE_DIR", str(tmp_path))
    winner = tmp_path / DEMO_MODEL_NAME

    def build_while_another_process_wins(out_dir, seed=DEMO_SEED, mtp=None):
        (out_dir / "config.json").write_text("{}")
        winner.mkdir()
        (winner / "config.json").write_text('{"winner": true}')
        return out_dir

    monkeypatch.setattr(demo_model, "make_demo_model", build_while_another_process_wins)
    assert ensure_demo_model() == winner
    assert (winner / "config.json").read_text() == '{"winner": true}'
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_MODEL_NAME]


def test_forward_pass_gives_finite_logits(model):
    with torch.no_grad():
        logits = model(random_prompts(2, 16)).logits
    assert logits.shape == (2, 16, 129280)
    assert torch.isfinite(logits).all()


def test_routing_sends_different_tokens_to_different_experts(model):
    chosen = []
    hook = model.model.layers[2].mlp.gate.register_forward_hook(lambda mod, args, out: chosen.append(out[2]))
    with torch.no_grad():
        model(random_prompts(4, 16))
    hook.remove()
    experts = chosen[0]
    assert experts.unique().numel() == 16
    assert len({tuple(sorted(row)) for row in experts.tolist()}) > 32


def test_greedy_decoding_is_decisive(model):
    with torch.no_grad():
        logits = model(random_prompts(4, 50)).logits.float()
    top2 = logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).median() > 0.8


def test_greedy_generation_is_reproducible_across_builds(model, twin_dir):
    twin = AutoModelForCausalLM.from_pretrained(twin_dir, dtype=torch.float32).eval()
    prompt = random_prompts(1, 8)[0]
    tokens = greedy(model, prompt)
    assert tokens == greedy(twin, prompt)
    assert len(set(tokens)) > 4
