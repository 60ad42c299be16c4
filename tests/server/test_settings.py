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


def test_kt_weight_path_is_read_under_its_name_sglangs_and_as_a_flag(tmp_path, capsys):
    from server.cli import main

    assert load_settings(write(tmp_path, "kt_weight_path: /w\n"), env={}).kt_weight_path == "/w"
    assert load_settings(write(tmp_path, "kt_amx_weight_path: /w\n"), env={}).engine_config("m").settings[
        "kt_weight_path"] == "/w"
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--kt-weight-path" in capsys.readouterr().out


def test_use_kt_selects_the_ktransformers_engine(tmp_path):
    assert load_settings(write(tmp_path, "use_kt: true\n"), env={}).engine == "ktransformers"


def test_env_overrides_yaml_and_cli_overrides_env(tmp_path):
    cfg = write(tmp_path, "port: 7000\nmax_concurrent: 3\n")
    s = load_settings(cfg, cli={"port": 9000}, env={"API_PORT": "8001", "MAX_CONCURRENT": "5", "API_KEY": "k"})
    assert (s.port, s.max_concurrent, s.api_key) == (9000, 5, "k")


def test_a_bad_value_names_the_key_and_its_source(tmp_path):
    with pytest.raises(SettingsError, match=r"max_concurrent \(from environment\)"):
        load_settings(None, env={"MAX_CONCURRENT": "many"})


def test_a_chunk_size_of_0_is_refused_naming_the_key_and_an_unset_one_is_left_to_the_engine():
    with pytest.raises(SettingsError, match=r"chunk_size \(from command line\): .*greater than 0"):
        load_settings(None, cli={"chunk_size": 0}, env={})
    settings = load_settings(None, cli={}, env={})
    assert (settings.chunk_size, settings.kt_gpu_prefill_tokens) == (None, None)


def test_a_negative_gpu_prefill_threshold_is_refused_naming_the_key():
    with pytest.raises(SettingsError, match=r"kt_gpu_prefill_tokens \(from command line\): .*greater than or equal to 0"):
        load_settings(None, cli={"kt_gpu_prefill_tokens": -5}, env={})


def test_a_gpu_expert_share_that_is_not_a_whole_number_of_experts_is_refused_naming_the_key():
    with pytest.raises(SettingsError, match=r"kt_gpu_read_experts \(from command line\): .*greater than or equal to 0"):
        load_settings(None, cli={"kt_gpu_read_experts": -1}, env={})
    with pytest.raises(SettingsError, match=r"kt_gpu_read_experts \(from environment\): .*valid integer"):
        load_settings(None, env={"KTSERVE_KT_GPU_READ_EXPERTS": "half"})
    assert load_settings(None, env={"KTSERVE_KT_GPU_READ_EXPERTS": "24"}).kt_gpu_read_experts == 24


def test_a_negative_or_fractional_count_of_experts_in_gpu_memory_is_refused_naming_the_key():
    with pytest.raises(SettingsError,
                       match=r"kt_gpu_resident_experts \(from command line\): .*greater than or equal to 0"):
        load_settings(None, cli={"kt_gpu_resident_experts": -4}, env={})
    with pytest.raises(SettingsError, match=r"kt_gpu_resident_experts \(from environment\): .*valid integer"):
        load_settings(None, env={"KTSERVE_KT_GPU_RESIDENT_EXPERTS": "2.5"})


def test_a_streamed_experts_budget_that_is_not_positive_is_refused_naming_the_key():
    with pytest.raises(SettingsError, match=r"kt_gpu_prefill_memory \(from command line\): .*greater than 0"):
        load_settings(None, cli={"kt_gpu_prefill_memory": 0}, env={})
    with pytest.raises(SettingsError, match=r"kt_gpu_prefill_memory \(from environment\): .*valid number"):
        load_settings(None, env={"KTSERVE_KT_GPU_PREFILL_MEMORY": "lots"})
    assert load_settings(None, env={"KTSERVE_KT_GPU_PREFILL_MEMORY": "2.5"}).kt_gpu_prefill_memory == 2.5


def test_a_worker_isolation_switch_that_is_not_a_boolean_is_refused_naming_the_key():
    with pytest.raises(SettingsError, match=r"kt_isolate_workers \(from environment\): .*valid boolean"):
        load_settings(None, env={"KTSERVE_KT_ISOLATE_WORKERS": "sometimes"})
    assert load_settings(None, env={"KTSERVE_KT_ISOLATE_WORKERS": "false"}).kt_isolate_workers is False


def test_a_negative_expert_padding_start_is_refused_naming_the_key():
    with pytest.raises(SettingsError, match=r"kt_expert_pad_from \(from environment\): .*greater than or equal to 0"):
        load_settings(None, env={"KTSERVE_KT_EXPERT_PAD_FROM": "-1"})
    assert load_settings(None, env={"KTSERVE_KT_EXPERT_PAD_FROM": "0"}).kt_expert_pad_from == 0
    assert load_settings(None, env={}).kt_expert_pad_from is None  # the method's measured default


def test_an_unknown_speculative_method_is_refused_naming_the_key():
    with pytest.raises(SettingsError, match=r"speculative \(from environment\): .*'mtp'"):
        load_settings(None, env={"KTSERVE_SPECULATIVE": "eagle"})


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
    path = Path(__file__).resolve().parents[2] / "configs" / name
    assert load_settings(str(path), env={}).engine == "ktransformers"


def test_the_ktransformers_engine_is_the_default():
    assert load_settings(None, env={}).engine == "ktransformers"


def test_use_kt_false_selects_the_huggingface_engine(tmp_path):
    assert load_settings(write(tmp_path, "use_kt: false\n"), env={}).engine == "huggingface"


def test_an_unknown_reasoning_parser_stops_start_up():
    with pytest.raises(SettingsError, match="reasoning_parser"):
        load_settings(None, cli={"reasoning_parser": "qwen3"}, env={})


def serve_flags(*flags: str) -> dict:
    """What `ktserve serve FLAGS` hands to load_settings."""
    import argparse

    from server.cli import _cli_overrides, _serve_parser

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    return {k: v for k, v in _cli_overrides(parser.parse_args(["serve", *flags])).items() if v is not None}


def test_every_setting_is_a_flag_named_after_it():
    import argparse

    from server.cli import _serve_parser
    from server.settings import Settings

    sub = argparse.ArgumentParser().add_subparsers()
    _serve_parser(sub)
    flags = {action.dest: action.option_strings for action in sub.choices["serve"]._actions}
    singular = {"adapters": "--adapter", "adapter_roots": "--adapter-root", "cors_origins": "--cors-origin"}
    for name in Settings.model_fields:
        assert singular.get(name, "--" + name.replace("_", "-")) in flags[name]


@pytest.mark.parametrize("flags, expected", [
    (["--model", "/m", "--served-model-name", "x", "--engine", "huggingface"],
     {"model": "/m", "served_model_name": "x", "engine": "huggingface"}),
    (["--host", "0.0.0.0", "--port", "9000", "--api-key", "k"], {"host": "0.0.0.0", "port": 9000, "api_key": "k"}),
    (["--max-concurrent", "3", "--max-queue", "4", "--max-model-len", "2048", "--max-body-bytes", "10"],
     {"max_concurrent": 3, "max_queue": 4, "max_model_len": 2048, "max_body_bytes": 10}),
    (["--request-timeout", "1.5", "--graceful-timeout", "60", "--read-timeout", "5"],
     {"request_timeout": 1.5, "graceful_timeout": 60.0, "read_timeout": 5.0}),
    (["--metrics-public", "--kt-strict-placement", "--no-prefix-cache", "--kt-use-cuda-graph"],
     {"metrics_public": True, "kt_strict_placement": True, "prefix_cache": False, "kt_use_cuda_graph": True}),
    (["--device", "cpu", "--dtype", "float32", "--template", "deepseek3"],
     {"device": "cpu", "dtype": "float32", "template": "deepseek3"}),
    (["--adapter", "a=/x", "--adapter", "b=/y", "--adapter-root", "/r", "--adapter-root", "/s"],
     {"adapters": {"a": "/x", "b": "/y"}, "adapter_roots": ["/r", "/s"]}),
    (["--kt-optimize-rule", "r.yaml", "--cpu-infer", "4", "--chunk-size", "64", "--kt-method", "BF16",
      "--kt-weight-cache", "/c", "--kv-cache-tokens", "4096", "--attention-backend", "torch"],
     {"kt_optimize_rule": "r.yaml", "cpu_infer": 4, "chunk_size": 64, "kt_method": "BF16", "kt_weight_cache": "/c",
      "kv_cache_tokens": 4096, "attention_backend": "torch"}),
    (["--speculative", "mtp", "--num-speculative-tokens", "2", "--speculative-max-batch", "1",
      "--no-speculative-adaptive"],
     {"speculative": "mtp", "num_speculative_tokens": 2, "speculative_max_batch": 1,
      "speculative_adaptive": False}),
    (["--reasoning-parser", "deepseek_r1", "--cors-origin", "http://a", "--cors-origin", "http://b",
      "--log-format", "json", "--log-level", "debug"],
     {"reasoning_parser": "deepseek_r1", "cors_origins": ["http://a", "http://b"], "log_format": "json",
      "log_level": "debug"}),
])
def test_the_documented_flags_set_their_settings(flags, expected):
    assert serve_flags(*flags) == expected
    settings = load_settings(None, serve_flags(*flags), env={})
    assert {k: getattr(settings, k) for k in expected} == expected


def test_flags_left_out_leave_the_config_file_and_environment_alone(tmp_path):
    s = load_settings(write(tmp_path, "prefix_cache: false\nmetrics_public: true\n"), serve_flags(),
                      env={"API_PORT": "8001"})
    assert (s.prefix_cache, s.metrics_public, s.port) == (False, True, 8001)


def test_an_adapter_flag_without_a_path_is_refused(capsys):
    from server.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--adapter", "lonely"])
    assert "--adapter expects NAME=PATH" in capsys.readouterr().err


def test_engine_specific_settings_reach_the_engine_untouched_and_server_ones_stay_behind():
    config = load_settings(None, {"kt_method": "BF16", "vllm_gpu_util": 0.5, "api_key": "k", "chunk_size": 64},
                           env={}).engine_config("/m")
    assert (config.settings["kt_method"], config.settings["vllm_gpu_util"], config.chunk_size) == ("BF16", 0.5, 64)
    assert "api_key" not in config.settings and "host" not in config.settings
