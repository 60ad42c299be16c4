"""What the probe of 2026-11-28 found at the HTTP edge, each sent again and answered as it should be now
(docs/reliability.md lists them): Ollama requests abandoned by their client, oversized Ollama bodies, an
event loop held by one request, adapter files that lead out of the adapter root, the smaller input checks,
and what lm-eval and Ollama clients expect."""
from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from dataclasses import replace

import httpx
import pytest

from .conftest import PROBE_KEY
from tests.helpers import assert_error, forward_logprobs
from tests.lora_helpers import adapter_variant

AUTH = {"Authorization": f"Bearer {PROBE_KEY}"}
CHAT = "/v1/chat/completions"
BODY_LIMIT = 8 * 1024 * 1024  # the default max_body_bytes


def post(server, path, body=None, *, content=None, headers=AUTH, timeout=120.0) -> httpx.Response:
    with server.http(headers=headers, timeout=timeout) as http:
        if content is not None:
            return http.post(path, content=content, headers={"content-type": "application/json"})
        return http.post(path, json=body)


def ollama_error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text[:500]
    assert set(r.json()) == {"error"} and isinstance(r.json()["error"], str), r.text[:500]
    return r.json()["error"]


def still_serving(server, headers=AUTH) -> None:
    r = post(server, CHAT, {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}, headers=headers)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"], r.text[:300]


# ------------------------------------------------------------------------------------ 2: clients that leave
@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
def test_an_ollama_request_without_streaming_stops_generating_when_its_client_leaves(server, monkeypatch, path):
    submit = server.engine.submit

    def endless(request):  # the request runs to its token limit unless something stops it
        return submit(replace(request, sampling=replace(request.sampling, ignore_eos=True)))
    monkeypatch.setattr(server.engine, "submit", endless)
    body = {"model": server.engine.info.id, "stream": False, "options": {"num_predict": 3000},
            **({"messages": [{"role": "user", "content": "go on"}]} if path == "/api/chat" else {"prompt": "go on"})}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after a second
        with server.http(timeout=httpx.Timeout(60, read=1.0)) as http:
            http.post(path, json=body)
    deadline = time.monotonic() + 15  # 3 000 tokens take minutes on either engine here
    while server.engine.stats().running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine.stats().running == 0 and server.engine.stats().waiting == 0
    monkeypatch.undo()
    still_serving(server, headers={})


# ------------------------------------------------------------------------------------ 3: bodies too large
def _chunks(total: int):
    for _ in range(total // 65536 + 1):
        yield b" " * 65536


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/show"])
def test_a_chunked_body_over_the_limit_on_an_ollama_route_is_413_in_ollamas_shape(probe, path):
    r = post(probe, path, content=_chunks(BODY_LIMIT + 65536))
    assert "larger than" in ollama_error(r, 413)
    still_serving(probe)


def test_a_body_over_the_limit_by_its_content_length_on_an_ollama_route_is_413_in_ollamas_shape(probe):
    assert "larger than" in ollama_error(post(probe, "/api/chat", content=b" " * (BODY_LIMIT + 1)), 413)


def test_an_ollama_route_without_the_key_is_401_in_ollamas_shape(probe):
    assert "API key" in ollama_error(post(probe, "/api/chat", {"model": "x"}, headers={}), 401)


# ------------------------------------------------------------------------------------ 6: smaller findings
@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/embeddings", "/v1/responses", "/tokenize"])
@pytest.mark.parametrize("body", [b"{not json", b"[" * 100_000, b'{"prompt": "\\ud800"}'],
                         ids=["syntax", "deep", "surrogate"])
def test_a_malformed_body_without_the_key_is_401_not_a_description_of_the_body(probe, path, body):
    error = assert_error(post(probe, path, content=body, headers={}), 401)
    assert error["type"] == "authentication_error"


def test_a_tool_whose_parameters_are_not_a_json_schema_is_400_even_with_tool_choice_auto(probe):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]
    r = post(probe, CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "auto"})
    assert "not a valid JSON schema" in assert_error(r, 400, "tools[0].function.parameters")["message"]
    still_serving(probe)


def test_api_embed_takes_at_most_2048_inputs_like_v1_embeddings(probe):
    r = post(probe, "/api/embed", {"model": probe.engine.info.id, "input": ["x"] * 3000})
    assert "at most 2048" in ollama_error(r, 400)
    r = post(probe, "/v1/embeddings", {"input": ["x"] * 3000})
    assert "at most 2048" in assert_error(r, 400, "input")["message"]


@pytest.mark.parametrize("body,param", [
    ({"input": "hi " * 200}, "input"),
    ({"input": "hi", "max_output_tokens": 500}, "max_output_tokens"),
    ({"input": [{"role": "wizard", "content": "x"}]}, None),
], ids=["too-long", "max-output-tokens", "bad-role"])
def test_responses_errors_name_the_responses_fields(probe, body, param):
    error = assert_error(post(probe, "/v1/responses", body), 400, param)
    assert "messages" not in error["message"] and "max_tokens" not in error["message"]
    assert "messages" not in (error["param"] or "") and (error["param"] or "input").startswith(("input", "max_"))


# ------------------------------------------------------------------------------------ 6: adapter configs
def _set_config(**values):
    def change(d):
        config = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps({**config, **values}))
    return change


def _poison(value: float):
    def change(d):
        from safetensors.torch import load_file, save_file
        tensors = load_file(str(d / "adapter_model.safetensors"))
        key = sorted(tensors)[0]
        tensors[key][0, 0] = value
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "poisoned-key").write_text(key)
    return change


BAD_CONFIGS = {
    "r-negative": (_set_config(r=-1), "'r'"),
    "alpha-zero": (_set_config(lora_alpha=0), "'lora_alpha'"),
    "alpha-infinite": (lambda d: (d / "adapter_config.json").write_text(
        (d / "adapter_config.json").read_text().replace('"lora_alpha": 8', '"lora_alpha": Infinity')), "'lora_alpha'"),
    "rslora-yes": (_set_config(use_rslora="yes"), "'use_rslora'"),
    "nan-weight": (_poison(math.nan), "NaN or infinite"),
    "inf-weight": (_poison(math.inf), "NaN or infinite"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_an_adapter_with_an_impossible_value_is_400_naming_it(probe, adapter_root, case):
    change, named = BAD_CONFIGS[case]
    path = adapter_variant(adapter_root, case, change)
    error = assert_error(post(probe, "/v1/load_lora_adapter", {"lora_name": case, "lora_path": path}), 400,
                         "lora_path")
    assert named in error["message"], error
    if case.endswith("-weight"):
        assert (adapter_root / case / "poisoned-key").read_text() in error["message"]
    with probe.http(headers=AUTH) as http:
        assert case not in {m["id"] for m in http.get("/v1/models").json()["data"]}


# ------------------------------------------------------------------------------------ 5: adapter files
def _linked_out(adapter_root, name: str, linked: str, target) -> str:
    """A copy of the good adapter inside the root whose `linked` file is a symlink to `target`."""
    directory = adapter_root / name
    if not directory.exists():
        shutil.copytree(adapter_root / "good", directory)
        (directory / linked).unlink()
        (directory / linked).symlink_to(target)
    return str(directory)


@pytest.fixture(scope="module")
def outside_adapter(adapter_root, tmp_path_factory):
    """The good adapter, copied to a place outside the adapter root."""
    outside = tmp_path_factory.mktemp("outside-the-root") / "adapter"
    shutil.copytree(adapter_root / "good", outside)
    return outside


@pytest.mark.parametrize("linked", ["adapter_config.json", "adapter_model.safetensors"])
def test_an_adapter_file_that_links_outside_the_root_is_refused_naming_it(probe, adapter_root, outside_adapter,
                                                                          linked):
    name = "links-out-" + linked.split(".")[0]
    path = _linked_out(adapter_root, name, linked, outside_adapter / linked)
    error = assert_error(post(probe, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}), 400,
                         "lora_path")
    assert linked in error["message"] and "outside the adapter roots" in error["message"]
    with probe.http(headers=AUTH) as http:
        assert name not in {m["id"] for m in http.get("/v1/models").json()["data"]}


def test_an_adapter_config_linked_to_etc_passwd_is_never_read(probe, adapter_root):
    path = _linked_out(adapter_root, "config-to-passwd", "adapter_config.json", "/etc/passwd")
    error = assert_error(post(probe, "/v1/load_lora_adapter", {"lora_name": "passwd", "lora_path": path}), 400)
    assert "outside the adapter roots" in error["message"] and "root:" not in error["message"]


@pytest.mark.parametrize("fifo", ["adapter_config.json", "adapter_model.safetensors", "fused_expert_lora.safetensors",
                                  "value_head.safetensors"])
def test_a_fifo_among_an_adapters_files_is_400_at_once_naming_it(probe, adapter_root, fifo):
    directory = adapter_root / ("fifo-" + fifo.split(".")[0])
    if not directory.exists():
        shutil.copytree(adapter_root / "good", directory)
        if (directory / fifo).exists():
            (directory / fifo).unlink()
        os.mkfifo(directory / fifo)
    r = post(probe, "/v1/load_lora_adapter", {"lora_name": directory.name, "lora_path": str(directory)}, timeout=30)
    error = assert_error(r, 400, "lora_path")
    assert fifo in error["message"] and "not a regular file" in error["message"]


def test_a_link_to_a_file_inside_the_root_still_loads(probe, adapter_root):
    path = _linked_out(adapter_root, "links-inside", "adapter_model.safetensors",
                       adapter_root / "good" / "adapter_model.safetensors")
    r = post(probe, "/v1/load_lora_adapter", {"lora_name": "links-inside", "lora_path": path})
    assert r.status_code == 200, r.text
    assert post(probe, "/v1/unload_lora_adapter", {"lora_name": "links-inside"}).status_code == 200


# ------------------------------------------------------------------------------------ 4: the event loop
def _health_during(server, request) -> list[float]:
    """/health latencies (s) measured while `request()` runs in another thread; at least one is taken."""
    done = threading.Event()
    result = {}

    def run():
        try:
            result["response"] = request()
        finally:
            done.set()
    worker = threading.Thread(target=run)
    latencies = []
    with server.http(timeout=60) as http:
        http.get("/health")  # a connection of its own, open before the request starts
        worker.start()
        for _ in range(2000):  # bounded; the request ends well before
            started = time.perf_counter()
            assert http.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            if done.is_set():
                break
            time.sleep(0.02)
    worker.join(120)
    assert result["response"].status_code == 200, result["response"].text[:300]
    print(json.dumps({"health_during_request_s": {"count": len(latencies), "max": round(max(latencies), 4),
                                                   "median": round(sorted(latencies)[len(latencies) // 2], 4)}}))
    return result["response"]


BIG_TEXT = "The quick brown fox jumps over the lazy dog. " * 60_000  # 2.7 M characters
MANY_IDS = [1000 + i % 5000 for i in range(1_000_000)]
SHORT_TEXT = "a short text to embed"


def _tokenized_as_the_tokenizer_does(answer: dict, tokenizer) -> None:
    sentence = tokenizer.encode(BIG_TEXT[:90], add_special_tokens=False)  # two sentences
    assert answer["count"] == len(answer["tokens"]) == len(answer["token_strs"]) > 500_000
    assert answer["tokens"][1:1 + len(sentence) // 2] == sentence[:len(sentence) // 2]
    assert answer["token_strs"][:100] == tokenizer.convert_ids_to_tokens(answer["tokens"][:100])


def _detokenized_as_the_tokenizer_does(answer: dict, tokenizer) -> None:
    assert answer["prompt"] == tokenizer.decode(MANY_IDS)


def _embedded_alike(answer: dict, tokenizer) -> None:
    """The same text 2,048 times: the same vector each time, up to the rounding of its place in a batch."""
    vectors = answer["embeddings"]
    assert len(vectors) == 2048 and all(len(v) == len(vectors[0]) for v in vectors)
    assert all(map(math.isfinite, vectors[0]))
    spread = max(abs(a - b) for v in vectors for a, b in zip(v, vectors[0]))
    print(json.dumps({"embedding_spread": spread}))
    assert spread < 1e-5


@pytest.mark.parametrize("path,body,check", [
    ("/tokenize", {"prompt": BIG_TEXT, "return_token_strs": True}, _tokenized_as_the_tokenizer_does),
    ("/detokenize", {"tokens": MANY_IDS}, _detokenized_as_the_tokenizer_does),
    ("/api/embed", {"input": [SHORT_TEXT] * 2048}, _embedded_alike),
], ids=["tokenize-2.7M-chars", "detokenize-1M-ids", "api-embed-2048"])
def test_health_answers_many_times_while_one_heavy_request_is_handled(probe, path, body, check):
    if path == "/api/embed":
        body = {**body, "model": probe.engine.info.id}
    content = json.dumps(body).encode()  # encoded before: the client shares the server's interpreter here
    response = _health_during(probe, lambda: post(probe, path, content=content))
    # A loop held for the whole request would answer /health once or twice; counted by the function above.
    check(response.json(), probe.engine.tokenizer)


def test_a_large_body_that_fails_validation_is_400_naming_the_item_as_a_small_one_is(probe):
    """A body of 64 KiB or more is validated on a worker thread, a list of ids a slice at a time: the error
    names the item by its index in the whole list, as validation of a small body does."""
    small = post(probe, "/detokenize", {"tokens": [1, -1]})
    large = post(probe, "/detokenize", content=json.dumps({"tokens": [1] * 99_999 + [-1]}).encode())
    assert "greater than or equal to 0" in assert_error(small, 400, param="tokens[1]")["message"]
    assert "greater than or equal to 0" in assert_error(large, 400, param="tokens[99999]")["message"]
    too_many = post(probe, "/detokenize", content=json.dumps({"tokens": [1] * 1_000_001}).encode())
    assert "at most 1000000" in assert_error(too_many, 400, param="tokens")["message"]


# ------------------------------------------------------------------------------------ 8: real clients
def test_tokenizer_info_answers_as_vllm_does(probe):
    with probe.http(headers=AUTH) as http:
        info = http.get("/tokenizer_info").json()
        tokens = http.post("/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()["tokens"]
    tokenizer = probe.engine.tokenizer
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template and info["tokenizer_class"]
    assert info["model_max_length"] == probe.engine.info.max_model_len
    assert not any("path" in k or k.endswith("_file") for k in info)
    assert tokens == tokenizer.encode("test", add_special_tokens=False)  # what lm-eval checks next


def test_tokenizer_info_needs_the_key(probe):
    with probe.http() as http:
        assert http.get("/tokenizer_info").status_code == 401


def test_a_string_prompt_is_scored_as_lm_eval_slices_it(server, tokenizer, reference_model):
    """lm-eval's local-completions with string prompts: echo + logprobs of context + continuation, then
    `token_logprobs[len(context tokens):-1]` with its own (remote) tokenization, which has no BOS. The
    server's BOS is not echoed, so that slice is exactly the continuation's log-likelihood — the same the
    server gives the token ids [BOS] + context + continuation."""
    context, continuation = "The capital of France is", " Paris"
    ctx = tokenizer.encode(context, add_special_tokens=False)
    cont = tokenizer.encode(context + continuation, add_special_tokens=False)[len(ctx):]
    client = server.openai()
    by_text = client.completions.create(model=server.engine.info.id, prompt=context + continuation, echo=True,
                                        logprobs=1, max_tokens=1, temperature=0).choices[0].logprobs
    lm_eval_score = sum(by_text.token_logprobs[len(ctx):-1])
    bos = [tokenizer.bos_token_id]
    by_ids = client.completions.create(model=server.engine.info.id, prompt=bos + ctx + cont, echo=True,
                                       logprobs=1, max_tokens=0, temperature=0).choices[0].logprobs
    ids_score = sum(by_ids.token_logprobs[1 + len(ctx):])
    rows = forward_logprobs(reference_model, bos + ctx + cont)
    reference = sum(rows[len(ctx) + i, t].item() for i, t in enumerate(cont))
    print(json.dumps({"lm_eval_slice": lm_eval_score, "token_id_scoring": ids_score, "reference": reference}))
    assert len(by_text.token_logprobs) == len(ctx) + len(cont) + 1  # no BOS entry, one generated token
    assert by_text.token_logprobs[0] is not None  # the first token is scored given the BOS
    assert lm_eval_score == pytest.approx(ids_score, abs=1e-4)
    tolerance = 1e-3 if server.engine.name == "huggingface" else 0.05
    assert lm_eval_score == pytest.approx(reference, abs=tolerance * len(cont))
    assert "".join(by_text.tokens[:-1]) == tokenizer.decode(ctx + cont)


def test_api_tags_reports_the_size_and_parameter_count(server, demo_model_dir):
    with server.http() as http:
        [model] = [m for m in http.get("/api/tags").json()["models"] if m["name"].startswith(server.engine.info.id)]
    weights = sum(f.stat().st_size for f in demo_model_dir.iterdir() if f.suffix == ".safetensors")
    assert model["size"] == weights > 0
    count = server.engine.info.parameter_count
    assert count > 0 and model["details"]["parameter_size"] == f"{count / 1e6:.2f}M"  # tens of millions


def test_after_every_probe_above_the_servers_still_answer(probe, server):
    still_serving(probe)
    still_serving(server, headers={})
