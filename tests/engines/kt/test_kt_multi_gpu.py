"""A model split over several GPUs by a rule file (KT engine): the plan on the meta device (runs in CI), and
on a machine with 2 or 4 GPUs (pytest -m gpu) the served output against the same file folded onto one GPU.

Tolerance of the GPU comparisons: a split changes where tensors live, not the arithmetic - the same bf16
kernels on the same GPU model with the same shapes, and exact device-to-device copies - so the runs are
expected to be bit-identical (each test prints what it saw). The bounds leave room for at most a stray
bf16 rounding flip: the logits are bf16 with a spread of ~8 units, where one rounding step is 0.03-0.06,
so a flip upstream moves a few logprobs by a fraction of a unit, never the median."""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.conftest import start_server

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "tests/data/kt_rules"
SHIPPED = ROOT / "kt_optimize_rules"
OURS_2GPU = RULES / "demo-2gpu.yaml"  # our rule vocabulary: layers 0-1 cuda:0, 2-3 + norm + head cuda:1
KT_2GPU = RULES / "DeepSeek-V3-tiny-ktransformers-multi-gpu.yaml"  # KTransformers' vocabulary, transfer_map
OURS_4GPU = RULES / "demo-4gpu.yaml"  # one layer per GPU
# The fine-tune guide's file: on the 4-layer demo every layer falls in its cuda:0 range and only the final
# norm and the LM head are on cuda:1 (embeddings and rotary tables on the CPU)
GUIDE_2GPU = SHIPPED / "DeepSeek-V3-Chat-sft-amx-multi-gpu.yaml"
SPLIT_FILES = {"ours": OURS_2GPU, "ktransformers": KT_2GPU}

MAX_LOGPROB_DIFF = 0.25
MEDIAN_LOGPROB_DIFF = 0.01
MIN_TOP1_AGREEMENT = 0.98
TEXT = ("The history of the river begins in the mountains, where snow melts each spring and feeds a hundred "
        "small streams. They join in the valley, turn the old mills and slow down in the plain. ") * 10
PROMPT_TOKENS = 300
MESSAGES = [{"role": "user", "content": "Tell me about rivers."}]


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_two_gpus = pytest.mark.skipif(gpu_count() < 2, reason="needs 2 CUDA devices")
needs_four_gpus = pytest.mark.skipif(gpu_count() < 4, reason="needs 4 CUDA devices")


# --- planning (CPU / meta device) ------------------------------------------------------------------------

def demo_meta_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    from engines.kt.families.deepseek_mla.demo_model import demo_config

    config = AutoConfig.for_model(**{k: v for k, v in demo_config().items() if k != "architectures"})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def plan_for(rule_file: Path, gpus: int, model=None):
    """The placement the server plans for `rule_file` on a machine with `gpus` GPUs (CPU default device)."""
    from engines.kt.placement.rules import device_folding, load_rules, plan_placement

    rules = load_rules(rule_file)
    return plan_placement(model if model is not None else demo_meta_model(), rules, default_device="cpu",
                          fold=device_folding(rules, gpus))


def layer_plan(placement, layers: int = 4) -> list[str]:
    return [placement.device_of_param(f"model.layers.{i}.self_attn.o_proj.weight") for i in range(layers)]


@pytest.mark.parametrize("vocabulary", sorted(SPLIT_FILES))
def test_two_gpu_demo_files_put_two_layers_on_each_gpu_and_the_head_on_the_second(vocabulary):
    placement = plan_for(SPLIT_FILES[vocabulary], gpus=2)
    assert layer_plan(placement) == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert placement.transfer_map[2] == "cuda:1"
    assert placement.device_of_param("model.norm.weight") == "cuda:1"
    assert placement.device_of_param("lm_head.weight") == "cuda:1"
    assert placement.device_of_param("model.layers.3.mlp.experts.down_proj") == "cpu"


def test_four_gpu_demo_file_on_two_gpus_alternates_and_hops_back_to_the_first():
    placement = plan_for(OURS_4GPU, gpus=2)
    assert layer_plan(placement) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert placement.transfer_map == {1: "cuda:1", 2: "cuda:0", 3: "cuda:1"}
    assert placement.device_of_param("lm_head.weight") == "cuda:1"


def test_shipped_four_gpu_file_on_two_gpus_uses_only_those_two():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM

    config = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                              kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, q_lora_rank=16,
                              num_hidden_layers=61, first_k_dense_replace=3, n_group=2, topk_group=1)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    placement = plan_for(SHIPPED / "DeepSeek-V3-4GPU.yaml", gpus=2, model=model)
    assert placement.transfer_map == {10: "cuda:1", 28: "cuda:0", 46: "cuda:1"}
    assert set(placement.devices.values()) == {"cpu", "cuda:0", "cuda:1"}
    assert placement.device_of_param("lm_head.weight") == "cuda:1"


@pytest.mark.parametrize("vocabulary", sorted(SPLIT_FILES))
def test_two_gpu_demo_files_on_one_gpu_keep_every_layer_on_it_without_hops(vocabulary):
    placement = plan_for(SPLIT_FILES[vocabulary], gpus=1)
    assert layer_plan(placement) == ["cuda:0"] * 4
    assert set(placement.transfer_map.values()) <= {"cuda:0"}  # at most the hop in from CPU embeddings
    assert placement.device_of_param("lm_head.weight") == "cuda:0"


def test_benchmark_model_exceeds_one_gpus_budget_and_its_rule_file_splits_it_in_two_that_fit(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.multi_gpu import gpu_bytes, split_point, two_gpu_rules, v3_config

    config = v3_config(layers=20, experts=8, top_k=4)
    budget = 10 * 1024 ** 3  # the benchmark's default per-GPU cap
    first_of_second, halves = split_point(config)
    assert sum(gpu_bytes(config).values()) > budget > 1.2 * max(halves)
    (tmp_path / "rules.yaml").write_text(two_gpu_rules(config, first_of_second))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
            **{k: v for k, v in config.items() if k != "architectures"}))
    placement = plan_for(tmp_path / "rules.yaml", gpus=2, model=model)
    assert placement.transfer_map == {first_of_second: "cuda:1"}
    assert layer_plan(placement, 20) == ["cuda:0"] * first_of_second + ["cuda:1"] * (20 - first_of_second)
    assert placement.device_of_param("lm_head.weight") == "cuda:1"


def test_cuda_graphs_asked_for_a_model_not_on_one_gpu_are_skipped_with_the_reason(demo_model_dir, caplog):
    running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16",
                           kt_optimize_rule="DeepSeek-CPU.yaml")
    try:
        runner = running.engine._runner
        with caplog.at_level(logging.INFO, logger="ktserve.engine.kt"):
            runner.capture_decode_graphs(2)
        assert runner.graphs is None
        assert any("without CUDA graphs" in r.getMessage() and "cpu" in r.getMessage() for r in caplog.records)
        reply = running.openai().completions.create(model=running.engine.info.id, prompt="Rivers", max_tokens=4,
                                                    temperature=0)
        assert reply.choices[0].finish_reason == "length"
    finally:
        running.stop()


# --- on 2 (and 4) GPUs -----------------------------------------------------------------------------------

@dataclass
class Served:
    """What one server did with the fixed requests, and where its layers, caches and hops were."""

    logprobs: list[float]
    top1: list[str]
    greedy: list[list[str]]
    layer_devices: list[str]
    cache_devices: list[str]
    layer_inputs: dict[int, set[str]] = field(default_factory=dict)
    head_inputs: set[str] = field(default_factory=set)
    graphs_captured: bool = False
    # MoE layer -> (experts the GPU computes, how many of them lie in GPU memory, the device whose kernels read
    # them: where the resident ones lie too)
    read_experts: dict[int, tuple[int, int, str]] = field(default_factory=dict)


def serve_and_observe(model_dir: Path, tokenizer, rule_file: Path, cuda_graph: bool, method: str,
                      resident: int) -> Served:
    from engines.kt.experts.cpu import RoutedExpertsCPU

    running = start_server(model_dir, engine="ktransformers", kt_method=method, kt_optimize_rule=str(rule_file),
                           kt_use_cuda_graph=cuda_graph, kt_gpu_resident_experts=resident)
    try:
        runner = running.engine._runner
        read_experts = {}
        for m in runner.model.modules():
            if isinstance(m, RoutedExpertsCPU) and m.owned and m.layer_idx in m.streamer.mapped.layers:
                kept = m.streamer.resident.get(m.layer_idx)
                assert kept is None or kept.gate_up.device == m.streamer.mapped.device
                read_experts[m.layer_idx] = (m.owned, m.resident, str(m.streamer.mapped.device))
        layer_inputs: dict[int, set[str]] = {}
        head_inputs: set[str] = set()
        hooks = [layer.input_layernorm.register_forward_pre_hook(
            lambda _m, args, i=i: layer_inputs.setdefault(i, set()).add(str(args[0].device)))
            for i, layer in enumerate(runner.layers)]
        hooks.append(runner.model.lm_head.register_forward_pre_hook(
            lambda _m, args: head_inputs.add(str(args[0].device))))
        client, model = running.openai(), running.engine.info.id
        try:
            reply = client.completions.create(model=model, prompt=tokenizer.encode(TEXT)[:PROMPT_TOKENS],
                                              max_tokens=0, echo=True, logprobs=1)
            lp = reply.choices[0].logprobs
            chat = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=32, n=3,
                                                  logprobs=True)
        finally:
            for hook in hooks:
                hook.remove()
        return Served(logprobs=lp.token_logprobs[1:], top1=[max(d, key=d.get) for d in lp.top_logprobs[1:]],
                      greedy=[[e.token for e in c.logprobs.content] for c in chat.choices],
                      layer_devices=[str(d) for d in runner.layer_devices],
                      cache_devices=[str(t.device) for t in runner.cache.layers], layer_inputs=layer_inputs,
                      head_inputs=head_inputs, graphs_captured=runner.graphs is not None, read_experts=read_experts)
    finally:
        running.stop()


def on_one_gpu(rule_file: Path, folder: Path) -> Path:
    """The same rule file with every cuda:N written as cuda:0: the single-GPU run of the same code path."""
    out = folder / f"one-gpu-{rule_file.name}"
    out.write_text(re.sub(r"cuda:\d+", "cuda:0", rule_file.read_text()))
    return out


@pytest.fixture(scope="module")
def served(demo_model_dir, tokenizer, tmp_path_factory):
    """served(rule_file, one_gpu=False, cuda_graph=False, method="BF16", resident=0) -> Served, each configuration
    started once."""
    seen: dict[tuple, Served] = {}
    folder = tmp_path_factory.mktemp("rules")

    def get(rule_file: Path, one_gpu: bool = False, cuda_graph: bool = False, method: str = "BF16",
            resident: int = 0) -> Served:
        key = (rule_file, one_gpu, cuda_graph, method, resident)
        if key not in seen:
            path = on_one_gpu(rule_file, folder) if one_gpu else rule_file
            seen[key] = serve_and_observe(demo_model_dir, tokenizer, path, cuda_graph, method, resident)
        return seen[key]
    return get


def assert_same_logprobs(split: Served, single: Served, label: str) -> None:
    assert len(split.logprobs) == len(single.logprobs) == PROMPT_TOKENS - 1
    diffs = sorted(abs(a - b) for a, b in zip(split.logprobs, single.logprobs))
    agree = sum(a == b for a, b in zip(split.top1, single.top1)) / len(single.top1)
    print(json.dumps({"split": label, "positions": len(diffs), "max_logprob_diff": diffs[-1],
                      "median_logprob_diff": diffs[len(diffs) // 2], "identical_fraction": diffs.count(0.0) / len(diffs),
                      "top1_agreement": agree}))
    assert diffs[len(diffs) // 2] <= MEDIAN_LOGPROB_DIFF
    assert diffs[-1] <= MAX_LOGPROB_DIFF
    assert agree >= MIN_TOP1_AGREEMENT


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("vocabulary", sorted(SPLIT_FILES))
def test_split_over_two_gpus_gives_the_one_gpu_prompt_logprobs(served, vocabulary):
    rule_file = SPLIT_FILES[vocabulary]
    assert_same_logprobs(served(rule_file), served(rule_file, one_gpu=True), vocabulary)


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "cuda-graph"])
@pytest.mark.parametrize("vocabulary", sorted(SPLIT_FILES))
def test_split_over_two_gpus_decodes_the_one_gpu_greedy_tokens(served, vocabulary, cuda_graph):
    rule_file = SPLIT_FILES[vocabulary]
    split, single = served(rule_file, cuda_graph=cuda_graph), served(rule_file, one_gpu=True)
    print(json.dumps({"split": vocabulary, "cuda_graph": cuda_graph, "greedy": split.greedy[0]}))
    assert split.greedy == single.greedy


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize(("resident", "owned"), [(0, 8), (4, 10)], ids=["host-memory", "some-in-gpu-memory"])
def test_experts_the_gpus_read_from_host_memory_are_read_by_their_layers_gpu_and_match_one_gpu(served, resident,
                                                                                              owned):
    # AMXINT8: by default each MoE layer's first experts are computed by the GPU its output goes to, from
    # copies in pinned host memory (kt_gpu_read_experts: 8 of the demo's 16), or the first 4 from that GPU's
    # own memory and the balance of the other 12 from host memory (kt_gpu_resident_experts=4); a split model
    # has such a reader on each GPU
    split = served(OURS_2GPU, method="AMXINT8", resident=resident)
    single = served(OURS_2GPU, one_gpu=True, method="AMXINT8", resident=resident)
    moe_layers = sorted(single.read_experts)
    assert moe_layers and set(single.read_experts.values()) == {(owned, resident, "cuda:0")}
    assert split.read_experts == {i: (owned, resident, split.layer_devices[i]) for i in moe_layers}
    assert {device for *_, device in split.read_experts.values()} == {"cuda:0", "cuda:1"}
    assert_same_logprobs(split, single, f"AMXINT8, {resident} of {owned} experts in GPU memory")
    assert split.greedy == single.greedy


@pytest.mark.gpu
@needs_two_gpus
def test_cuda_graphs_on_a_split_model_are_off_and_decode_runs_eagerly(served):
    assert served(OURS_2GPU, one_gpu=True, cuda_graph=True).graphs_captured  # one GPU: captured
    assert not served(OURS_2GPU, cuda_graph=True).graphs_captured


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("vocabulary", sorted(SPLIT_FILES))
def test_each_layers_latent_cache_lives_on_its_layers_gpu(served, vocabulary):
    split = served(SPLIT_FILES[vocabulary])
    assert split.layer_devices == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert split.cache_devices == split.layer_devices


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("vocabulary", sorted(SPLIT_FILES))
def test_hidden_states_cross_to_the_second_gpu_at_the_transfer_point(served, vocabulary):
    split = served(SPLIT_FILES[vocabulary])
    assert split.layer_inputs == {0: {"cuda:0"}, 1: {"cuda:0"}, 2: {"cuda:1"}, 3: {"cuda:1"}}
    assert split.head_inputs == {"cuda:1"}


@pytest.mark.gpu
@needs_two_gpus
def test_fine_tune_guide_file_serves_with_the_head_on_the_second_gpu(served):
    split, single = served(GUIDE_2GPU), served(GUIDE_2GPU, one_gpu=True)
    assert split.cache_devices == ["cuda:0"] * 4
    assert split.head_inputs == {"cuda:1"}
    assert_same_logprobs(split, single, "fine-tune guide file")
    assert split.greedy == single.greedy


@pytest.mark.gpu
@needs_two_gpus
def test_four_gpu_file_runs_folded_onto_the_gpus_there_are(served):
    split, single = served(OURS_4GPU), served(OURS_4GPU, one_gpu=True)
    expected = [f"cuda:{i % min(gpu_count(), 4)}" for i in range(4)]
    assert split.layer_devices == split.cache_devices == expected
    assert split.layer_inputs == {i: {d} for i, d in enumerate(expected)}
    assert_same_logprobs(split, single, "four-gpu file")
    assert split.greedy == single.greedy


@pytest.mark.gpu
@needs_four_gpus
def test_four_gpu_file_puts_one_layer_on_each_of_four_gpus(served):
    split, single = served(OURS_4GPU), served(OURS_4GPU, one_gpu=True)
    assert split.cache_devices == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert split.head_inputs == {"cuda:3"}
    assert_same_logprobs(split, single, "four gpus")
    assert split.greedy == single.greedy

