"""The KT engine finds a checkpoint's family through engines/kt/families/__init__.py alone: by config.json
`model_type` (FAMILIES), else by architecture under any model type (ARCHITECTURES: V2 / V3, Kimi-K2's kimi_k2
among them, and a GGUF's deepseek2)."""
from __future__ import annotations

from types import SimpleNamespace

from engines.kt.families import family_architectures, family_for, family_for_architecture


def config(model_type: str, architecture: str) -> SimpleNamespace:
    return SimpleNamespace(model_type=model_type, architectures=[architecture])


def test_a_listed_model_type_gets_its_own_family():
    assert family_for(config("deepseek_v4", "DeepseekV4ForCausalLM")).name == "deepseek_v4"
    assert family_for(config("deepseek_v32", "DeepseekV32ForCausalLM")).name == "deepseek_v32"


def test_an_architecture_under_a_model_type_of_its_own_gets_that_architectures_family_reporting_it():
    family = family_for(config("kimi_k2", "DeepseekV3ForCausalLM"))
    assert family.name == "deepseek_mla"
    assert family.architectures == ("DeepseekV3ForCausalLM",)


def test_the_architecture_the_engine_read_decides_over_the_configs_own():
    assert family_for(config("deepseek_v2", "?"), "DeepseekV2ForCausalLM").architectures == ("DeepseekV2ForCausalLM",)


def test_an_architecture_no_family_serves_has_none():
    assert family_for(config("llama", "LlamaForCausalLM")) is None
    assert family_for_architecture("DeepseekV4ForCausalLM") is None  # V4 is found by its model_type only


def test_the_served_architectures_are_every_familys():
    assert family_architectures() == ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                                      "DeepseekV4ForCausalLM")
