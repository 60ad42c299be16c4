"""Experts the GPU reads straight from pinned host memory (`kt_gpu_read_experts`, engines/kt/mapped_experts.py),
run on a GPU machine (pytest -m gpu). Asserts agreement, never time."""
from __future__ import annotations

import json

import pytest
import torch

from test_kt_expert_streaming import E, H, I, TOP_K, assert_close, layer_weights, reference, routing

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]



def host_copies(held: int):
    from engines.kt.expert_streaming import HostExperts

    return HostExperts.quantize(*(w[:held] for w in layer_weights(0)), work_device="cuda", pin=True)


def test_a_device_view_reads_the_pinned_host_memory_it_covers():
    from engines.kt.mapped_experts import device_view

    host = host_copies(4)
    view = device_view(host.down, torch.device("cuda"))
    assert view.is_cuda and torch.equal(view.cpu(), host.down)
    host.down[2, 5, 7] = 99  # written on the host, read through the view
    assert int(view[2, 5, 7]) == 99


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_the_kernels_compute_the_experts_below_the_share_as_the_int8_reference(tokens):
    from engines.kt.mapped_experts import MappedExperts

    host = host_copies(held=16)
    mapped = MappedExperts(torch.device("cuda"))
    mapped.register(7, host, TOP_K)
    hidden, ids, weights = routing(tokens)
    got = mapped.compute(7, hidden.cuda(), ids.cuda(), weights.cuda(), experts=11).cpu()
    assert_close(got, reference(host, hidden, ids, weights, below=11))


@pytest.mark.parametrize("resident", [4, 16], ids=["some-in-gpu-memory", "all-in-gpu-memory"])
@pytest.mark.parametrize("tokens", [1, 64])
def test_the_kernels_read_experts_in_gpu_memory_and_the_rest_from_host_memory_as_the_int8_reference(tokens, resident):
    from engines.kt.expert_streaming import HostExperts
    from engines.kt.mapped_experts import MappedExperts

    whole = host_copies(held=16)
    first = HostExperts(*(t[:resident] for t in whole.tensors())).to("cuda")
    rest = HostExperts.quantize(*(w[resident:16] for w in layer_weights(0)), work_device="cuda", pin=True)
    mapped = MappedExperts(torch.device("cuda"))
    mapped.register(7, rest, TOP_K, resident=first)
    hidden, ids, weights = routing(tokens)
    got = mapped.compute(7, hidden.cuda(), ids.cuda(), weights.cuda(), experts=11).cpu()
    assert_close(got, reference(whole, hidden, ids, weights, below=11))


def test_registered_copies_stay_readable_after_the_caller_drops_them():
    """A HostExperts unpins its memory when it goes; the kernels must not read memory no longer pinned."""
    import gc

    from engines.kt.mapped_experts import MappedExperts

    host = host_copies(held=16)
    hidden, ids, weights = routing(3)
    want = reference(host, hidden, ids, weights, below=11)
    mapped = MappedExperts(torch.device("cuda"))
    mapped.register(7, host, TOP_K)
    del host
    gc.collect()
    got = mapped.compute(7, hidden.cuda(), ids.cuda(), weights.cuda(), experts=11).cpu()
    assert_close(got, want)


def experts_layer(held: int | None = None, owned: int = 0, read: int | None = None, resident: int = 0):
    from engines.kt.expert_streaming import ExpertStreamers
    from engines.kt.experts_cpu import RoutedExpertsCPU

    torch.manual_seed(0)
    layer = RoutedExpertsCPU(layer_idx=91, num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                             method="BF16", max_tokens=128, gpu_device="cuda", out_device="cuda",
                             streamer=ExpertStreamers().for_device(torch.device("cuda")),
                             stream_tokens=65, stream_experts=held, owned_experts=owned, read_experts=read,
                             resident_experts=resident)
    layer.load_weights(*layer_weights(1))
    return layer


def test_a_decode_call_splits_its_experts_with_kt_kernel_and_equals_the_cpu():
    layer = experts_layer()
    share = layer.mapped_experts(4)
    assert 0 < share < E
    hidden, ids, weights = routing(4)
    on_cpu = layer(hidden, ids, weights).float().cpu()  # the blocking path: every expert in kt-kernel
    on_gpu = layer(hidden.cuda(), ids.cuda(), weights.cuda()).float().cpu()
    assert_close(on_gpu, on_cpu)


@pytest.mark.parametrize("kind", ["copies", "owned-some-in-gpu-memory"])
def test_a_decode_call_captured_in_a_cuda_graph_replays_new_routing(kind):
    # every held expert, whatever the balance; or ten experts the GPU owns, four of them in its memory
    layer = experts_layer(held=10, read=10) if kind == "copies" else experts_layer(owned=10, resident=4)
    assert layer.mapped_experts(3) == 10
    hidden, ids, weights = (t.cuda() for t in routing(3))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: the kernels compile before capture
            layer(hidden, ids, weights)
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(hidden, ids, weights)
    for seed in (5, 6):
        new_hidden, new_ids, new_weights = routing(3, seed=seed)
        hidden.copy_(new_hidden)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out.float().cpu(), layer(new_hidden, new_ids, new_weights).float().cpu())


def test_decode_calls_queued_back_to_back_each_get_their_own_experts():
    """Decode calls queue their copies, kt-kernel's task and the GPU's kernels without a host sync; calls queued
    back to back, each freeing its inputs for the next to reuse and sharing the staging buffers and the kernels'
    scratch, still each compute their own routing."""
    layer = experts_layer(held=10, read=10)
    assert layer.mapped_experts(2) == 10
    outs = [layer(*(t.cuda() for t in routing(2, seed=seed))).clone() for seed in range(8)]
    torch.cuda.synchronize()
    for seed, out in enumerate(outs):
        assert_close(out.float().cpu(), layer(*routing(2, seed=seed)).float().cpu())


@pytest.mark.parametrize("resident", [0, 3, 7], ids=["in-host-memory", "some-in-gpu-memory", "all-in-gpu-memory"])
@pytest.mark.parametrize("tokens", [4, 100], ids=["decode-read-in-place", "chunk-streamed"])
def test_a_layer_whose_first_experts_the_gpu_owns_equals_kt_kernel_computing_all(tokens, resident):
    from engines.kt.experts_cpu import RoutedExpertsCPU

    owned = experts_layer(owned=7, resident=resident)
    assert (owned.streamer.resident_experts(91), owned.streamer.layers[91].held) == (resident, 7 - resident)
    plain = RoutedExpertsCPU(layer_idx=92, num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                             method="BF16", max_tokens=128)
    plain.load_weights(*layer_weights(1))
    assert owned.kernel_experts == E - 7
    hidden, ids, weights = routing(tokens)
    got = owned(hidden.cuda(), ids.cuda(), weights.cuda()).float().cpu()
    assert_close(got, plain(hidden, ids, weights).float())


def test_int8_servers_whose_gpu_owns_experts_agree_with_kt_kernel_alone(demo_model_dir):
    from conftest import start_server
    from test_kt_gpu import GPU_MEDIAN_LOGPROB_DIFF, TEXT

    def serve(**settings) -> tuple[str, list[float], list[float]]:
        running = start_server(demo_model_dir, engine="ktransformers", kt_method="AMXINT8", **settings)
        try:
            client, model = running.openai(), running.engine.info.id
            # a prompt of a few hundred tokens: one chunk, the GPU's experts streamed through the ring
            prompt = client.completions.create(model=model, prompt=TEXT[:1200], max_tokens=0, echo=True, logprobs=0)
            # then decode steps replayed from CUDA graphs: the GPU's experts read by the mapped kernels
            decode = client.completions.create(model=model, prompt=TEXT[:200], max_tokens=16, temperature=0,
                                               logprobs=0, extra_body={"ignore_eos": True})
            details = running.engine.info.details
            return (f'{details["gpu_read_experts"]}/{details["gpu_resident_experts"]}',
                    prompt.choices[0].logprobs.token_logprobs[1:], decode.choices[0].logprobs.token_logprobs)
        finally:
            running.stop()

    off, prompt_alone, decode_alone = serve(kt_gpu_read_experts=0)
    assert off == "0/0"
    # the balance for 16 experts, int8 on both sides; then 4 kept in GPU memory and the balance of the other 12
    for settings, owned in (({}, "8/0"), ({"kt_gpu_resident_experts": 4}, "10/4")):
        split, prompt, decode = serve(**settings)
        assert split == owned
        diffs = sorted(abs(a - b) for a, b in zip(prompt, prompt_alone))
        same = next((k for k, (a, b) in enumerate(zip(decode, decode_alone)) if abs(a - b) > 0.5), len(decode))
        print(json.dumps({"owned/resident": split, "prompt_positions": len(diffs),
                          "prompt_median_diff": diffs[len(diffs) // 2], "decode_same_positions": same}))
        assert len(diffs) > 100 and diffs[len(diffs) // 2] < GPU_MEDIAN_LOGPROB_DIFF
        assert same >= 4
