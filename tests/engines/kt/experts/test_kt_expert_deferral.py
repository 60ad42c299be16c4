"""Expert deferral (`n_deferred_experts`, engines/kt/experts/deferral.py): in decode steps each token's lowest-
weighted experts of a layer join the next layer's output; prompt steps and the last CPU-experts layer never
defer. The layer-level tests check the arithmetic against a torch reference on kt-kernel's BF16 experts
(blocking path); tests/engines/kt/test_kt_gpu.py checks the stream-ordered path and CUDA graphs on a GPU."""
from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import start_server
from tests.helpers import require_kt_kernel

require_kt_kernel()

from engines.kt.experts.deferral import (  # noqa: E402
    ExpertDeferral, check_deferred, link, max_batch, split_deferred)
from engines.kt.experts.cpu import RoutedExpertsCPU, SharedStaging  # noqa: E402
from .test_kt_experts_cpu import (  # noqa: E402,F401 (weights: the fixture)
    E, H, I, K, MAX_TOKENS, TOLERANCE, reference, rel_err, routing, weights)

DEFERRED = 2



# ------------------------------------------------------------------------------------------ the pieces
def test_each_rows_lowest_weighted_experts_are_the_deferred_ones():
    ids = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    weights = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.9, 0.05, 0.03, 0.02]])
    immediate, deferred = split_deferred(ids, weights, 2)
    assert immediate.tolist() == [[-1, 6, -1, 8], [1, 2, -1, -1]]
    assert deferred.tolist() == [[5, -1, 7, -1], [-1, -1, 3, 4]]


@pytest.mark.parametrize("value, expected", [(0, 0), (3, 3), ([2], 2)])
def test_n_deferred_experts_takes_a_number_or_a_list_of_one(value, expected):
    assert check_deferred(value, top_k=4) == expected


@pytest.mark.parametrize("value", [4, 9, -1, [2, 3], "2", True])
def test_n_deferred_experts_must_leave_each_token_an_expert_of_its_own_layer(value):
    with pytest.raises(ValueError, match="n_deferred_experts"):
        check_deferred(value, top_k=4)


@pytest.mark.parametrize("shape, tokens", [((64, 6, 2), 5), ((256, 8, 3), 14), ((64, 6, 1), 8), ((16, 4, 2), 2)])
def test_decode_steps_defer_while_their_two_halves_read_at_most_a_tenth_more_experts(shape, tokens):
    assert max_batch(*shape) == tokens


def layer(idx: int, deferred: int = DEFERRED, out_device: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(layer_idx=idx, deferred=deferred, out_device=out_device, defer_into=None)


def test_a_layer_defers_only_into_the_next_layer_on_the_same_device():
    layers = [layer(1), layer(2), layer(3, out_device="cuda:1"), layer(5), layer(6, deferred=0), layer(7)]
    deferring = link(layers)
    assert [x.defer_into for x in layers] == [2, None, None, 6, None, None]
    assert deferring == [layers[0], layers[3]]


# ------------------------------------------------------------------------- layers on kt-kernel's experts
@pytest.fixture(scope="module")
def chain(weights):
    """Three consecutive CPU-experts layers of one model (2 and 3 defer into their successor)."""
    staging, deferral = SharedStaging(), ExpertDeferral()
    layers = []
    for idx in (2, 3, 4):
        experts = RoutedExpertsCPU(layer_idx=idx, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                                   method="BF16", max_tokens=MAX_TOKENS, staging=staging, deferral=deferral,
                                   deferred=DEFERRED)
        experts.load_weights(*weights)
        layers.append(experts)
    assert link(layers) == layers[:2]
    return deferral, layers


def step(layers, inputs):
    return [experts(*args) for experts, args in zip(layers, inputs)]


def test_in_a_decode_step_each_layers_deferred_experts_join_the_next_layers_output(weights, chain):
    deferral, layers = chain
    inputs = [routing(5, seed) for seed in (1, 2, 3)]
    with deferral.decoding():
        outputs = step(layers, inputs)
    parts = [split_deferred(ids, w, DEFERRED) for _, ids, w in inputs]
    (x1, _, w1), (x2, _, w2), (x3, ids3, w3) = inputs
    expected = [reference(weights, x1, parts[0][0], w1),
                reference(weights, x2, parts[1][0], w2) + reference(weights, x1, parts[0][1], w1),
                reference(weights, x3, ids3, w3) + reference(weights, x2, parts[1][1], w2)]  # the last defers none
    for out, ref in zip(outputs, expected):
        assert rel_err(out, ref) < TOLERANCE["BF16"]
    assert deferral.pending is None


def test_outside_decode_steps_every_expert_runs_in_its_own_layer(weights, chain):
    _, layers = chain
    inputs = [routing(5, seed) for seed in (4, 5, 6)]
    for out, (x, ids, w) in zip(step(layers, inputs), inputs):
        assert rel_err(out, reference(weights, x, ids, w)) < TOLERANCE["BF16"]


def test_a_decode_step_too_large_to_defer_runs_every_expert_in_its_own_layer(weights, chain):
    deferral, layers = chain
    inputs = [routing(5, seed) for seed in (7, 8, 9)]
    with deferral.decoding(defer=False):
        outputs = step(layers, inputs)
    for out, (x, ids, w) in zip(outputs, inputs):
        assert rel_err(out, reference(weights, x, ids, w)) < TOLERANCE["BF16"]


def test_consecutive_decode_steps_do_not_mix(chain):
    deferral, layers = chain
    first, second = [routing(3, seed) for seed in (1, 2, 3)], [routing(3, seed) for seed in (7, 8, 9)]
    with deferral.decoding():
        alone = step(layers, second)
    with deferral.decoding():
        step(layers, first)
    with deferral.decoding():
        again = step(layers, second)
    assert all(torch.equal(a, b) for a, b in zip(alone, again))


def test_hot_experts_always_run_in_their_own_layer(weights):
    hot = list(range(8))
    staging, deferral = SharedStaging(), ExpertDeferral()
    layers = []
    for idx in (5, 6):
        experts = RoutedExpertsCPU(layer_idx=idx, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                                   method="BF16", max_tokens=MAX_TOKENS, staging=staging, deferral=deferral,
                                   deferred=DEFERRED, gpu_experts=hot)
        experts.load_weights(*weights)
        layers.append(experts)
    link(layers)
    inputs = [routing(6, seed) for seed in (21, 22)]
    with deferral.decoding():
        outputs = step(layers, inputs)
    (x1, ids1, w1), (x2, ids2, w2) = inputs
    late = split_deferred(ids1, w1, DEFERRED)[1]
    late = late.masked_fill(torch.isin(late, torch.tensor(hot)), -1)  # deferred slots of CPU experts only
    now = ids1.masked_fill(late >= 0, -1)
    assert (late >= 0).any() and (now >= 0).sum() > (ids1.shape[1] - DEFERRED) * ids1.shape[0]
    assert rel_err(outputs[0], reference(weights, x1, now, w1)) < TOLERANCE["BF16"]
    expected = reference(weights, x2, ids2, w2) + reference(weights, x1, late, w1)
    assert rel_err(outputs[1], expected) < TOLERANCE["BF16"]


# ------------------------------------------------------------------------------------------ served
def write_rules(folder, device: str):
    """The demo model on `device` with KTransformers' deferral spelling on its experts."""
    path = folder / f"DeepSeek-defer-{device.replace(':', '')}.yaml"
    path.write_text(textwrap.dedent(f"""\
        - match: {{name: '^$'}}
          replace: {{class: default, kwargs: {{device: "{device}"}}}}
        - match: {{name: '^model\\.layers\\.\\d+\\.mlp\\.experts$'}}
          replace:
            class: ktransformers.operators.experts.KTransformersExperts
            kwargs: {{generate_device: cpu, generate_op: KExpertsCPU, out_device: "{device}", n_deferred_experts: [{DEFERRED}]}}
          recursive: false
        - match: {{name: '^model\\.layers\\.\\d+\\.self_attn$'}}
          replace: {{class: engines.kt.placement.operators.MLAAttention}}
          recursive: false
        """))
    return path


@pytest.fixture(scope="module")
def rules_with_deferral(tmp_path_factory):
    return write_rules(tmp_path_factory.mktemp("deferral"), "cpu")


@pytest.fixture(scope="module")
def deferring_server(demo_model_dir, rules_with_deferral):
    running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16",
                           kt_optimize_rule=str(rules_with_deferral))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def exact_server(demo_model_dir):
    running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16")
    yield running
    running.stop()


PROMPT = "The river begins in the mountains, where snow melts each spring and feeds the streams."


def completion(server, **kwargs):
    return server.openai().completions.create(model=server.engine.info.id, prompt=PROMPT, temperature=0,
                                              logprobs=1, **kwargs).choices[0]


def test_a_rule_with_n_deferred_experts_serves_and_says_so_in_version(deferring_server):
    details = deferring_server.http().get("/version").json()["engine_details"]
    assert details["experts_deferred"] == str(DEFERRED)


def test_prompts_are_computed_without_deferral(deferring_server, exact_server):
    got, expected = (completion(s, max_tokens=0, echo=True).logprobs.token_logprobs for s in
                     (deferring_server, exact_server))
    assert got == expected


def test_generated_tokens_come_from_deferred_decode_steps(deferring_server, exact_server):
    got, expected = (completion(s, max_tokens=8).logprobs.token_logprobs for s in (deferring_server, exact_server))
    assert got[0] == expected[0]  # the first token comes from the prompt step
    assert got[1:] != expected[1:]


def test_streamed_and_whole_replies_agree_with_deferral(deferring_server):
    client = deferring_server.openai()
    whole = completion(deferring_server, max_tokens=12).text
    stream = client.completions.create(model=deferring_server.engine.info.id, prompt=PROMPT, temperature=0,
                                       max_tokens=12, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == whole


# ------------------------------------------------------------------------------------------ on a GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stream_ordered_deferral_equals_the_blocking_path(chain):
    deferral, layers = chain
    inputs = [routing(7, seed) for seed in (11, 12, 13)]
    with deferral.decoding():
        on_cpu = step(layers, inputs)
    with deferral.decoding():
        on_gpu = step(layers, [tuple(t.cuda() for t in args) for args in inputs])
    torch.cuda.synchronize()
    assert all(g.is_cuda and torch.equal(g.cpu(), c) for g, c in zip(on_gpu, on_cpu))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_decode_with_deferral_equals_eager_decode(demo_model_dir, tmp_path):
    rules = str(write_rules(tmp_path, "cuda:0"))
    replies = []
    for graphs in (True, False):
        running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16", kt_optimize_rule=rules,
                               kt_use_cuda_graph=graphs)
        try:
            assert running.engine._runner.deferring
            assert (running.engine._runner.graphs is not None) == graphs
            replies.append([completion(running, max_tokens=16).logprobs.token_logprobs for _ in range(2)])
        finally:
            running.stop()
    assert replies[0] == replies[1]
