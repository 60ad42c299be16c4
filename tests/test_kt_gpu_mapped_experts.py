"""Experts the GPU reads straight from pinned host memory (`kt_gpu_read_experts`, engines/kt/mapped_experts.py),
run on a GPU machine (pytest -m gpu). Asserts agreement, never time."""
from __future__ import annotations

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


def experts_layer(held: int | None = None, owned: int = 0):
    from engines.kt.expert_streaming import ExpertStreamers
    from engines.kt.experts_cpu import RoutedExpertsCPU

    torch.manual_seed(0)
    layer = RoutedExpertsCPU(layer_idx=91, num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                             method="BF16", max_tokens=128, gpu_device="cuda", out_device="cuda",
                             streamer=ExpertStreamers(decode_from_host=True).for_device(torch.device("cuda")),
                             stream_tokens=65, stream_experts=held, owned_experts=owned)
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


def test_a_decode_call_captured_in_a_cuda_graph_replays_new_routing():
    layer = experts_layer(held=10)
    layer.streamer.pcie_bytes_per_s = 1e12  # the balance alone would give the GPU every expert
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


@pytest.mark.parametrize("tokens", [4, 100], ids=["decode-read-from-host", "chunk-streamed"])
def test_a_layer_whose_first_experts_the_gpu_owns_equals_kt_kernel_computing_all(tokens):
    from engines.kt.experts_cpu import RoutedExpertsCPU

    owned = experts_layer(owned=7)
    plain = RoutedExpertsCPU(layer_idx=92, num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                             method="BF16", max_tokens=128)
    plain.load_weights(*layer_weights(1))
    assert owned.kernel_experts == E - 7
    hidden, ids, weights = routing(tokens)
    got = owned(hidden.cuda(), ids.cuda(), weights.cuda()).float().cpu()
    assert_close(got, plain(hidden, ids, weights).float())
