"""The vllm engine's request mapping, against the installed vLLM's own classes (no engine running): our
engine settings, sampling parameters, grammars and adapters in vLLM's terms, and vLLM's streamed outputs in
ours."""
from __future__ import annotations

import json

import pytest

from dataclasses import replace

from engines.base import (
    EngineConfig, GenerationRequest, InvalidRequestError, SamplingParams, UnsupportedError, json_schema_grammar,
)
from engines.lora.adapter import LoraAdapter, LoraWeight

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def token_text(tokenizer):
    from engines.runtime.sampler import TokenText

    return TokenText(tokenizer)


def cpu_engine_args(monkeypatch, model_path, engine_settings=None, **config):
    from engines.base import engine_options
    from engines.vllm import settings

    monkeypatch.setattr(settings, "on_cuda", lambda: False)
    cfg = EngineConfig(model_path=str(model_path), settings=engine_settings or {}, **config)
    return settings.engine_args(cfg, engine_options(settings.VLLMOptions, cfg.settings))


def test_a_float32_mla_model_on_the_cpu_runs_on_vllms_reference_mla_backend(monkeypatch, demo_model_dir):
    # vLLM would pick its AMX MLA backend on an AMX CPU, which loads bfloat16 weights only
    args = cpu_engine_args(monkeypatch, demo_model_dir)
    assert (args.dtype, args.attention_backend) == ("float32", "CPU_MLA")


def test_a_bfloat16_mla_model_on_the_cpu_leaves_the_attention_backend_to_vllm(monkeypatch, demo_model_dir):
    assert cpu_engine_args(monkeypatch, demo_model_dir, dtype="bfloat16").attention_backend is None


def test_an_attention_config_in_vllm_config_replaces_the_chosen_backend(monkeypatch, demo_model_dir):
    args = cpu_engine_args(monkeypatch, demo_model_dir,
                           engine_settings={"vllm_config": {"attention_config": {"backend": "CPU_MLA"}}})
    assert args.attention_backend is None and args.attention_config.backend is not None


def request(prompt=(5, 6, 7), **sampling) -> GenerationRequest:
    return GenerationRequest(prompt_token_ids=list(prompt), sampling=SamplingParams(**sampling), request_id="r1")


def test_sampling_parameters_carry_over_and_stream_deltas():
    from vllm.sampling_params import RequestOutputKind

    from engines.vllm.requests import sampling_params

    p = sampling_params(request(max_tokens=9, temperature=0.5, top_p=0.9, top_k=4, min_p=0.1, seed=7,
                                presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1,
                                logit_bias={3: 2.0}, stop=("END",), stop_token_ids=(2,), ignore_eos=True,
                                min_tokens=2, logprobs=3, prompt_logprobs=1, include_stop_str_in_output=True), 20)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (9, 0.5, 0.9, 4, 0.1, 7)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, 0.25, 1.1)
    assert p.logit_bias == {3: 2.0} and p.stop == ["END"] and p.stop_token_ids == [2]
    assert p.ignore_eos and p.min_tokens == 2 and p.include_stop_str_in_output
    assert (p.logprobs, p.prompt_logprobs) == (3, 1)
    assert p.output_kind == RequestOutputKind.DELTA


def test_prompt_scoring_asks_vllm_for_one_token():
    from engines.vllm.requests import sampling_params

    assert sampling_params(request(max_tokens=0, prompt_logprobs=0), 20).max_tokens == 1


def test_more_logprobs_than_the_server_allows_is_a_400_naming_the_field():
    from engines.vllm.requests import sampling_params

    with pytest.raises(InvalidRequestError) as err:
        sampling_params(request(logprobs=21), 20)
    assert err.value.param == "logprobs"


def test_a_json_schema_grammar_becomes_vllms_json_constraint():
    from engines.vllm.requests import sampling_params

    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})
    p = sampling_params(request(grammar=grammar), 20)
    assert p.structured_outputs.json == json.loads(grammar.source)


def test_a_grammar_that_starts_after_reasoning_is_refused():
    from engines.vllm.requests import sampling_params

    grammar = replace(json_schema_grammar({"type": "object"}), start_after=128799)
    with pytest.raises(UnsupportedError, match="reasoning"):
        sampling_params(request(grammar=grammar), 20)


def completion(text, ids, logprobs=None, finish_reason=None, stop_reason=None):
    from vllm.outputs import CompletionOutput

    return CompletionOutput(index=0, text=text, token_ids=ids, cumulative_logprob=None, logprobs=logprobs,
                            finish_reason=finish_reason, stop_reason=stop_reason)


def output(outputs, finished, prompt_logprobs=None):
    from vllm.outputs import RequestOutput

    return RequestOutput(request_id="r1", prompt=None, prompt_token_ids=[5, 6, 7], prompt_logprobs=prompt_logprobs,
                         outputs=outputs, finished=finished)


def test_deltas_keep_text_tokens_and_ranked_logprobs(token_text):
    from vllm.logprobs import Logprob

    from engines.vllm.requests import OutputStream

    stream = OutputStream(request(logprobs=1, max_tokens=4), token_text)
    # the sampled token 9 is ranked 2nd: it is reported, and only the rank-1 token is an alternative
    first = stream.convert(output([completion("ab", [9], [{9: Logprob(-1.5, 2), 4: Logprob(-0.5, 1)}])], False))
    assert (first.text, first.token_ids, first.finish_reason, first.completion_tokens) == ("ab", [9], None, 1)
    assert first.logprobs[0].logprob == -1.5 and [t.token_id for t in first.logprobs[0].top] == [4]
    assert first.logprobs[0].token == token_text.lookup(9)[0]
    last = stream.convert(output([completion("c", [1], [{1: Logprob(-0.1, 1)}], "stop", "END")], True))
    assert (last.finish_reason, last.stop_reason, last.completion_tokens) == ("stop", "END", 2)


def test_prompt_logprobs_come_once_with_none_for_the_first_token(token_text):
    from vllm.logprobs import Logprob

    from engines.vllm.requests import OutputStream

    stream = OutputStream(request(prompt_logprobs=0, max_tokens=0), token_text)
    rows = [None, {6: Logprob(-2.0, 3)}, {7: Logprob(-1.0, 1)}]
    out = stream.convert(output([completion("x", [11])], True, prompt_logprobs=rows))
    assert out.prompt_logprobs[0] is None
    assert [e.logprob for e in out.prompt_logprobs[1:]] == [-2.0, -1.0]
    # scoring only: the one token vLLM had to generate is dropped
    assert (out.text, out.token_ids, out.completion_tokens, out.finish_reason) == ("", [], 0, "length")


def test_an_aborted_request_ends_with_abort_and_a_failed_one_with_error(token_text):
    from engines.vllm.requests import OutputStream

    stream = OutputStream(request(), token_text)
    assert stream.aborted().finish_reason == "abort"
    failed = stream.aborted("boom")
    assert (failed.finish_reason, failed.error) == ("error", "boom")


def adapter(format="peft", module="model.layers.0.self_attn.o_proj", rank=4) -> LoraAdapter:
    import torch

    weight = LoraWeight(a=torch.zeros(rank, 8), b=torch.zeros(8, rank), scale=1.0)
    return LoraAdapter(path="/adapters/x", format=format, linears={module: weight})


def adapters(max_rank=8):
    from engines.vllm.adapters import VLLMAdapters

    return VLLMAdapters(llm=lambda: None, call=lambda coro: None, max_rank=max_rank)


@pytest.mark.parametrize("bad", [adapter(format="gguf"), adapter(module="model.layers.0.self_attn.kv_b_proj"),
                                 adapter(module="model.layers.1.mlp.gate")])
def test_adapters_vllm_cannot_apply_are_refused_with_the_reason(bad):
    with pytest.raises(UnsupportedError, match="vllm engine"):
        adapters().prepare(bad)


def test_expert_lora_is_refused():
    import torch

    from engines.lora.adapter import ExpertLora

    bad = adapter()
    bad.experts = {1: {"gate": ExpertLora(torch.zeros(2, 4, 8), torch.zeros(2, 8, 4), 1.0)}}
    with pytest.raises(UnsupportedError, match="routed experts"):
        adapters().prepare(bad)


def test_an_adapter_above_the_rank_limit_is_a_400_naming_lora_path():
    with pytest.raises(InvalidRequestError) as err:
        adapters(max_rank=8).prepare(adapter(rank=16))
    assert err.value.param == "lora_path"


def test_a_lora_request_names_the_adapter_and_its_path():
    from vllm.lora.request import LoRARequest

    from engines.vllm.requests import lora_request

    r = lora_request("mine", 3, "/adapters/mine")
    assert isinstance(r, LoRARequest) and (r.lora_name, r.lora_int_id, r.lora_path) == ("mine", 3, "/adapters/mine")
