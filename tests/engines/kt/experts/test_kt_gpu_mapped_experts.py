"""Experts the GPU reads straight from pinned host memory (`kt_gpu_read_experts`, engines/kt/experts/mapped.py),
run on a GPU machine (pytest -m gpu). Asserts agreement, never time."""
from __future__ import annotations

import json

import pytest
import torch

from engines.kt.experts.mapped import MAX_TOKENS
from .test_kt_expert_streaming import E, H, I, TOP_K, assert_close, layer_weights, reference, routing

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]



def host_copies(held: int, bits: int = 8, first: int = 0):
    """Pinned `bits`-bit copies of experts [first, held) of layer_weights(0)."""
    from engines.kt.experts.host_copies import HostExperts

    return HostExperts.quantize(*(w[first:held] for w in layer_weights(0)), bits=bits, work_device="cuda", pin=True)


def test_a_device_view_reads_the_pinned_host_memory_it_covers():
    from engines.kt.experts.mapped import device_view

    host = host_copies(4)
    view = device_view(host.down, torch.device("cuda"))
    assert view.is_cuda and torch.equal(view.cpu(), host.down)
    host.down[2, 5, 7] = 99  # written on the host, read through the view
    assert int(view[2, 5, 7]) == 99


@pytest.mark.parametrize("tokens", [1, 5, 64, 128])
def test_the_kernels_compute_the_experts_below_the_share_as_the_int8_reference(tokens):
    from engines.kt.experts.mapped import MappedExperts

    host = host_copies(held=16)
    mapped = MappedExperts(torch.device("cuda"))
    mapped.register(7, host, TOP_K)
    hidden, ids, weights = routing(tokens)
    got = mapped.compute(7, hidden.cuda(), ids.cuda(), weights.cuda(), experts=11).cpu()
    assert_close(got, reference(host, hidden, ids, weights, below=11))


@pytest.mark.parametrize("resident", [4, 16], ids=["some-in-gpu-memory", "all-in-gpu-memory"])
@pytest.mark.parametrize("tokens", [1, 128])
def test_the_kernels_read_experts_in_gpu_memory_and_the_rest_from_host_memory_as_the_int8_reference(tokens, resident):
    from engines.kt.experts.host_copies import HostExperts
    from engines.kt.experts.mapped import MappedExperts

    whole = host_copies(held=16)
    first = HostExperts(*(t[:resident] for t in whole.tensors())).to("cuda")
    rest = HostExperts.quantize(*(w[resident:16] for w in layer_weights(0)), work_device="cuda", pin=True)
    mapped = MappedExperts(torch.device("cuda"))
    mapped.register(7, rest, TOP_K, resident=first)
    hidden, ids, weights = routing(tokens)
    got = mapped.compute(7, hidden.cuda(), ids.cuda(), weights.cuda(), experts=11).cpu()
    assert_close(got, reference(whole, hidden, ids, weights, below=11))


@pytest.mark.parametrize("resident", [0, 4, 16], ids=["in-host-memory", "some-in-gpu-memory", "all-in-gpu-memory"])
@pytest.mark.parametrize("tokens", [1, 5, 128])
def test_the_int4_kernels_compute_the_experts_below_the_share_as_the_int4_reference(tokens, resident):
    """4-bit methods' copies: packed rows (here padded: 128 and 64 weights to blocks of 256) and group scales read
    where they lie, host or GPU memory."""
    from engines.kt.experts.host_copies import HostExperts
    from engines.kt.experts.mapped import MappedExperts

    whole = host_copies(held=16, bits=4)
    first = HostExperts(*(t[:resident] for t in whole.tensors())).to("cuda") if resident else None
    mapped = MappedExperts(torch.device("cuda"))
    mapped.register(7, host_copies(held=16, bits=4, first=resident), TOP_K, resident=first)
    hidden, ids, weights = routing(tokens)
    got = mapped.compute(7, hidden.cuda(), ids.cuda(), weights.cuda(), experts=11).cpu()
    assert_close(got, reference(whole, hidden, ids, weights, below=11))


@pytest.mark.parametrize("rows, cols", [(2816, 2048), (2048, 1408), (64, 128)],
                         ids=["v2-lite-gate-up", "v2-lite-down-padded", "one-block-padded"])
def test_int4_copies_unpack_on_the_gpu_to_the_weights_torch_unpacks(rows, cols):
    """The ring's chunks scale a group's int4 experts into bf16 with one kernel a matrix: the same bits as
    `dequantize_int4`, every block and group of a row, padded columns left out."""
    from engines.kt.experts.host_copies import _quantize_int4, dequantize_int4
    from engines.kt.experts.mapped import dequantize_int4_into

    packed, scale = _quantize_int4(torch.randn(3, rows, cols, device="cuda") * 0.02)
    out = torch.full((3, rows, cols), float("nan"), dtype=torch.bfloat16, device="cuda")
    dequantize_int4_into(out, packed, scale)
    assert torch.equal(out, dequantize_int4(packed, scale, cols))


@pytest.mark.parametrize("rows, cols", [(4096, 4096), (4096, 2048), (96, 64)],
                         ids=["v4-flash-gate-up", "v4-flash-down", "short-rows"])
def test_mxfp4_copies_dequantize_on_the_gpu_to_the_weights_torch_dequantizes(rows, cols):
    """The ring's chunks dequantize a group's MXFP4 experts into bf16 with one kernel a matrix: the same bits as
    `mxfp4.dequantize`, for every E2M1 code and for UE8M0 codes from tiny to large (0, the subnormal 2^-127,
    included), rows of fewer bytes than a block of the kernel included."""
    from engines.checkpoints import mxfp4
    from engines.kt.experts.mapped import dequantize_mxfp4_into

    g = torch.Generator(device="cuda").manual_seed(0)
    packed = torch.randint(0, 256, (3, rows, cols // 2), dtype=torch.uint8, device="cuda", generator=g)
    codes = torch.randint(100, 150, (3, rows, cols // 32), dtype=torch.uint8, device="cuda", generator=g)
    codes[0, :4, 0] = torch.tensor([0, 1, 127, 200], dtype=torch.uint8)
    out = torch.full((3, rows, cols), float("nan"), dtype=torch.bfloat16, device="cuda")
    dequantize_mxfp4_into(out, packed, codes)
    want = torch.stack([mxfp4.dequantize(packed[e], codes[e]) for e in range(3)])
    assert torch.equal(out, want)


def test_registered_copies_stay_readable_after_the_caller_drops_them():
    """A HostExperts unpins its memory when it goes; the kernels must not read memory no longer pinned."""
    import gc

    from engines.kt.experts.mapped import MappedExperts

    host = host_copies(held=16)
    hidden, ids, weights = routing(3)
    want = reference(host, hidden, ids, weights, below=11)
    mapped = MappedExperts(torch.device("cuda"))
    mapped.register(7, host, TOP_K)
    del host
    gc.collect()
    got = mapped.compute(7, hidden.cuda(), ids.cuda(), weights.cuda(), experts=11).cpu()
    assert_close(got, want)


def experts_layer(held: int | None = None, owned: int = 0, read: int | None = None, resident: int = 0,
                  method: str = "BF16", hidden: int = H, inter: int = I):
    from engines.kt.experts.streaming import ExpertStreamers
    from engines.kt.experts.cpu import RoutedExpertsCPU

    torch.manual_seed(0)
    layer = RoutedExpertsCPU(layer_idx=91, num_experts=E, top_k=TOP_K, hidden_size=hidden, intermediate_size=inter,
                             method=method, max_tokens=256, gpu_device="cuda", out_device="cuda",
                             streamer=ExpertStreamers().for_device(torch.device("cuda")),
                             stream_tokens=65, stream_experts=held, owned_experts=owned, read_experts=read,
                             resident_experts=resident)
    layer.load_weights(*layer_weights(1, hidden, inter))
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
@pytest.mark.parametrize("tokens", [4, 100, 200], ids=["decode-read-in-place", "short-chunk-read-in-place",
                                                       "chunk-streamed"])
def test_a_layer_whose_first_experts_the_gpu_owns_equals_kt_kernel_computing_all(tokens, resident):
    from engines.kt.experts.cpu import RoutedExpertsCPU

    owned = experts_layer(owned=7, resident=resident)
    assert (owned.streamer.resident_experts(91), owned.streamer.layers[91].held) == (resident, 7 - resident)
    plain = RoutedExpertsCPU(layer_idx=92, num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                             method="BF16", max_tokens=256)
    plain.load_weights(*layer_weights(1))
    assert owned.kernel_experts == E - 7
    hidden, ids, weights = routing(tokens)
    streamed_before = owned.streamer.stats.chunks
    got = owned(hidden.cuda(), ids.cuda(), weights.cuda()).float().cpu()
    assert_close(got, plain(hidden, ids, weights).float())
    # calls of up to MAX_TOKENS read the experts in place, longer ones bring them through the ring
    assert owned.streamer.stats.chunks - streamed_before == (tokens > MAX_TOKENS)


@pytest.mark.parametrize("resident", [0, 3], ids=["in-host-memory", "some-in-gpu-memory"])
@pytest.mark.parametrize("tokens", [4, 100, 200], ids=["decode-read-in-place", "short-chunk-read-in-place",
                                                       "chunk-streamed"])
def test_a_4_bit_layer_computes_the_experts_the_gpu_owns_from_their_int4_copies(tokens, resident):
    """AMXINT4: kt-kernel computes the others as it would have (checked against a layer holding every expert, the
    owned ones zeroed: their products vanish), the GPU the owned ones as their int4 copies say."""
    from engines.kt.experts.methods import unavailable_reason
    from engines.kt.experts.host_copies import HostExperts
    from engines.kt.experts.cpu import RoutedExpertsCPU

    if unavailable_reason("AMXINT4") is not None:
        pytest.skip(f"AMXINT4: {unavailable_reason('AMXINT4')}")
    hidden_size, inter = 256, 128  # AMXINT4 takes multiples of 128
    owned = experts_layer(owned=7, resident=resident, method="AMXINT4", hidden=hidden_size, inter=inter)
    assert owned.streamer.layers[91].bits == 4 and owned.streamer.resident_experts(91) == resident
    weights_in = layer_weights(1, hidden_size, inter)
    rest = RoutedExpertsCPU(layer_idx=92, num_experts=E, top_k=TOP_K, hidden_size=hidden_size,
                            intermediate_size=inter, method="AMXINT4", max_tokens=256)
    rest.load_weights(*(torch.cat([torch.zeros_like(w[:7]), w[7:]]) for w in weights_in))
    copies = HostExperts.quantize(*(w[:7] for w in weights_in), bits=4)
    hidden, ids, weights = routing(tokens, hidden_size=hidden_size)
    got = owned(hidden.cuda(), ids.cuda(), weights.cuda()).float().cpu()
    assert_close(got, rest(hidden, ids, weights).float() + reference(copies, hidden, ids, weights, below=7))


def serve_demo(model_dir, **settings) -> tuple[str, list[float], list[float]]:
    """The demo model served with these settings: "owned/resident" experts of a layer, the logprobs of a prompt of
    a few hundred tokens (one chunk: the GPU's experts streamed through the ring) and of 16 greedy decode steps
    (replayed from CUDA graphs: the GPU's experts read by the mapped kernels). No duplicate copies stream
    (kt_gpu_prefill_tokens=0): the experts the GPU computes are the ones it owns."""
    from tests.conftest import start_server
    from tests.engines.kt.test_kt_gpu import TEXT

    running = start_server(model_dir, engine="ktransformers", **{"kt_gpu_prefill_tokens": 0, **settings})
    try:
        client, model = running.openai(), running.engine.info.id
        prompt = client.completions.create(model=model, prompt=TEXT[:1200], max_tokens=0, echo=True, logprobs=0)
        decode = client.completions.create(model=model, prompt=TEXT[:200], max_tokens=16, temperature=0,
                                           logprobs=0, extra_body={"ignore_eos": True})
        details = running.engine.info.details
        return (f'{details["gpu_read_experts"]}/{details["gpu_resident_experts"]}',
                prompt.choices[0].logprobs.token_logprobs[1:], decode.choices[0].logprobs.token_logprobs)
    finally:
        running.stop()


def median_diff(a: list[float], b: list[float]) -> float:
    diffs = sorted(abs(x - y) for x, y in zip(a, b))
    return diffs[len(diffs) // 2]


def test_int8_servers_whose_gpu_owns_experts_agree_with_kt_kernel_alone(demo_model_dir):
    from tests.engines.kt.test_kt_gpu import GPU_MEDIAN_LOGPROB_DIFF

    off, prompt_alone, decode_alone = serve_demo(demo_model_dir, kt_method="AMXINT8", kt_gpu_read_experts=0)
    assert off == "0/0"
    # the balance for 16 experts, int8 on both sides; then 4 kept in GPU memory and the balance of the other 12
    for settings, owned in (({}, "8/0"), ({"kt_gpu_resident_experts": 4}, "10/4")):
        split, prompt, decode = serve_demo(demo_model_dir, kt_method="AMXINT8", **settings)
        assert split == owned
        same = next((k for k, (a, b) in enumerate(zip(decode, decode_alone)) if abs(a - b) > 0.5), len(decode))
        print(json.dumps({"owned/resident": split, "prompt_positions": len(prompt),
                          "prompt_median_diff": median_diff(prompt, prompt_alone), "decode_same_positions": same}))
        assert len(prompt) > 100 and median_diff(prompt, prompt_alone) < GPU_MEDIAN_LOGPROB_DIFF
        assert same >= 4


def test_int4_servers_whose_gpu_owns_experts_stay_as_close_to_bf16_as_kt_kernel_alone(demo_model_dir):
    """The experts the GPU owns are its own int4 copies (a scale per 128 weights), not kt-kernel's AMXINT4 form:
    the served model must stay as faithful to the 16-bit one as kt-kernel computing every expert is."""
    from engines.kt.experts.methods import unavailable_reason

    if unavailable_reason("AMXINT4") is not None:
        pytest.skip(f"AMXINT4: {unavailable_reason('AMXINT4')}")
    _, prompt_bf16, _ = serve_demo(demo_model_dir, kt_method="BF16", kt_gpu_read_experts=0)
    off, prompt_alone, decode_alone = serve_demo(demo_model_dir, kt_method="AMXINT4", kt_gpu_read_experts=0)
    split, prompt, decode = serve_demo(demo_model_dir, kt_method="AMXINT4")
    assert (off, split) == ("0/0", "8/0")  # by default the balance, as for 8-bit methods
    alone, owned = median_diff(prompt_alone, prompt_bf16), median_diff(prompt, prompt_bf16)
    print(json.dumps({"prompt_positions": len(prompt), "kt_kernel_alone_vs_bf16": alone, "owned_vs_bf16": owned,
                      "owned_vs_kt_kernel_alone": median_diff(prompt, prompt_alone)}))
    assert len(prompt) > 100 and owned <= 1.5 * alone
    assert len(decode) == len(decode_alone) == 16
