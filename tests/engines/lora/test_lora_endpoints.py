"""Runtime adapters: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's shapes), only from
inside the adapter roots, behind the API key; bad adapters are refused with a message that says why while
the server goes on serving."""
from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import start_server
from tests.lora_helpers import make_peft_adapter

KEY = "sk-test"


@pytest.fixture(scope="module")
def roots(tmp_path_factory, reference_model):
    root = tmp_path_factory.mktemp("root")
    outside = tmp_path_factory.mktemp("outside")
    make_peft_adapter(reference_model, "attn", root / "good")
    shutil.copytree(root / "good", outside / "escaped")
    (root / "link").symlink_to(outside / "escaped")
    return root, outside


@pytest.fixture(scope="module")
def running(demo_model_dir, roots):
    server = start_server(demo_model_dir, api_key=KEY, adapter_roots=[str(roots[0])])
    yield server
    server.stop()


def post(server, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with server.http() as http:
        return http.post(path, json=body, headers=headers)


def model_ids(server):
    return {m.id for m in server.openai().models.list().data}


def complete(server, model, max_tokens=3):
    return post(server, "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": max_tokens,
                                            "temperature": 0})


def test_load_use_and_unload(running, roots):
    r = post(running, "/v1/load_lora_adapter", {"lora_name": "good", "lora_path": str(roots[0] / "good")})
    assert r.status_code == 200, r.text
    assert "good" in model_ids(running)
    assert complete(running, "good").status_code == 200
    assert post(running, "/v1/unload_lora_adapter", {"lora_name": "good"}).status_code == 200
    assert "good" not in model_ids(running)
    assert complete(running, "good").status_code == 404


@pytest.mark.parametrize("path", ["{root}/../{outside}/escaped", "{root}/link", "/etc"])
def test_paths_outside_the_roots_are_403(running, roots, path):
    root, outside = roots
    lora_path = path.format(root=root, outside=outside.name)
    r = post(running, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": lora_path})
    assert r.status_code == 403 and "outside the adapter roots" in r.json()["error"]["message"]


def test_unloading_an_unknown_name_is_404(running):
    r = post(running, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert r.status_code == 404 and "never-loaded" in r.json()["error"]["message"]


def test_adapter_endpoints_need_the_api_key(running, roots):
    assert post(running, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(roots[0] / "good")},
                key=None).status_code == 401
    assert post(running, "/v1/unload_lora_adapter", {"lora_name": "a"}, key="wrong").status_code == 401


def broken_copy(roots, name, change):
    root = roots[0]
    target = root / name
    shutil.copytree(root / "good", target)
    tensors = load_file(str(target / "adapter_model.safetensors"))
    change(tensors)
    save_file(tensors, str(target / "adapter_model.safetensors"))
    return target


def test_base_model_mismatch_names_the_tensor_and_both_shapes(running, roots):
    key = next(k for k in load_file(str(roots[0] / "good" / "adapter_model.safetensors")) if "q_a_proj.lora_B" in k)

    def widen(tensors):
        tensors[key] = torch.randn(96, tensors[key].shape[1])
    path = broken_copy(roots, "mismatch", widen)
    r = post(running, "/v1/load_lora_adapter", {"lora_name": "mismatch", "lora_path": str(path)})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and key.replace("lora_B", "lora_{A,B}") in message and "[96, 256]" in message and "[128, 256]" in message
    assert complete(running, running.engine.info.id).status_code == 200


def test_keys_matching_no_module_are_listed(running, roots):
    def add_layer_nine(tensors):
        for k in [k for k in tensors if ".layers.0." in k]:
            tensors[k.replace(".layers.0.", ".layers.9.")] = tensors[k].clone()
    path = broken_copy(roots, "unknown", add_layer_nine)
    r = post(running, "/v1/load_lora_adapter", {"lora_name": "unknown", "lora_path": str(path)})
    assert r.status_code == 400 and "match no module" in r.json()["error"]["message"]
    assert "layers.9." in r.json()["error"]["message"]
    assert "unknown" not in model_ids(running)


def test_unsupported_format_lists_the_supported_ones(running, roots):
    path = roots[0] / "weird"
    path.mkdir()
    (path / "weights.pt").write_bytes(b"not an adapter")
    r = post(running, "/v1/load_lora_adapter", {"lora_name": "weird", "lora_path": str(path)})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "PEFT" in message and "GGUF" in message


def test_unload_lets_requests_in_flight_finish_and_refuses_new_ones(running, roots):
    assert post(running, "/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": str(roots[0] / "good")}
                ).status_code == 200
    result = {}

    def long_request():
        result["reply"] = post(running, "/v1/completions", {"model": "busy", "prompt": "Hi", "max_tokens": 60,
                                                            "ignore_eos": True, "temperature": 0})
    worker = threading.Thread(target=long_request)
    worker.start()
    while running.engine.stats().running == 0 and worker.is_alive():
        pass
    assert post(running, "/v1/unload_lora_adapter", {"lora_name": "busy"}).status_code == 200
    assert complete(running, "busy").status_code == 404
    worker.join(timeout=120)
    reply = result["reply"]
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 60
    running.wait_idle()
    assert all("busy" not in w.updates for w in running.engine._runner.lora._wrapped.values())
