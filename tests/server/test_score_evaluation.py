"""POST /v1/score/evaluation (LLaMA-Factory's shape): the value head on the final hidden state of each
message's last token, from a reward adapter or the model directory; a model without one answers 400."""
from __future__ import annotations

import shutil

import pytest

from tests.helpers import require_kt_kernel
import torch

from tests.conftest import start_server
from tests.lora_helpers import make_peft_adapter, write_value_head

MESSAGES = ["The answer is 42.", "I do not know, sorry."]


def direct_scores(model, tokenizer, weight, bias, max_length=None):
    scores = []
    with torch.inference_mode():
        for text in MESSAGES:
            ids = tokenizer.encode(text, add_special_tokens=False)[:max_length]
            out = model(torch.tensor([ids]), output_hidden_states=True)
            scores.append(float(out.hidden_states[-1][0, -1] @ weight[0] + bias[0]))
    return scores


@pytest.fixture(scope="module")
def reward_setup(tmp_path_factory, demo_model_dir, reference_model):
    root = tmp_path_factory.mktemp("reward")
    merged = make_peft_adapter(reference_model, "attn", root / "reward")
    head = write_value_head(root / "reward", reference_model.config.hidden_size)
    model_dir = root / "model"  # the demo model plus a value head of its own
    model_dir.mkdir()
    for f in demo_model_dir.iterdir():
        (model_dir / f.name).symlink_to(f)
    model_head = write_value_head(model_dir, reference_model.config.hidden_size, seed=2)
    return root, merged, head, model_dir, model_head


@pytest.fixture(scope="module")
def plain(demo_model_dir, reward_setup):
    server = start_server(demo_model_dir, adapters={"reward": str(reward_setup[0] / "reward")})
    yield server
    server.stop()


def score(server, model, **extra):
    with server.http() as http:
        return http.post("/v1/score/evaluation", json={"model": model, "messages": MESSAGES, **extra})


def test_reward_adapter_scores_equal_the_direct_computation(plain, reward_setup, tokenizer):
    _, merged, (weight, bias), _, _ = reward_setup
    r = score(plain, "reward")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "score.evaluation" and body["model"] == "reward" and body["id"]
    assert body["scores"] == pytest.approx(direct_scores(merged, tokenizer, weight, bias), abs=1e-4)


def test_max_length_truncates_each_message(plain, reward_setup, tokenizer):
    _, merged, (weight, bias), _, _ = reward_setup
    r = score(plain, "reward", max_length=3)
    assert r.json()["scores"] == pytest.approx(direct_scores(merged, tokenizer, weight, bias, 3), abs=1e-4)


def test_a_model_without_a_value_head_is_400(plain):
    r = score(plain, plain.engine.info.id)
    assert r.status_code == 400 and "value head" in r.json()["error"]["message"]


@pytest.mark.parametrize("engine", ["huggingface", "ktransformers"])
def test_value_head_in_the_model_directory(engine, reward_setup, reference_model, tokenizer):
    _, _, _, model_dir, (weight, bias) = reward_setup
    settings = {"engine": engine}
    if engine == "ktransformers":
        require_kt_kernel()
        settings["kt_method"] = "BF16"
    server = start_server(model_dir, **settings)
    try:
        r = score(server, None)
        assert r.status_code == 200, r.text
        # the KT engine computes the routed experts in bf16 (kt-kernel)
        tolerance = 1e-4 if engine == "huggingface" else 0.05
        assert r.json()["scores"] == pytest.approx(direct_scores(reference_model, tokenizer, weight, bias),
                                                   abs=tolerance)
    finally:
        server.stop()
