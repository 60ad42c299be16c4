"""Embeddings on both engines: POST /v1/embeddings through the official openai client (base64, its default,
and float), Ollama's /api/embed and /api/embeddings through the ollama package. A vector is the final (normed)
hidden states averaged over the input's tokens, scaled to unit length — checked against transformers."""
from __future__ import annotations

import asyncio
import math
import threading

import ollama
import openai
import pytest
import torch

TEXTS = ["The sea was calm that morning.", "Deux chats dorment au soleil.", "42"]


def reference_embedding(model, token_ids: list[int]) -> list[float]:
    with torch.inference_mode():
        states = model.model(input_ids=torch.tensor([token_ids])).last_hidden_state[0].float()
    return torch.nn.functional.normalize(states.mean(0), dim=0).tolist()


def tolerance(server) -> float:
    """The HF engine computes in float32 like the reference; the KT engine's experts round to bf16."""
    return 1e-4 if server.engine.name == "huggingface" else 2e-2


def assert_close(a: list[float], b: list[float], tol: float) -> None:
    assert len(a) == len(b)
    assert max(abs(x - y) for x, y in zip(a, b)) <= tol


def test_an_embedding_is_the_unit_length_mean_of_the_final_hidden_states(server, tokenizer, reference_model):
    vector = server.openai().embeddings.create(model=server.engine.info.id, input=TEXTS[0]).data[0].embedding
    assert math.isclose(sum(x * x for x in vector), 1.0, rel_tol=1e-3)
    assert_close(vector, reference_embedding(reference_model, tokenizer.encode(TEXTS[0])), tolerance(server))


def test_base64_and_float_encodings_carry_the_same_vector(server):
    client = server.openai()
    as_base64 = client.embeddings.create(model=server.engine.info.id, input=TEXTS[1])  # the client's default
    as_float = client.embeddings.create(model=server.engine.info.id, input=TEXTS[1], encoding_format="float")
    assert_close(as_base64.data[0].embedding, as_float.data[0].embedding, 1e-6)


def test_a_list_of_inputs_gives_one_vector_each_in_order_equal_to_one_at_a_time(server):
    client = server.openai()
    together = client.embeddings.create(model=server.engine.info.id, input=TEXTS, encoding_format="float")
    assert [d.index for d in together.data] == [0, 1, 2]
    for text, item in zip(TEXTS, together.data):
        alone = client.embeddings.create(model=server.engine.info.id, input=text, encoding_format="float")
        assert_close(item.embedding, alone.data[0].embedding, tolerance(server))


def test_token_ids_embed_like_their_text_and_usage_counts_them(server, tokenizer):
    client = server.openai()
    ids = tokenizer.encode(TEXTS[2])
    by_ids = client.embeddings.create(model=server.engine.info.id, input=[ids, ids], encoding_format="float")
    by_text = client.embeddings.create(model=server.engine.info.id, input=TEXTS[2], encoding_format="float")
    assert_close(by_ids.data[1].embedding, by_text.data[0].embedding, tolerance(server))
    assert by_ids.usage.prompt_tokens == by_ids.usage.total_tokens == 2 * len(ids)


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "dimensions": 64}, "dimensions"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "word " * 5000}, "input"),
], ids=["dimensions", "empty-string", "empty-list", "empty-ids", "id-outside-vocab", "encoding", "too-long"])
def test_invalid_embedding_requests_are_400_naming_the_field(server, body, param):
    with server.http() as http:
        r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_client_sees_a_clear_error_for_dimensions(server):
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        server.openai().embeddings.create(model=server.engine.info.id, input="hi", dimensions=8)


def test_an_unknown_model_is_404(server):
    with pytest.raises(openai.NotFoundError):
        server.openai().embeddings.create(model="no-such-model", input="hi")


def test_ollama_embed_returns_one_vector_per_input(server):
    client = ollama.Client(host=server.base_url)
    reply = client.embed(model=server.engine.info.id, input=TEXTS[:2])
    assert len(reply.embeddings) == 2 and reply.prompt_eval_count > 0
    openai_vector = server.openai().embeddings.create(model=server.engine.info.id, input=TEXTS[0],
                                                      encoding_format="float").data[0].embedding
    assert_close(list(reply.embeddings[0]), openai_vector, tolerance(server))


def test_ollama_embed_truncates_a_long_input_unless_told_not_to(server):
    client = ollama.Client(host=server.base_url)
    long_text = "word " * 5000
    assert len(client.embed(model=server.engine.info.id, input=long_text).embeddings) == 1
    with pytest.raises(ollama.ResponseError) as caught:
        client.embed(model=server.engine.info.id, input=long_text, truncate=False)
    assert caught.value.status_code == 400


def test_the_older_ollama_embeddings_route_returns_one_vector(server):
    reply = ollama.Client(host=server.base_url).embeddings(model=server.engine.info.id, prompt=TEXTS[0])
    assert len(reply.embedding) > 0
    assert math.isclose(sum(x * x for x in reply.embedding), 1.0, rel_tol=1e-3)


def test_embedding_requests_waiting_for_the_engine_are_computed_in_one_batch(server, monkeypatch):
    """While the engine thread is busy, arriving requests queue; the next batch takes them all at once."""
    engine = server.engine
    runner = engine._runner
    batches: list[int] = []
    original = runner.final_hidden_states

    def counted(prompts, adapter):
        batches.append(len(prompts))
        return original(prompts, adapter)

    monkeypatch.setattr(runner, "final_hidden_states", counted)
    tokens = [engine.tokenizer.encode(t) for t in TEXTS]
    gate = threading.Event()
    busy = threading.Thread(target=engine.run_on_engine_thread, args=(lambda: gate.wait(30),))
    busy.start()

    async def three_requests():
        tasks = [asyncio.create_task(engine.embed([ids])) for ids in tokens]
        await asyncio.sleep(0)  # each task runs up to its wait: all three are queued
        gate.set()
        return await asyncio.gather(*tasks)

    try:
        vectors = asyncio.run(three_requests())
    finally:
        gate.set()
        busy.join(timeout=30)
    assert batches == [3] and len(vectors) == 3
