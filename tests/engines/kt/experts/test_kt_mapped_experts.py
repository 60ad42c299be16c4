"""Experts the GPU reads from host memory (`kt_gpu_read_experts`, engines/kt/experts/mapped.py): the balance
between the two readers, which calls take the path, and a layer whose first experts kt-kernel no longer holds,
checked on the CPU (where the GPU side's arithmetic runs as plain torch). The kernels:
tests/engines/kt/experts/test_kt_gpu_mapped_experts.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engines.kt.experts.host_copies import HostExperts
from engines.kt.experts.streaming import ExpertStreamer, ExpertStreamers
from engines.kt.experts.mapped import MAX_TOKENS, decode_experts
from server.settings import load_settings

INT8_EXPERT = 3 * 2048 * 1408  # one V2-Lite expert's bytes in int8


def test_readers_as_fast_as_each_other_split_the_experts_evenly():
    assert decode_experts(64, 64, INT8_EXPERT, INT8_EXPERT, gpu_bytes_per_s=50e9, cpu_bytes_per_s=50e9) == 32


def test_the_gpu_takes_fewer_experts_where_the_cpu_reads_half_the_bytes_of_each():
    # INT4 on the CPU against int8 copies on the GPU: the CPU's expert costs half as long, so it keeps two thirds
    assert decode_experts(64, 64, INT8_EXPERT / 2, INT8_EXPERT, gpu_bytes_per_s=50e9, cpu_bytes_per_s=50e9) == 21


def test_the_gpu_never_takes_more_experts_than_the_layer_holds_copies_of():
    assert decode_experts(64, 10, INT8_EXPERT, INT8_EXPERT, gpu_bytes_per_s=1e15) == 10
    assert decode_experts(64, 64, INT8_EXPERT, INT8_EXPERT, gpu_bytes_per_s=1.0) == 0


def layer_with(streamer, **kwargs):
    from engines.kt.experts.cpu import RoutedExpertsCPU

    kwargs.setdefault("read_experts", None)  # the balance, as the engine asks by default
    return RoutedExpertsCPU(layer_idx=3, num_experts=16, top_k=4, hidden_size=128, intermediate_size=64,
                            method="BF16", max_tokens=128, streamer=streamer, stream_tokens=256, **kwargs)


def mapped_streamer() -> ExpertStreamer:
    """A streamer whose decode steps may read layer 3's copies (what a CUDA device with Triton sets up)."""
    return ExpertStreamer(torch.device("cpu"), pcie_bytes_per_s=50e9, mapped=SimpleNamespace(layers={3: None}))


def test_decode_calls_take_the_balanced_share_of_the_held_experts():
    # BF16 on the CPU: two bytes a weight there, one (plus a scale a row) on the GPU, both read at 50 GB/s
    layer = layer_with(mapped_streamer(), stream_experts=12)
    assert layer.mapped_experts(1) == 11
    assert layer.mapped_experts(MAX_TOKENS) == 11
    held = layer_with(mapped_streamer(), stream_experts=6)
    assert held.mapped_experts(1) == 6


def test_calls_of_more_than_max_tokens_keep_their_experts_off_the_mapped_path():
    assert layer_with(mapped_streamer()).mapped_experts(MAX_TOKENS + 1) == 0


def test_no_mapped_share_without_the_setting_a_registered_layer_or_with_hot_experts():
    assert layer_with(ExpertStreamer(torch.device("cpu"), pcie_bytes_per_s=50e9)).mapped_experts(1) == 0
    other = ExpertStreamer(torch.device("cpu"), pcie_bytes_per_s=50e9, mapped=SimpleNamespace(layers={4: None}))
    assert layer_with(other).mapped_experts(1) == 0
    assert layer_with(mapped_streamer(), gpu_experts=[15]).mapped_experts(1) == 0


def test_streamers_read_copies_in_place_only_on_cuda_devices():
    from .test_kt_expert_streaming import E, TOP_K, layer_weights

    streamer = ExpertStreamers().for_device(torch.device("cpu"))
    streamer.register(0, HostExperts.quantize(*layer_weights(0)), TOP_K, read_in_place=True)
    assert (streamer.layers[0].held, streamer.mapped) == (E, None)


def test_operators_built_outside_the_engine_read_nothing_from_host_memory_unless_asked():
    from engines.kt.experts.cpu import RoutedExpertsCPU
    from engines.kt.placement.operators import OperatorOptions

    assert OperatorOptions().gpu_read_experts == 0
    plain = RoutedExpertsCPU(layer_idx=3, num_experts=16, top_k=4, hidden_size=128, intermediate_size=64,
                             method="BF16", max_tokens=128, streamer=mapped_streamer(), stream_tokens=256)
    assert plain.mapped_experts(1) == 0
    assert layer_with(mapped_streamer(), read_experts=0).mapped_experts(1) == 0


def test_the_setting_defaults_to_the_balance_and_zero_turns_it_off():
    assert load_settings(None, env={}).kt_gpu_read_experts is None
    assert load_settings(None, env={"KTSERVE_KT_GPU_READ_EXPERTS": "0"}).kt_gpu_read_experts == 0


@pytest.mark.parametrize(("setting", "method", "bits", "owned"), [
    (None, "AMXINT8", 8, 32), (None, "FP8", 8, 32), (None, "AMXINT4", 4, 32), (20, "AMXINT4", 4, 20),
    (None, "BF16", 16, 0), (0, "AMXINT8", 8, 0), (5, "BF16", 16, 5), (99, "AMXINT8", 8, 58), (20, "RAWINT4", 4, 0),
    (None, "MXFP4", 4, 36), (20, "MXFP4", 4, 20)],
    ids=["int8-balance", "fp8-balance", "int4-balance-of-int4-copies", "asked-for-int4", "bf16-not-by-default", "off",
         "asked-for-bf16", "kt-kernel-keeps-a-tokens-worth", "never-rawint4", "mxfp4-balance",
         "asked-for-mxfp4"])
def test_how_many_experts_the_gpu_owns(monkeypatch, setting, method, bits, owned):
    import engines.kt.experts.mapped as mapped

    monkeypatch.setattr(mapped, "triton_available", lambda: True)
    assert mapped.owned_experts(setting, method, bits, 64, top_k=6) == owned


def test_without_triton_the_gpu_owns_no_expert(monkeypatch):
    import engines.kt.experts.mapped as mapped

    monkeypatch.setattr(mapped, "triton_available", lambda: False)
    assert mapped.owned_experts(None, "AMXINT8", 8, 64, top_k=6) == 0


def owned_layer(owned: int, method: str = "BF16", **kwargs):
    from engines.kt.experts.cpu import RoutedExpertsCPU
    from .test_kt_expert_streaming import E, H, I, TOP_K

    kwargs.setdefault("streamer", ExpertStreamer(torch.device("cpu")))
    return RoutedExpertsCPU(layer_idx=5, num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                            method=method, max_tokens=64, stream_tokens=MAX_TOKENS + 1, owned_experts=owned,
                            **kwargs)


def test_a_layer_whose_first_experts_the_gpu_owns_equals_kt_kernel_computing_all():
    from engines.kt.experts.cpu import RoutedExpertsCPU
    from .test_kt_expert_streaming import E, H, I, TOP_K, assert_close, layer_weights, routing

    owned = owned_layer(7)
    owned.load_weights(*layer_weights(0))
    plain = RoutedExpertsCPU(layer_idx=5, num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                             method="BF16", max_tokens=64)
    plain.load_weights(*layer_weights(0))
    assert (owned.kernel_experts, owned.streamer.layers[5].held) == (E - 7, 7)
    hidden, ids, weights = routing(12)
    assert_close(owned(hidden, ids, weights).float(), plain(hidden, ids, weights).float())


@pytest.mark.parametrize("resident", [3, 7], ids=["some", "all"])
def test_owned_experts_kept_in_gpu_memory_compute_what_kt_kernel_computing_all_does(resident):
    from engines.kt.experts.cpu import RoutedExpertsCPU
    from .test_kt_expert_streaming import E, H, I, TOP_K, assert_close, layer_weights, routing

    owned = owned_layer(7, resident_experts=resident)  # the CPU stands in for GPU memory here
    owned.load_weights(*layer_weights(0))
    plain = RoutedExpertsCPU(layer_idx=5, num_experts=E, top_k=TOP_K, hidden_size=H, intermediate_size=I,
                             method="BF16", max_tokens=64)
    plain.load_weights(*layer_weights(0))
    streamer = owned.streamer
    assert (streamer.resident_experts(5), streamer.layers[5].held, streamer.held(5)) == (resident, 7 - resident, 7)
    hidden, ids, weights = routing(12)
    assert_close(owned(hidden, ids, weights).float(), plain(hidden, ids, weights).float())


def test_a_streamer_whose_experts_all_lie_in_gpu_memory_builds_no_copy_ring():
    """The ring's buffers (three groups of experts) would take GPU memory that nothing fills."""
    from .test_kt_expert_streaming import layer_weights, routing

    owned = owned_layer(7, resident_experts=7)
    owned.load_weights(*layer_weights(0))
    assert owned.streamer.ring_bytes() == 0
    owned(*routing(12))  # a chunk computes them where they lie
    mixed = owned_layer(7, resident_experts=3)
    mixed.load_weights(*layer_weights(0))
    assert mixed.streamer.ring_bytes() > 0


def test_resident_experts_are_at_most_the_experts_the_gpu_owns():
    with pytest.raises(ValueError, match=r"resident_experts of layer 5 must lie in 0..7"):
        owned_layer(7, resident_experts=8)


@pytest.mark.parametrize(("setting", "method", "resident"), [
    (0, "AMXINT8", 0), (10, "AMXINT8", 10), (10, "AMXINT4", 10), (10, "BF16", 10), (10, "RAWINT4", 0),
    (58, "AMXINT8", 58), (10, "MXFP4", 10)],
    ids=["off", "int8", "int4", "bf16", "never-rawint4", "kt-kernel-keeps-a-tokens-worth", "mxfp4"])
def test_how_many_experts_stay_in_gpu_memory(monkeypatch, setting, method, resident):
    import engines.kt.experts.mapped as mapped

    monkeypatch.setattr(mapped, "triton_available", lambda: True)
    assert mapped.resident_experts(setting, method, 64, top_k=6) == resident


def test_asking_more_experts_in_gpu_memory_than_kt_kernel_can_spare_names_the_setting_and_the_limit(monkeypatch):
    import engines.kt.experts.mapped as mapped

    monkeypatch.setattr(mapped, "triton_available", lambda: True)
    with pytest.raises(ValueError, match=r"kt_gpu_resident_experts=59: .* at most 58"):
        mapped.resident_experts(59, "AMXINT8", 64, top_k=6)
    monkeypatch.setattr(mapped, "triton_available", lambda: False)
    assert mapped.resident_experts(10, "AMXINT8", 64, top_k=6) == 0


def test_the_resident_setting_defaults_to_no_experts_and_reads_its_environment_variable():
    assert load_settings(None, env={}).kt_gpu_resident_experts == 0
    assert load_settings(None, env={"KTSERVE_KT_GPU_RESIDENT_EXPERTS": "16"}).kt_gpu_resident_experts == 16


def test_routing_past_the_models_experts_is_refused_in_the_models_numbering():
    from .test_kt_expert_streaming import E, layer_weights, routing

    layer = owned_layer(7)
    layer.load_weights(*layer_weights(0))
    hidden, ids, weights = routing(2)
    ids[1, 0] = E
    with pytest.raises(ValueError, match=rf"must lie in -1..{E - 1}, got -1..{E}"):
        layer(hidden, ids, weights)


def test_an_owned_layers_weight_cache_holds_both_parts_and_no_other_split_takes_it(tmp_path):
    import json

    from engines.kt.experts.cpu import RoutedExpertsCPU

    def fp8_layer(owned: int, resident: int = 0) -> RoutedExpertsCPU:  # cacheable on every build; sizes of 128
        return RoutedExpertsCPU(layer_idx=5, num_experts=20, top_k=4, hidden_size=128, intermediate_size=128,
                                method="FP8", max_tokens=64, streamer=ExpertStreamer(torch.device("cpu")),
                                stream_tokens=MAX_TOKENS + 1, owned_experts=owned, resident_experts=resident)

    g = torch.Generator().manual_seed(0)
    layer = fp8_layer(7)
    layer.load_weights(*(torch.randn(20, 128, 128, generator=g) * 0.05 for _ in range(3)), cache_dir=tmp_path)
    manifest = json.loads(next(tmp_path.glob("_layer_5/ktserve-FP8.json")).read_text())
    assert (manifest["num_experts"], manifest["first_expert"]) == (13, 7)
    cached = fp8_layer(7)
    assert cached.load_quantized(tmp_path)  # kt-kernel's part and the GPU's copies, no checkpoint needed
    hidden = torch.randn(6, 128, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(20, generator=g)[:4] for _ in range(6)])
    weights = torch.rand(6, 4, generator=g)
    assert torch.equal(cached(hidden, ids, weights), layer(hidden, ids, weights))
    # the same copies, the first 3 kept in GPU memory (the CPU here): the file holds every owned expert
    resident = fp8_layer(7, resident=3)
    assert resident.load_quantized(tmp_path)
    assert (resident.streamer.resident_experts(5), resident.streamer.layers[5].held) == (3, 4)
    assert torch.equal(resident(hidden, ids, weights), layer(hidden, ids, weights))
    # and copies saved from such a split hold both parts, in order
    other = tmp_path / "saved-with-resident"
    g.manual_seed(0)
    fp8_layer(7, resident=3).load_weights(*(torch.randn(20, 128, 128, generator=g) * 0.05 for _ in range(3)),
                                          cache_dir=other)
    reloaded = fp8_layer(7)
    assert reloaded.load_quantized(other)
    assert torch.equal(reloaded(hidden, ids, weights), layer(hidden, ids, weights))
    assert not fp8_layer(6).load_quantized(tmp_path)
    next(tmp_path.glob("_layer_5/ktserve-gpu-copies.safetensors")).unlink()
    assert not fp8_layer(7).load_quantized(tmp_path)


def test_the_gpu_side_of_a_4_bit_layer_holds_int4_copies_and_of_others_int8():
    from engines.kt.experts.cpu import RoutedExpertsCPU

    def layer(method: str) -> RoutedExpertsCPU:
        return RoutedExpertsCPU(layer_idx=5, num_experts=20, top_k=4, hidden_size=128, intermediate_size=128,
                                method=method, max_tokens=64)

    from engines.kt.experts.methods import available_methods

    widths = {"AMXINT4": 4, "RAWINT4": 4, "AMXINT8": 8, "FP8": 8, "BF16": 8}  # the AMX ones where this build has them
    here = [m for m in widths if m in available_methods()]
    assert "RAWINT4" in here and "BF16" in here
    assert {m: layer(m).copy_bits for m in here} == {m: widths[m] for m in here}


def test_cached_copies_of_the_other_width_are_not_read(tmp_path):
    """A cache written when 4-bit layers' copies were int8 (or the other way round) is quantized again."""
    from engines.kt.experts.cache import LayerCache
    from .test_kt_expert_streaming import layer_weights

    cache = LayerCache(tmp_path, 5, "AMXINT4", 13, hidden_size=128, intermediate_size=64, first_expert=7)
    int4 = HostExperts.quantize(*(w[:7] for w in layer_weights(0)), bits=4)
    cache.save_copies(int4)
    _, loaded = cache.load_copies(pin=False, bits=4)
    assert all(torch.equal(a, b) for a, b in zip(loaded.tensors(), int4.tensors()))
    assert cache.load_copies(pin=False, bits=8) is None
    cache.save_copies(HostExperts.quantize(*(w[:7] for w in layer_weights(0))))
    assert cache.load_copies(pin=False, bits=4) is None


@pytest.mark.parametrize(("kwargs", "why"), [
    ({"streamer": None}, "no streamer holds their copies"),
    ({"gpu_experts": [19]}, "hot experts"),
    ({"deferred": 1}, "deferred"),
    ({"method": "RAWINT4"}, "RAWINT4 is not split")])
def test_experts_go_to_the_gpu_side_only_where_it_holds_and_computes_them(kwargs, why):
    with pytest.raises(ValueError, match=why):
        owned_layer(7, **kwargs)


def test_a_v4_flash_layer_hands_the_gpu_144_of_its_256_mxfp4_experts_by_default_streamed_or_owned(monkeypatch):
    """The README's default: the balance of kt-kernel's and the kernels' measured MXFP4 read rates, the same count
    whether decode calls read the streamed copies or the GPU owns the experts."""
    import engines.kt.experts.mapped as mapped

    monkeypatch.setattr(mapped, "triton_available", lambda: True)
    assert mapped.default_read_share("MXFP4", 256, 256, 4096, 2048) == 144
    assert mapped.owned_experts(None, "MXFP4", 4, 256, top_k=6) == 144
    assert mapped.default_read_share("MXFP4", 256, 100, 4096, 2048) == 100  # never more than the copies held
