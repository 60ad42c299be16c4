"""Settings: defaults < YAML < env < CLI, LLaMA-Factory names accepted, bad values name the key."""
from __future__ import annotations

import pytest

from server.settings import SettingsError, load_settings


def write(tmp_path, text):
    path = tmp_path / "server.yaml"
    path.write_text(text)
    return str(path)


def test_llamafactory_keys_are_accepted(tmp_path):
    cfg = write(tmp_path, "model_name_or_path: /models/ds\ninfer_backend: ktransformers\nkt_maxlen: 4096\n"
                          "cpu_infer: 10\nchunk_size: 256\nkt_optimize_rule: rules.yaml\nfinetuning_type: lora\n")
    s = load_settings(cfg, env={})
    assert (s.model, s.engine, s.max_model_len, s.cpu_infer, s.chunk_size) == ("/models/ds", "ktransformers",
                                                                             4096, 10, 256)


def test_use_kt_selects_the_ktransformers_engine(tmp_path):
    assert load_settings(write(tmp_path, "use_kt: true\n"), env={}).engine == "ktransformers"


def test_env_overrides_yaml_and_cli_overrides_env(tmp_path):
    cfg = write(tmp_path, "port: 7000\nmax_concurrent: 3\n")
    s = load_settings(cfg, cli={"port": 9000}, env={"API_PORT": "8001", "MAX_CONCURRENT": "5", "API_KEY": "k"})
    assert (s.port, s.max_concurrent, s.api_key) == (9000, 5, "k")


def test_a_bad_value_names_the_key_and_its_source(tmp_path):
    with pytest.raises(SettingsError, match=r"max_concurrent \(from environment\)"):
        load_settings(None, env={"MAX_CONCURRENT": "many"})


def test_an_unknown_engine_lists_the_known_ones():
    with pytest.raises(SettingsError, match="huggingface"):
        load_settings(None, cli={"engine": "tensorrt"}, env={})


def test_adapter_name_or_path_names_adapters_by_directory(tmp_path):
    s = load_settings(write(tmp_path, "adapter_name_or_path: /a/sft-one,/b/sft-two/\n"), env={})
    assert s.all_adapters() == {"sft-one": "/a/sft-one", "sft-two": "/b/sft-two/"}


def test_unreadable_yaml_is_reported(tmp_path):
    with pytest.raises(SettingsError, match="not valid YAML"):
        load_settings(write(tmp_path, "a: [\n"), env={})


@pytest.mark.parametrize("name", ["demo-cpu.yaml", "deepseek-v2-lite.yaml", "deepseek-v3.yaml", "docker-gpu.yaml"])
def test_shipped_configs_load(name):
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "configs" / name
    assert load_settings(str(path), env={}).engine == "ktransformers"


def test_the_ktransformers_engine_is_the_default():
    assert load_settings(None, env={}).engine == "ktransformers"


def test_use_kt_false_selects_the_huggingface_engine(tmp_path):
    assert load_settings(write(tmp_path, "use_kt: false\n"), env={}).engine == "huggingface"


def test_an_unknown_reasoning_parser_stops_start_up():
    with pytest.raises(SettingsError, match="reasoning_parser"):
        load_settings(None, cli={"reasoning_parser": "qwen3"}, env={})
