"""What clients ask about the served models and their tokenizer: GET /v1/models/{model}
(`client.models.retrieve`), Ollama's GET /api/ps (`ollama.ps()`), and vLLM's POST /tokenize and /detokenize."""
from __future__ import annotations

from pathlib import Path

import ollama
import openai
import pytest

from tests.conftest import start_server
from tests.helpers import chat_prompt_ids
from tests.lora_helpers import make_peft_adapter

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def with_adapter(demo_model_dir, tmp_path_factory, reference_model):
    adapter = tmp_path_factory.mktemp("adapters") / "tuned"
    make_peft_adapter(reference_model, "attn", adapter)
    running = start_server(demo_model_dir, adapters={"tuned": str(adapter)})
    running.adapter_path = adapter
    yield running
    running.stop()


def test_models_retrieve_returns_the_base_model(with_adapter):
    model = with_adapter.openai().models.retrieve(with_adapter.engine.info.id)
    assert model.id == with_adapter.engine.info.id and model.object == "model"
    assert model.model_extra["parent"] is None


def test_models_retrieve_returns_an_adapter_with_its_parent(with_adapter):
    model = with_adapter.openai().models.retrieve("tuned")
    assert model.id == "tuned" and model.model_extra["parent"] == with_adapter.engine.info.id


def test_models_retrieve_of_an_unknown_id_is_an_openai_404(with_adapter):
    with pytest.raises(openai.NotFoundError) as caught:
        with_adapter.openai().models.retrieve("no-such-model")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"


def test_retrieve_answers_the_same_card_as_the_list(with_adapter):
    client = with_adapter.openai()
    for card in client.models.list().data:
        assert client.models.retrieve(card.id).model_dump() == card.model_dump()


def test_ollama_ps_lists_the_loaded_model_with_its_size_and_its_adapters(with_adapter):
    models = ollama.Client(host=with_adapter.base_url).ps().models
    base, adapter = models
    assert base.model == with_adapter.engine.info.id + ":latest"
    weights = sum(f.stat().st_size for f in Path(with_adapter.engine.config.model_path).glob("*.safetensors"))
    assert base.size == weights > 0 and base.size_vram == 0  # the CPU holds it all here
    assert base.context_length == with_adapter.engine.info.max_model_len and base.expires_at.year > 2100
    assert adapter.model == "tuned:latest" and adapter.size > 0
    assert adapter.details.parent_model == base.model


def tokenize(server, body):
    with server.http() as http:
        return http.post("/tokenize", json=body)


def test_tokenize_a_prompt_counts_it_as_completions_would(server, tokenizer):
    r = tokenize(server, {"prompt": "Hello there", "return_token_strs": True}).json()
    assert r["tokens"] == tokenizer.encode("Hello there") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == server.engine.info.max_model_len
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])


def test_tokenize_messages_applies_the_chat_template_as_chat_completions_does(server, tokenizer):
    r = tokenize(server, {"messages": MESSAGES}).json()
    assert r["tokens"] == chat_prompt_ids(tokenizer, MESSAGES)
    usage = server.openai().chat.completions.create(model=server.engine.info.id, messages=MESSAGES,
                                                    max_tokens=1).usage
    assert r["count"] == usage.prompt_tokens


def test_detokenize_gives_back_the_text(server, tokenizer):
    ids = tokenizer.encode("A round trip", add_special_tokens=False)
    with server.http() as http:
        assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "A round trip"}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, None),
    ("/tokenize", {"prompt": "x", "model": "nope"}, "model"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
], ids=["neither", "both", "unknown-model", "outside-vocab", "negative"])
def test_bad_tokenize_requests_are_openai_errors(server, path, body, param):
    with server.http() as http:
        r = http.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
