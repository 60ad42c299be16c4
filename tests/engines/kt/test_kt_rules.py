"""Placement rules (engines/kt/placement/rules.py): matching, aliasing of KTransformers files, shipped rule files."""

import logging
import re
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import DeepseekV2Config, DeepseekV3Config, DeepseekV32Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32ForCausalLM

from engines.kt.placement.aliases import MLA_ATTENTION, MOE_WITH_CPU_EXPERTS, ROUTED_EXPERTS_CPU
from engines.kt.placement.rules import RuleError, apply_placement, device_folding, load_rules, plan_placement

ROOT = Path(__file__).resolve().parents[3]
SHIPPED_DIR = ROOT / "kt_optimize_rules"
KT_STYLE_FILE = ROOT / "tests/data/kt_rules/DeepSeek-V3-tiny-ktransformers-multi-gpu.yaml"
V3 = "transformers.models.deepseek_v3.modeling_deepseek_v3"

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4,
            num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=4)


def v3_model(layers: int = 4, dense: int = 1, **sizes: int) -> nn.Module:
    config = DeepseekV3Config(**{**TINY, **sizes}, num_hidden_layers=layers, first_k_dense_replace=dense, n_shared_experts=1,
                              n_group=2, topk_group=1, q_lora_rank=16)
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(config)


def v2_model(layers: int, q_lora_rank: int | None) -> nn.Module:
    config = DeepseekV2Config(**TINY, num_hidden_layers=layers, first_k_dense_replace=1, n_shared_experts=2,
                              q_lora_rank=q_lora_rank)
    with torch.device("meta"):
        return DeepseekV2ForCausalLM(config)


def v4_model(layers: int) -> nn.Module:
    from engines.kt.families.deepseek_v4.demo_model import demo_config_v4
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    fields = {k: v for k, v in demo_config_v4(num_hidden_layers=layers, vocab_size=1024,
                                             compress_ratios=[0, 4, 128, 4, 128, 0]).items()
              if k not in ("architectures", "model_type", "quantization_config", "torch_dtype")}
    with torch.device("meta"):
        return DeepseekV4ForCausalLM(DeepseekV4Config(**fields))


def v32_model(layers: int, dense: int) -> nn.Module:
    config = DeepseekV32Config(**TINY, num_hidden_layers=layers, first_k_dense_replace=dense, n_shared_experts=1,
                               n_group=2, topk_group=1, q_lora_rank=16, index_n_heads=2, index_head_dim=8)
    with torch.device("meta"):
        return DeepseekV32ForCausalLM(config)


def rules(tmp_path: Path, text: str, name: str = "rules.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return load_rules(path)


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(RuleError) as caught:
        rules(tmp_path, text, "bad.yaml")
    return str(caught.value)


# --- matching -------------------------------------------------------------------------------------------

def test_first_matching_rule_wins(tmp_path):
    placement = plan_placement(v3_model(), rules(tmp_path, r"""
        - match: {name: '^model\.layers\.0\.self_attn$'}
          replace: {class: default, kwargs: {device: "cuda:1"}}
        - match: {name: 'self_attn$'}
          replace: {class: default, kwargs: {device: "cuda:2"}}
        """))
    assert placement.devices["model.layers.0.self_attn"] == "cuda:1"
    assert placement.devices["model.layers.1.self_attn"] == "cuda:2"


def test_rule_with_name_and_class_needs_both_to_match(tmp_path):
    placement = plan_placement(v3_model(dense=1), rules(tmp_path, rf"""
        - match: {{name: '^model\.layers\.\d+\.mlp$', class: {V3}.DeepseekV3MoE}}
          replace: {{class: engines.kt.placement.operators.MoEWithCPUExperts}}
        """))
    # Layer 0's mlp has the right name but is the dense DeepseekV3MLP.
    assert sorted(placement.replacements) == ["model.layers.1.mlp", "model.layers.2.mlp", "model.layers.3.mlp"]


def test_recursive_false_stops_matching_below_the_module(tmp_path):
    placement = plan_placement(v3_model(), rules(tmp_path, r"""
        - match: {name: '^model\.layers\.1$'}
          replace: {class: default, kwargs: {device: "cuda:1"}}
          recursive: false
        - match: {name: 'self_attn$'}
          replace: {class: default, kwargs: {device: "cuda:2"}}
        """))
    assert placement.devices["model.layers.1.self_attn"] == "cuda:1"
    assert placement.devices["model.layers.0.self_attn"] == "cuda:2"


def test_default_sets_the_device_and_children_inherit_it(tmp_path):
    placement = plan_placement(v3_model(), rules(tmp_path, r"""
        - match: {name: '^model\.layers\.2$'}
          replace: {class: default, kwargs: {device: "cuda:1"}}
        """), default_device="cuda:0")
    below = {path: device for path, device in placement.devices.items() if path.startswith("model.layers.2.")}
    assert below and set(below.values()) == {"cuda:1"}
    assert placement.device_of_param("model.layers.2.self_attn.o_proj.weight") == "cuda:1"
    assert placement.device_of_param("model.layers.3.self_attn.o_proj.weight") == "cuda:0"


def test_the_empty_name_matches_the_model_itself(tmp_path):
    placement = plan_placement(v3_model(), rules(tmp_path, """
        - match: {name: '^$'}
          replace: {class: default, kwargs: {device: cpu}}
        """), default_device="cuda:0")
    assert placement.default_device == "cpu"
    assert set(placement.devices.values()) == {"cpu"}


def test_routed_expert_weights_are_planned_on_the_cpu(tmp_path):
    placement = plan_placement(v3_model(), rules(tmp_path, r"""
        - match: {name: '^model\.layers\.1\.mlp$'}
          replace: {class: engines.kt.placement.operators.MoEWithCPUExperts, kwargs: {device: "cuda:0"}}
          recursive: false
        """))
    assert placement.device_of_param("model.layers.1.mlp.experts.gate_up_proj") == "cpu"
    assert placement.device_of_param("model.layers.1.mlp.gate.weight") == "cuda:0"
    assert placement.replacements["model.layers.1.mlp"][1]["device"] == "cuda:0"


def test_operator_inside_another_operator_is_an_error(tmp_path):
    with pytest.raises(RuleError, match=r"rules.yaml:\d+: rule 1: replace.class: .*inside model.layers.1.mlp"):
        plan_placement(v3_model(), rules(tmp_path, r"""
            - match: {name: '^model\.layers\.1\.mlp$'}
              replace: {class: engines.kt.placement.operators.MoEWithCPUExperts}
            - match: {name: 'shared_experts$'}
              replace: {class: engines.kt.placement.operators.MLAAttention}
            """))


def test_unused_rules_are_warned_with_their_index(tmp_path, caplog):
    loaded = rules(tmp_path, r"""
        - match: {name: '^lm_head$'}
          replace: {class: default, kwargs: {device: cpu}}
        - match: {name: '^model\.layers\.99\.'}
          replace: {class: default, kwargs: {device: "cuda:1"}}
        """)
    with caplog.at_level(logging.WARNING, logger="ktserve.kt.rules"):
        placement = plan_placement(v3_model(), loaded)
    assert [rule.index for rule in placement.unused_rules] == [1]
    assert re.search(r"rules\.yaml:4: rule 1 matched no module", caplog.text)


# --- KTransformers aliases ------------------------------------------------------------------------------

def test_ktransformers_class_names_are_aliased(tmp_path):
    # KTransformers' V2 modeling class name also matches the V3 MoE block: its V3 files were written so.
    placement = plan_placement(v3_model(), rules(tmp_path, r"""
        - match: {name: '\.mlp$', class: ktransformers.models.modeling_deepseek.DeepseekV2MoE}
          replace: {class: ktransformers.operators.experts.KDeepseekV3MoE}
          recursive: False
        - match: {name: 'self_attn$'}
          replace: {class: ktransformers.operators.attention.KDeepseekV2Attention}
          recursive: False
        """))
    replaced = {path: rule.replace for path, (rule, _) in placement.replacements.items()}
    assert replaced["model.layers.1.mlp"] == MOE_WITH_CPU_EXPERTS
    assert replaced["model.layers.0.self_attn"] == MLA_ATTENTION
    assert "model.layers.0.mlp" not in replaced


def test_ktransformers_kwargs_are_aliased(tmp_path):
    [rule] = rules(tmp_path, """
        - match: {name: 'mlp\\.experts$'}
          replace:
            class: ktransformers.operators.experts.KTransformersExperts
            kwargs: {prefill_device: cuda, prefill_op: KExpertsTorch, generate_device: cpu,
                     generate_op: KExpertsCPU, out_device: cuda, backend: AMXInt4}
          recursive: False
        """)
    assert rule.replace == ROUTED_EXPERTS_CPU
    assert rule.kwargs == {"device": "cuda:0", "method": "AMXINT4"}


def test_generate_device_wins_over_a_different_prefill_device(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="ktserve.kt.rules"):
        [rule] = rules(tmp_path, """
            - match: {name: '^lm_head$', class: torch.nn.Linear}
              replace:
                class: ktransformers.operators.linear.KTransformersLinear
                kwargs: {generate_device: cpu, prefill_device: cuda, generate_op: KLinearMarlin}
            """)
    assert rule.kwargs == {"device": "cpu"}
    assert "rule 0: prefill_device cuda:0 differs from generate_device cpu" in caplog.text


def test_experts_rule_inside_a_moe_rule_is_folded_into_the_moe_operator(tmp_path):
    placement = plan_placement(v3_model(), rules(tmp_path, r"""
        - match: {name: '\.mlp$', class: ktransformers.models.modeling_deepseek_v3.DeepseekV3MoE}
          replace: {class: ktransformers.operators.experts.KDeepseekV3MoE, kwargs: {generate_device: "cuda:1"}}
        - match: {name: '\.mlp\.experts$'}
          replace:
            class: ktransformers.operators.experts.KTransformersExperts
            kwargs: {generate_device: cpu, out_device: "cuda:1", backend: AMXInt8}
          recursive: False
        """))
    assert sorted(placement.replacements) == ["model.layers.1.mlp", "model.layers.2.mlp", "model.layers.3.mlp"]
    assert placement.replacements["model.layers.1.mlp"][1] == {"device": "cuda:1", "method": "AMXINT8"}
    assert placement.unused_rules == []


def test_ktransformers_style_file_loads_and_plans():
    placement = plan_placement(v3_model(layers=4, dense=1), load_rules(KT_STYLE_FILE))
    assert placement.unused_rules == []
    replaced = {path: (rule.replace, kwargs) for path, (rule, kwargs) in placement.replacements.items()}
    assert replaced == {
        "model.layers.0.self_attn": (MLA_ATTENTION, {"device": "cuda:0"}),
        "model.layers.1.self_attn": (MLA_ATTENTION, {"device": "cuda:0"}),
        "model.layers.1.mlp": (MOE_WITH_CPU_EXPERTS, {"device": "cuda:0", "method": "AMXINT8"}),
        "model.layers.2.self_attn": (MLA_ATTENTION, {"device": "cuda:1"}),
        "model.layers.2.mlp": (MOE_WITH_CPU_EXPERTS, {"device": "cuda:1", "method": "AMXINT8"}),
        "model.layers.3.self_attn": (MLA_ATTENTION, {"device": "cuda:1"}),
        "model.layers.3.mlp": (MOE_WITH_CPU_EXPERTS, {"device": "cuda:1", "method": "AMXINT8"}),
    }
    assert placement.transfer_map == {2: "cuda:1"}
    assert placement.device_of_param("model.embed_tokens.weight") == "cpu"
    assert placement.device_of_param("model.layers.0.mlp.down_proj.weight") == "cuda:0"
    assert placement.device_of_param("model.layers.2.mlp.experts.down_proj") == "cpu"
    assert placement.device_of_param("model.layers.3.input_layernorm.weight") == "cuda:1"
    assert placement.device_of_param("lm_head.weight") == "cuda:1"


def test_declared_transfer_map_must_agree_with_the_layer_placement(tmp_path):
    with pytest.raises(RuleError, match=r"rule 0: replace.kwargs.transfer_map: says \{1: 'cuda:1'\}"):
        plan_placement(v3_model(), rules(tmp_path, """
            - match: {name: '^model$'}
              replace: {class: ktransformers.operators.models.KDeepseekV2Model, kwargs: {transfer_map: {1: "cuda:1"}}}
            """))


# --- errors name the file, the rule index and the key ----------------------------------------------------

def test_unknown_operator_class_is_an_error_naming_file_index_and_class(tmp_path):
    message = error_of(tmp_path, """
        - match: {name: '^lm_head$'}
          replace: {class: default}
        - match: {name: 'self_attn$'}
          replace: {class: ktransformers.operators.attention.KFancyAttention}
        """)
    assert re.match(r".*bad\.yaml:4: rule 1: replace\.class: unknown operator class "
                    r"'ktransformers\.operators\.attention\.KFancyAttention'", message)


def test_unknown_match_class_is_an_error_naming_file_index_and_key(tmp_path):
    message = error_of(tmp_path, """
        - match: {class: ktransformers.models.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock}
          replace: {class: default}
        """)
    assert re.match(r".*bad\.yaml:2: rule 0: match\.class: unknown class 'ktransformers\.models\.", message)


def test_unsupported_ktransformers_kwarg_is_an_error_naming_file_index_and_key(tmp_path):
    message = error_of(tmp_path, """
        - match: {name: 'experts$'}
          replace:
            class: ktransformers.operators.experts.KTransformersExpertsV2
            kwargs: {out_device: cuda, chunck_size: 512}
        """)
    assert re.match(r".*bad\.yaml:2: rule 0: replace\.kwargs\.chunck_size: unsupported kwarg", message)


def test_knob_with_its_harmless_value_is_accepted_and_any_other_rejected(tmp_path):
    accepted = rules(tmp_path, """
        - match: {name: 'self_attn$'}
          replace: {class: ktransformers.operators.attention.KDeepseekV2Attention,
                    kwargs: {generate_device: cuda, absorb_for_prefill: False}}
        """)
    assert accepted[0].kwargs == {"device": "cuda:0"}
    message = error_of(tmp_path, """
        - match: {name: 'self_attn$'}
          replace: {class: ktransformers.operators.attention.KDeepseekV2Attention, kwargs: {absorb_for_prefill: True}}
        """)
    assert "rule 0: replace.kwargs.absorb_for_prefill: unsupported value True" in message


def test_unknown_kwarg_on_default_is_an_error_naming_file_index_and_key(tmp_path):
    message = error_of(tmp_path, """
        - match: {name: '^lm_head$'}
          replace: {class: default, kwargs: {device: cpu, method: AMXINT8}}
        """)
    assert "bad.yaml:2: rule 0: replace.kwargs.method: not accepted by default" in message


def test_bad_device_is_an_error_naming_file_index_and_key(tmp_path):
    message = error_of(tmp_path, """
        - match: {name: '^lm_head$'}
          replace: {class: default, kwargs: {generate_device: "gpu0"}}
        """)
    assert "bad.yaml:2: rule 0: replace.kwargs.generate_device: 'gpu0' is not a device" in message


def test_unknown_top_level_key_is_an_error_naming_file_index_and_key(tmp_path):
    message = error_of(tmp_path, """
        - match: {name: 'experts$'}
          replace: {class: engines.kt.placement.operators.RoutedExpertsCPU}
          recursve: false
        """)
    assert "bad.yaml:2: rule 0: recursve: unknown key" in message


def test_bad_regular_expression_is_an_error_naming_file_index_and_key(tmp_path):
    message = error_of(tmp_path, """
        - match: {name: '^model\\.layers\\.(\\d+\\.mlp$'}
          replace: {class: default}
        """)
    assert "bad.yaml:2: rule 0: match.name: bad regular expression" in message


def test_operator_kwarg_outside_its_KWARGS_is_an_error_and_changes_nothing(tmp_path):
    model = v3_model()
    placement = plan_placement(model, rules(tmp_path, r"""
        - match: {name: 'self_attn$'}
          replace: {class: engines.kt.placement.operators.MLAAttention}
        - match: {name: '\.mlp$', class: ktransformers.models.modeling_deepseek_v3.DeepseekV3MoE}
          replace: {class: engines.kt.placement.operators.MoEWithCPUExperts, kwargs: {threads: 4, absorb: true}}
        """))
    with pytest.raises(RuleError, match=r"rules\.yaml:4: rule 1: replace\.kwargs\.absorb: not accepted by FakeMoE"):
        apply_placement(model, placement, model.config, operator_resolver=fake_operators)
    assert not any(isinstance(module, FakeOperator) for module in model.modules())



def test_an_operator_that_cannot_take_the_matched_module_is_an_error_naming_the_rule(tmp_path):
    model = v3_model(layers=2, dense=1)
    placement = plan_placement(model, rules(tmp_path, r"""
        - match: {name: '\.mlp$'}
          replace: {class: engines.kt.placement.operators.MoEWithCPUExperts, kwargs: {method: BF16}}
        """))
    with pytest.raises(RuleError, match=r"rules\.yaml:2: rule 0: replace: MoEWithCPUExperts cannot replace "
                                        r"model\.layers\.0\.mlp \(DeepseekV3MLP\)"):
        apply_placement(model, placement, model.config)


def test_a_kwarg_value_the_operator_refuses_is_an_error_naming_the_rule_and_the_kwarg(tmp_path):
    model = v3_model(layers=2, dense=1, moe_intermediate_size=32)  # sizes kt-kernel's BF16 kernel takes
    placement = plan_placement(model, rules(tmp_path, r"""
        - match: {name: '\.mlp$', class: ktransformers.models.modeling_deepseek_v3.DeepseekV3MoE}
          replace: {class: engines.kt.placement.operators.MoEWithCPUExperts, kwargs: {method: BF16, n_deferred_experts: 99}}
        """))
    with pytest.raises(RuleError, match=r"rules\.yaml:2: rule 0: replace: .*n_deferred_experts=99 must be below"):
        apply_placement(model, placement, model.config)

# --- applying -------------------------------------------------------------------------------------------

class FakeOperator(nn.Module):
    """Stands in for an engines.kt.placement.operators class: same from_module/KWARGS protocol, no kernels."""

    KWARGS = frozenset({"device"})

    def __init__(self, original: nn.Module, name: str, config, kwargs: dict):
        super().__init__()
        self.original_type, self.name, self.config, self.kwargs = type(original), name, config, kwargs

    @classmethod
    def from_module(cls, module, name, config, options, **kwargs):
        return cls(module, name, config, kwargs)


class FakeAttention(FakeOperator):
    KWARGS = frozenset({"device", "absorb"})


class FakeMoE(FakeOperator):
    KWARGS = frozenset({"device", "method", "gpu_experts", "threads"})


class FakeExperts(FakeOperator):
    KWARGS = frozenset({"device", "method", "gpu_experts"})


def fake_operators(path: str) -> type:
    fakes = {MLA_ATTENTION: FakeAttention, MOE_WITH_CPU_EXPERTS: FakeMoE, ROUTED_EXPERTS_CPU: FakeExperts}
    if path not in fakes:
        raise ImportError(path)
    return fakes[path]


def test_apply_placement_replaces_exactly_the_planned_modules():
    model = v3_model(layers=4, dense=1)
    placement = plan_placement(model, load_rules(KT_STYLE_FILE))
    apply_placement(model, placement, model.config, operator_resolver=fake_operators)
    swapped = {path: module for path, module in model.named_modules() if isinstance(module, FakeOperator)}
    assert swapped.keys() == placement.replacements.keys()
    moe = swapped["model.layers.2.mlp"]
    assert (type(moe), moe.name, moe.config, moe.kwargs) == (FakeMoE, "model.layers.2.mlp", model.config,
                                                             {"device": "cuda:1", "method": "AMXINT8"})
    assert moe.original_type.__name__ == "DeepseekV3MoE"
    assert type(model.get_submodule("model.layers.0.mlp")).__name__ == "DeepseekV3MLP"


# --- shipped rule files ---------------------------------------------------------------------------------

MODELS = {
    "v2-lite": lambda: v2_model(layers=27, q_lora_rank=None),
    "v2": lambda: v2_model(layers=60, q_lora_rank=16),
    "v3": lambda: v3_model(layers=61, dense=3),
    "v4": lambda: v4_model(layers=6),
    "v3.2": lambda: v32_model(layers=61, dense=3),
}
# file -> (models it is for, first device, the transfer map its header promises)
SHIPPED = {
    "DeepSeek-V2-Lite.yaml": (["v2-lite"], "cuda:0", {}),
    "DeepSeek-V2-Lite-defer.yaml": (["v2-lite"], "cuda:0", {}),
    "DeepSeek-V2.yaml": (["v2"], "cuda:0", {}),
    "DeepSeek-V2-2GPU.yaml": (["v2"], "cuda:0", {30: "cuda:1"}),
    "DeepSeek-V2-4GPU.yaml": (["v2"], "cuda:0", {13: "cuda:1", 30: "cuda:2", 46: "cuda:3"}),
    "DeepSeek-V3.yaml": (["v3"], "cuda:0", {}),
    "DeepSeek-V3-2GPU.yaml": (["v3"], "cuda:0", {30: "cuda:1"}),
    "DeepSeek-V3-4GPU.yaml": (["v3"], "cuda:0", {10: "cuda:1", 28: "cuda:2", 46: "cuda:3"}),
    "DeepSeek-CPU.yaml": (["v2-lite", "v2", "v3"], "cpu", {}),
    "DeepSeek-V4-Flash.yaml": (["v4"], "cuda:0", {}),
    "DeepSeek-V4-CPU.yaml": (["v4"], "cpu", {}),
    "DeepSeek-V3.2.yaml": (["v3.2"], "cuda:0", {}),
    "DeepSeek-V3.2-CPU.yaml": (["v3.2"], "cpu", {}),
}


GUIDE_FILE = "DeepSeek-V3-Chat-sft-amx-multi-gpu.yaml"  # KTransformers' vocabulary: its own tests below


def test_every_shipped_rule_file_has_an_expectation():
    assert sorted(path.name for path in SHIPPED_DIR.glob("*.yaml")) == sorted([*SHIPPED, GUIDE_FILE])


@pytest.mark.parametrize("file_name,model_name",
                         [(name, model) for name, (models, _, _) in SHIPPED.items() for model in models])
def test_shipped_rule_file_places_every_weight_as_its_header_says(file_name, model_name):
    _, first, transfer_map = SHIPPED[file_name]
    model = MODELS[model_name]()
    placement = plan_placement(model, load_rules(SHIPPED_DIR / file_name), default_device="cuda:7")
    assert placement.unused_rules == []
    assert placement.default_device == first
    assert placement.transfer_map == transfer_map

    def layer_device(index: int) -> str:
        return next((transfer_map[k] for k in sorted(transfer_map, reverse=True) if k <= index), first)

    last = layer_device(model.config.num_hidden_layers - 1)
    for name, _ in model.named_parameters():
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        expected = ("cpu" if ".mlp.experts." in name else layer_device(int(layer.group(1))) if layer
                    else last if name.startswith(("model.norm.", "lm_head.")) else first)
        assert placement.device_of_param(name) == expected, name


@pytest.mark.parametrize("model_name", SHIPPED["DeepSeek-CPU.yaml"][0])
def test_cpu_rule_file_replaces_attention_and_routed_experts(model_name):
    model = MODELS[model_name]()
    placement = plan_placement(model, load_rules(SHIPPED_DIR / "DeepSeek-CPU.yaml"))
    kinds = [rule.replace for rule, _ in placement.replacements.values()]
    layers = model.config.num_hidden_layers
    assert kinds.count(MLA_ATTENTION) == layers
    assert kinds.count(ROUTED_EXPERTS_CPU) == layers - model.config.first_k_dense_replace


def test_dense_mla_rules_on_a_v32_model_are_an_error_naming_the_indexed_operator():
    model = v32_model(layers=2, dense=1)
    placement = plan_placement(model, load_rules(SHIPPED_DIR / "DeepSeek-CPU.yaml"), default_device="cpu")
    with pytest.raises(RuleError, match="lightning indexer.*IndexedMLAAttention"):
        apply_placement(model, placement, model.config)


# --- the server's own path: CPU default device, KTransformers' files, machines with fewer GPUs ------------

def test_multi_gpu_file_plans_with_the_embeddings_on_the_cpu_as_the_server_plans_it():
    placement = plan_placement(v3_model(layers=4, dense=1), load_rules(KT_STYLE_FILE), default_device="cpu")
    assert placement.transfer_map == {0: "cuda:0", 2: "cuda:1"}  # the hop into layer 0 is implied, not declared
    assert placement.device_of_param("model.embed_tokens.weight") == "cpu"


def test_guide_rule_file_splits_v3_over_two_gpus_with_sft_experts_on_the_cpu():
    placement = plan_placement(MODELS["v3"](), load_rules(SHIPPED_DIR / GUIDE_FILE), default_device="cpu")
    assert placement.transfer_map == {0: "cuda:0", 30: "cuda:1"}
    experts = [kwargs for rule, kwargs in placement.replacements.values() if rule.replace == MOE_WITH_CPU_EXPERTS]
    assert len(experts) == 58 and all(k["method"] == "AMXINT8" for k in experts)
    assert placement.device_of_param("model.layers.40.mlp.experts.down_proj") == "cpu"
    assert placement.device_of_param("lm_head.weight") == "cuda:1"


@pytest.mark.parametrize(("gpus", "expected"), [(0, {"cuda:0": "cpu", "cuda:1": "cpu"}), (1, {"cuda:1": "cuda:0"}),
                                                (2, {})])
def test_devices_a_machine_lacks_fold_onto_the_gpus_it_has_else_the_cpu(gpus, expected):
    assert device_folding(load_rules(SHIPPED_DIR / GUIDE_FILE), gpus) == expected


def test_four_gpu_file_on_two_gpus_keeps_its_balance():
    fold = device_folding(load_rules(SHIPPED_DIR / "DeepSeek-V3-4GPU.yaml"), 2)
    assert fold == {"cuda:2": "cuda:0", "cuda:3": "cuda:1"}


def test_folded_multi_gpu_file_plans_everything_on_the_cpu():
    rules_ = load_rules(SHIPPED_DIR / GUIDE_FILE)
    placement = plan_placement(MODELS["v3"](), rules_, default_device="cpu", fold=device_folding(rules_, 0))
    assert set(placement.devices.values()) == {"cpu"} and placement.transfer_map == {}


@pytest.mark.parametrize("op", ["KSFTExpertsCPU", "KSFTRouteExpertsCPU", "KExpertsCPU"])
def test_sft_expert_ops_of_the_fine_tune_files_serve_as_cpu_experts(tmp_path, op):
    placement = plan_placement(v3_model(), rules(tmp_path, f"""
        - match: {{name: '^model\\.layers\\..*\\.mlp\\.experts$'}}
          replace:
            class: ktransformers.operators.experts.KTransformersExperts
            kwargs: {{generate_device: cpu, generate_op: {op}, prefill_op: KExpertsTorch, out_device: "cuda:0",
                      backend: AMXInt8}}
        """), default_device="cpu")
    assert {(rule.replace, kwargs["method"]) for rule, kwargs in placement.replacements.values()} == {
        (ROUTED_EXPERTS_CPU, "AMXINT8")}


def test_serve_files_flashinfer_attention_is_our_mla_attention(tmp_path):
    placement = plan_placement(v3_model(), rules(tmp_path, """
        - match: {name: 'self_attn$'}
          replace: {class: ktransformers.operators.balance_serve_attention.flashinfer_attn}
        """))
    assert {rule.replace for rule, _ in placement.replacements.values()} == {MLA_ATTENTION}


def test_the_shipped_deferral_file_defers_two_experts_of_every_moe_layer():
    model = MODELS["v2-lite"]()
    placement = plan_placement(model, load_rules(SHIPPED_DIR / "DeepSeek-V2-Lite-defer.yaml"))
    moe = [rule for rule, _ in placement.replacements.values() if rule.replace.endswith("MoEWithCPUExperts")]
    assert moe and all(rule.kwargs.get("n_deferred_experts") == 2 for rule in moe)


def test_expert_deferral_reaches_the_experts_operator(tmp_path):
    loaded = rules(tmp_path, """
        - match: {name: 'experts$'}
          replace:
            class: ktransformers.operators.experts.KTransformersExpertsV2
            kwargs: {out_device: cuda, n_deferred_experts: [6]}
        """)
    assert loaded[0].replace == ROUTED_EXPERTS_CPU
    assert loaded[0].kwargs == {"device": "cuda:0", "n_deferred_experts": [6]}


@pytest.mark.parametrize("device", ["xpu", "npu", "xpu:0"])
def test_intel_and_ascend_devices_are_refused_naming_the_rule(tmp_path, device):
    message = error_of(tmp_path, f"""
        - match: {{name: '^lm_head$'}}
          replace: {{class: default, kwargs: {{generate_device: "{device}"}}}}
        """)
    assert "bad.yaml:2: rule 0: replace.kwargs.generate_device:" in message
    assert "this device is not supported" in message


def test_first_generation_replace_device_places_the_module(tmp_path):
    placement = plan_placement(v3_model(), rules(tmp_path, """
        - match: {name: '^model\\.layers\\..*\\.mlp\\.experts$'}
          replace:
            class: ktransformers.operators.experts.KTransformersMLPExpert
            device: "cpu"
            kwargs: {prefill_mlp_type: MLPExpertsTorch, generate_mlp_type: MLPCPUExperts}
          recursive: false
        """), default_device="cpu")
    assert {rule.replace for rule, _ in placement.replacements.values()} == {ROUTED_EXPERTS_CPU}


def test_missing_relative_rule_path_is_found_by_file_name_among_ours():
    from engines.kt.engine import resolve_rule_file

    found = resolve_rule_file("examples/kt_optimize_rules/" + GUIDE_FILE, None)
    assert found == SHIPPED_DIR / GUIDE_FILE


def test_fused_rms_norm_equals_transformers_within_one_rounding():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    from engines.kt.placement.operators import FusedRMSNorm

    torch.manual_seed(0)
    reference = DeepseekV3RMSNorm(512, eps=1e-6).to(torch.bfloat16)
    reference.weight.data = torch.rand(512, dtype=torch.bfloat16) + 0.5
    x = torch.randn(7, 512, dtype=torch.bfloat16) * 3
    fused = FusedRMSNorm(reference.weight, reference.variance_epsilon)(x)
    assert fused.dtype == torch.bfloat16
    torch.testing.assert_close(fused.float(), reference(x).float(), rtol=2 ** -7, atol=1e-3)


def test_a_fused_v4_rms_norm_scales_in_float32_as_transformers_does():
    """DeepSeek-V4's norms keep float32 weights, scale in float32 and round once: the upcast form gives the same
    bf16 values on the CPU (on a GPU the fused kernel's sum may round differently)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

    from engines.kt.placement.operators import FusedRMSNorm

    torch.manual_seed(0)
    reference = DeepseekV4RMSNorm(1024, eps=1e-6).float()
    reference.weight.data = torch.rand(1024) + 0.5
    x = torch.randn(7, 1024, dtype=torch.bfloat16) * 3
    fused = FusedRMSNorm(reference.weight, reference.variance_epsilon, upcast=True)(x)
    assert fused.dtype == torch.bfloat16
    assert torch.equal(fused, reference(x))


def test_only_norms_on_a_gpu_are_fused():
    from engines.kt.placement.operators import FusedRMSNorm, fuse_rms_norms

    model = DeepseekV3ForCausalLM(DeepseekV3Config(**TINY, num_hidden_layers=2, first_k_dense_replace=1))
    assert fuse_rms_norms(model) == 0
    assert not any(isinstance(m, FusedRMSNorm) for m in model.modules())
