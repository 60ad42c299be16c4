"""LoRA adapters on the vllm engine, chosen per request by `model`, loaded and unloaded at run time.

vLLM's CPU build cannot run LoRA on a mixture-of-experts model (test_vllm_engine.py checks the 400 that
says so), so these run on the smallest real dense architecture it serves with LoRA: a two-layer Llama with
seeded random weights and the demo model's tokenizer. References are transformers in float32 with each
adapter merged into the weights."""
from __future__ import annotations

import asyncio
import shutil

import pytest

from tests.conftest import start_server
from tests.helpers import greedy_reference
from tests.lora_helpers import make_peft_adapter

# vLLM starts three processes that each import it: minutes on two busy cores
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
START_TIMEOUT = 600

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def llama(tmp_path_factory, demo_model_dir):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=129280, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # unit-scale activations and logits a few units wide, as in the demo model
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
        model.model.embed_tokens.weight.normal_(0, 1)
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(demo_model_dir / name, out / name)
    return out, model.eval()


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory):
    """Two all-linear adapters under one root: name -> (path, merged reference model)."""
    _, base = llama
    root = tmp_path_factory.mktemp("adapters")
    return root, {name: (root / name, make_peft_adapter(base, "all", root / name, seed=seed))
                  for name, seed in (("first", 0), ("second", 1))}


@pytest.fixture(scope="module")
def server(llama, adapters):
    root, made = adapters
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("tests.conftest.SERVER_START_TIMEOUT", START_TIMEOUT)
        running = start_server(llama[0], engine="vllm", adapters={"first": str(made["first"][0])},
                               adapter_roots=[str(root)])
    yield running
    running.stop()


def expected_text(model, tokenizer, n=12):
    return tokenizer.decode(greedy_reference(model, tokenizer.encode(PROMPT), n), skip_special_tokens=True)


def post(server, path, body):
    with server.http() as http:
        return http.post(path, json=body)


def test_base_and_adapter_requests_in_flight_together_each_get_their_own_weights(server, llama, adapters):
    tokenizer = server.engine.tokenizer
    client = server.async_openai()

    async def both():
        return await asyncio.gather(*(client.completions.create(model=m, prompt=PROMPT, max_tokens=12, temperature=0)
                                      for m in (server.engine.info.id, "first")))

    base, adapted = asyncio.run(asyncio.wait_for(both(), timeout=240))
    assert base.choices[0].text == expected_text(llama[1], tokenizer)
    assert adapted.choices[0].text == expected_text(adapters[1]["first"][1], tokenizer)
    assert adapted.choices[0].text != base.choices[0].text


def test_an_adapter_loaded_at_run_time_serves_and_unloads(server, adapters):
    path, merged = adapters[1]["second"]
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "second", "lora_path": str(path)})
    assert r.status_code == 200, r.text
    assert "second" in {m.id for m in server.openai().models.list().data}
    reply = server.openai().completions.create(model="second", prompt=PROMPT, max_tokens=12, temperature=0)
    assert reply.choices[0].text == expected_text(merged, server.engine.tokenizer)
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "second"}).status_code == 200
    r = post(server, "/v1/completions", {"model": "second", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404, r.text


def test_an_adapter_vllm_cannot_read_is_a_400_and_the_server_goes_on(server, adapters):
    from tests.lora_helpers import write_value_head

    head_only = adapters[0] / "head-only"
    head_only.mkdir(exist_ok=True)
    write_value_head(head_only, 256)
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "head", "lora_path": str(head_only)})
    assert r.status_code == 400, r.text
    assert "PEFT LoRA directories only" in r.json()["error"]["message"]
    assert post(server, "/v1/completions", {"model": "first", "prompt": PROMPT, "max_tokens": 2}).status_code == 200
