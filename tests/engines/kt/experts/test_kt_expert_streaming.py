"""Streamed experts (engines/kt/experts/streaming.py, `kt_gpu_prefill_tokens`): the arithmetic of the GPU side,
the buffer ring and the split, checked on the CPU (the same code with plain copies instead of a copy stream).
The GPU path itself: tests/engines/kt/experts/test_kt_gpu_streamed_experts.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.kt.experts.host_copies import (CPU_EXPERT_BYTES_PER_S, INT4_GROUP, HostExperts, dequantize_int4,
                                           expert_copy_bytes, experts_within)
from engines.kt.experts.streaming import GROUP, RING, ExpertStreamer, split_experts

E, I, H, TOP_K = 20, 64, 128, 4  # 20 experts: two full groups of 8 and a partial one


def layer_weights(seed: int, hidden: int = H, inter: int = I) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(E, *shape, generator=g) * 0.1 for shape in ((inter, hidden), (inter, hidden),
                                                                         (hidden, inter)))


def routing(tokens: int, seed: int = 0, hidden_size: int = H) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)])
    ids[0, -1] = -1  # an empty slot contributes nothing
    return hidden, ids, torch.rand(tokens, TOP_K, generator=g)


def weights_of(host: HostExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 gate_up and down weights a copy stands for (int8 or int4)."""
    if host.bits == 4:
        return (dequantize_int4(host.gate_up, host.gate_up_scale, host.hidden).float(),
                dequantize_int4(host.down, host.down_scale, host.intermediate).float())
    return host.gate_up.float() * host.gate_up_scale.unsqueeze(-1), host.down.float() * host.down_scale.unsqueeze(-1)


def reference(host: HostExperts, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              below: int) -> torch.Tensor:
    """float32 sum over the experts below `below`, from the quantized weights the streamer reads."""
    gate_up, down = weights_of(host)
    out = torch.zeros(hidden.shape[0], host.hidden)
    for t in range(hidden.shape[0]):
        for k in range(TOP_K):
            e = int(ids[t, k])
            if 0 <= e < below:
                gate, up = (hidden[t].float() @ gate_up[e].T).split(host.intermediate)
                out[t] += weights[t, k] * ((F.silu(gate) * up) @ down[e].T)
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # bf16 operands and products: ~3 significant digits
    assert (actual - expected).norm() <= 2e-2 * expected.norm(), float((actual - expected).norm() / expected.norm())


def streamer_with(*layers: int, held: int = E, bits: int = 8) -> ExpertStreamer:
    """A streamer over these layers, each keeping `bits`-bit copies of its first `held` experts."""
    streamer = ExpertStreamer(torch.device("cpu"))
    for layer in layers:
        streamer.register(layer, HostExperts.quantize(*(w[:held] for w in layer_weights(layer)), bits=bits))
    return streamer


def test_int8_rows_reproduce_the_weights_within_half_a_step():
    gate, up, down = layer_weights(0)
    host = HostExperts.quantize(gate, up, down)
    restored = host.down.float() * host.down_scale.unsqueeze(-1)
    assert host.down.dtype == torch.int8 and host.gate_up.shape == (E, 2 * I, H)
    assert ((restored - down).abs() <= host.down_scale.unsqueeze(-1) / 2 + 1e-7).all()


def test_int4_copies_reproduce_the_weights_within_half_a_step_of_their_group():
    gate, up, down = layer_weights(0)
    host = HostExperts.quantize(gate, up, down, bits=4)
    assert (host.bits, host.hidden, host.intermediate) == (4, H, I)
    step = host.down_scale.float().transpose(-1, -2).repeat_interleave(INT4_GROUP, -1)[..., :I]
    # half a step, and the bf16 rounding of a weight of up to 7 steps (half a unit of bf16's 8 bits: 2^-8 of it)
    assert ((weights_of(host)[1] - down).abs() <= step / 2 + 7 * step * 2 ** -8 + 1e-7).all()


def test_int4_copies_hold_a_rows_two_groups_of_each_block_in_the_low_and_high_nibbles():
    """The GPU kernels read a block of 128 bytes and multiply its low nibbles by the block's first group."""
    row = torch.arange(2 * INT4_GROUP, dtype=torch.float32).remainder(15).sub(7)  # -7..7, one step = 1
    row[0] = 7  # both groups' largest magnitude is 7: a scale of exactly 1
    host = HostExperts.quantize(row.view(1, 1, -1), row.view(1, 1, -1), torch.ones(1, 2 * INT4_GROUP, 1), bits=4)
    packed = host.gate_up[0, 0]
    assert packed.shape == (INT4_GROUP,) and host.gate_up_scale[0, :, 0].tolist() == [1.0, 1.0]
    assert torch.equal((packed & 15).float() - 8, row[:INT4_GROUP])
    assert torch.equal((packed >> 4).float() - 8, row[INT4_GROUP:])


def test_int4_copies_take_about_half_the_host_memory_of_int8_ones():
    int4, int8 = expert_copy_bytes(2048, 1408, bits=4), expert_copy_bytes(2048, 1408)
    assert 0.5 < int4 / int8 < 0.6  # a V2-Lite expert: 1,408 padded to 1,536 in `down`, plus the group scales
    assert HostExperts.empty(3, 1408, 2048, bits=4).nbytes == 3 * int4


def test_streamed_int4_copies_compute_the_weighted_sum_of_every_expert():
    streamer = streamer_with(3, bits=4)
    hidden, ids, weights = routing(37)
    out = streamer.compute(3, hidden, ids, weights, E)
    assert_close(out, reference(streamer.layers[3], hidden, ids, weights, E))


def test_streamed_experts_compute_the_weighted_sum_of_every_expert():
    streamer = streamer_with(3)
    hidden, ids, weights = routing(37)
    out = streamer.compute(3, hidden, ids, weights, E)
    assert out.dtype == torch.float32 and out.shape == (37, H)
    assert_close(out, reference(streamer.layers[3], hidden, ids, weights, E))


def test_only_experts_below_the_split_are_computed_on_the_streaming_side():
    streamer = streamer_with(3)
    hidden, ids, weights = routing(37)
    out = streamer.compute(3, hidden, ids, weights, 11)  # one full group and three of the next
    assert_close(out, reference(streamer.layers[3], hidden, ids, weights, 11))
    assert streamer.stats.experts == 11


def test_a_layer_uses_the_groups_the_previous_layer_prefetched_for_it():
    streamer = streamer_with(1, 2)
    hidden, ids, weights = routing(16)
    host_bytes = {layer: h.gate_up.nbytes + h.gate_up_scale.nbytes + h.down.nbytes + h.down_scale.nbytes
                  for layer, h in streamer.layers.items()}
    streamer.compute(1, hidden, ids, weights, E)
    assert [slot.tag for slot in streamer._queue] == [(2, 0, GROUP), (2, GROUP, GROUP), (2, 2 * GROUP, E - 2 * GROUP)]
    out = streamer.compute(2, hidden, ids, weights, E)
    assert streamer.stats.bytes == host_bytes[1] + host_bytes[2]  # nothing copied twice
    assert_close(out, reference(streamer.layers[2], hidden, ids, weights, E))


def test_a_prefetch_for_another_split_is_dropped_and_the_result_stays_right():
    streamer = streamer_with(1, 2)
    hidden, ids, weights = routing(16)
    streamer.compute(1, hidden, ids, weights, E)  # prefetches layer 2's groups of a 20-expert split
    out = streamer.compute(2, hidden, ids, weights, 9)
    assert_close(out, reference(streamer.layers[2], hidden, ids, weights, 9))
    assert len(streamer._queue) <= RING


def test_the_last_layer_prefetches_nothing():
    streamer = streamer_with(1, 2)
    hidden, ids, weights = routing(8)
    streamer.compute(2, hidden, ids, weights, E)
    assert not streamer._queue


def test_a_call_whose_tokens_all_go_to_the_cpu_returns_zeros():
    streamer = streamer_with(1)
    hidden, ids, weights = routing(8)
    out = streamer.compute(1, hidden, ids.clamp_min(12), weights, 12)
    assert torch.equal(out, torch.zeros(8, H))


def test_the_split_is_even_when_both_sides_are_bound_by_the_same_bandwidth():
    layer = 64 * 3 * 2048 * 1408  # V2-Lite, int8 on both sides
    assert split_experts(128, 6, 64, layer, layer, CPU_EXPERT_BYTES_PER_S) == 32


def test_the_gpu_takes_more_experts_as_chunks_grow():
    layer = 64 * 3 * 2048 * 1408
    shares = [split_experts(t, 6, 64, layer, layer, 50e9) for t in (128, 1024, 2048, 8192)]
    assert shares == sorted(shares) and shares[0] < shares[-1] <= 64
    assert split_experts(128, 6, 64, layer, layer, float("inf")) == 64  # copying costs nothing: all on the GPU


def test_fp8_experts_give_the_gpu_every_expert_of_a_chunk_their_slow_cpu_kernel_would_take_half_of():
    layer = 64 * 3 * 2048 * 1408  # a V2-Lite layer's experts, one byte a weight
    assert split_experts(512, 6, 64, layer, layer, 55e9) == 34  # INT8: both sides take about as long
    assert split_experts(512, 6, 64, layer, layer, 55e9, method="FP8") == 64


def test_mxfp4_experts_of_a_streamed_call_all_go_to_the_gpu_at_every_size():
    layer = 256 * 3 * 4096 * 2048 // 2  # a V4-Flash layer's experts, about half a byte a weight
    assert [split_experts(t, 6, 256, layer, layer, 55e9, method="MXFP4") for t in (100, 129, 512)] == [256] * 3
    assert split_experts(129, 6, 256, layer, layer, 55e9) < 256  # the INT8 rate would split it


def test_a_budget_keeps_copies_of_as_many_first_experts_as_fit_in_every_layer():
    one = expert_copy_bytes(2048, 1408)  # a V2-Lite expert: 8.65 MB of int8 and 0.02 MB of scales
    assert one == 3 * 2048 * 1408 + (2 * 1408 + 2048) * 4
    assert experts_within(26 * 4 * one, 26, 64, 2048, 1408) == 4
    assert experts_within(26 * 4 * one - 1, 26, 64, 2048, 1408) == 3  # never over the budget
    assert experts_within(1e15, 26, 64, 2048, 1408) == 64  # a large budget holds every expert, no more
    assert experts_within(one, 26, 64, 2048, 1408) == 0


def test_the_gpu_takes_no_more_experts_than_a_layer_holds_copies_of():
    layer = E * 3 * H * I  # the CPU's bytes: int8, as the copies
    streamer = streamer_with(1, held=5)
    streamer.pcie_bytes_per_s = float("inf")  # copying costs nothing: the balance would give the GPU all 20
    assert split_experts(128, TOP_K, E, layer, layer, float("inf")) == E
    assert streamer.split(1, 128, TOP_K, E, layer) == 5
    held = streamer_with(1, held=15)
    held.pcie_bytes_per_s = 2e10  # the balance falls below 15: it weighs copying the whole layer, not the 15
    whole = (held.layers[1].gate_up.nbytes + held.layers[1].down.nbytes) // 15 * E
    assert held.split(1, 4, TOP_K, E, layer) == split_experts(4, TOP_K, E, layer, whole, 2e10) == 13


def test_a_layer_holding_some_experts_computes_them_and_prefetches_within_them():
    streamer = streamer_with(1, 2, held=11)  # one full group of 8 and three
    hidden, ids, weights = routing(37)
    out = streamer.compute(1, hidden, ids, weights, 11)
    assert_close(out, reference(streamer.layers[1], hidden, ids, weights, 11))
    assert [slot.tag for slot in streamer._queue] == [(2, 0, GROUP), (2, GROUP, 3)]
    out = streamer.compute(2, hidden, ids, weights, 11)
    assert_close(out, reference(streamer.layers[2], hidden, ids, weights, 11))


def test_a_layer_asked_for_experts_it_holds_no_copy_of_refuses():
    streamer = streamer_with(1, held=4)
    hidden, ids, weights = routing(8)
    with pytest.raises(ValueError, match="5 asked for, copies of 4 held"):
        streamer.compute(1, hidden, ids, weights, 5)


def test_copies_of_fewer_experts_than_a_group_make_the_groups_that_small():
    streamer = streamer_with(1, 2, held=3)
    hidden, ids, weights = routing(16)
    assert streamer.group == 3 and streamer._ring[0].tensors[0].shape[0] == 3
    out = streamer.compute(1, hidden, ids, weights, 3)
    assert_close(out, reference(streamer.layers[1], hidden, ids, weights, 3))


def test_a_layer_loaded_from_the_weight_cache_streams_the_checkpoint_weights(demo_model_dir, tmp_path):
    from tests.helpers import require_kt_kernel

    require_kt_kernel()
    from engines.kt.experts.methods import best_method
    from engines.kt.experts.cpu import RoutedExpertsCPU
    from engines.kt.loader import read_layer_experts

    def layer(streamer: ExpertStreamer) -> RoutedExpertsCPU:
        # the demo model's first MoE layer; a CPU streamer stands in for a GPU's (what registers is the same)
        return RoutedExpertsCPU(layer_idx=1, num_experts=16, top_k=4, hidden_size=256, intermediate_size=256,
                                method=best_method(8), max_tokens=64, checkpoint=str(demo_model_dir),
                                streamer=streamer, stream_tokens=32)

    weights = read_layer_experts(demo_model_dir, "model.layers.1.mlp.experts", 16)
    first, second = ExpertStreamer(torch.device("cpu")), ExpertStreamer(torch.device("cpu"))
    layer(first).load_weights(*weights, cache_dir=tmp_path)
    assert layer(second).load_quantized(tmp_path)
    expected = HostExperts.quantize(*weights)
    for streamer in (first, second):
        assert all(torch.equal(a, b) for a, b in zip(streamer.layers[1].tensors(), expected.tensors()))


@pytest.mark.parametrize("source", ["checkpoint", "weight cache"])
def test_a_layer_with_a_budget_registers_copies_of_its_first_experts_only(demo_model_dir, tmp_path, source):
    from tests.helpers import require_kt_kernel

    require_kt_kernel()
    from engines.kt.experts.methods import best_method
    from engines.kt.experts.cpu import RoutedExpertsCPU
    from engines.kt.loader import read_layer_experts

    def layer(streamer: ExpertStreamer) -> RoutedExpertsCPU:
        return RoutedExpertsCPU(layer_idx=1, num_experts=16, top_k=4, hidden_size=256, intermediate_size=256,
                                method=best_method(8), max_tokens=64, checkpoint=str(demo_model_dir),
                                streamer=streamer, stream_tokens=32, stream_experts=5)

    weights = read_layer_experts(demo_model_dir, "model.layers.1.mlp.experts", 16)
    streamer = ExpertStreamer(torch.device("cpu"))
    if source == "checkpoint":
        layer(streamer).load_weights(*weights)
    else:  # the cache holds kt-kernel's form; the copies are read from the checkpoint, the first 5 experts only
        layer(ExpertStreamer(torch.device("cpu"))).load_weights(*weights, cache_dir=tmp_path)
        assert layer(streamer).load_quantized(tmp_path)
    expected = HostExperts.quantize(*(w[:5] for w in weights))
    assert streamer.layers[1].held == 5
    assert all(torch.equal(a, b) for a, b in zip(streamer.layers[1].tensors(), expected.tensors()))
    assert streamer.split(1, 64, 4, 16, 10**9) == 5  # a CPU streamer copies for free: the balance says all 16


def test_reading_the_first_experts_of_a_layer_gives_those_of_the_whole_layer(demo_model_dir, tmp_path):
    from safetensors.torch import save_file

    from engines.kt.loader import read_layer_experts

    # per-expert tensors (the demo model), and the fused gate_up_proj / down_proj layout
    fused = {"model.layers.0.mlp.experts.gate_up_proj": torch.randn(E, 2 * I, H),
             "model.layers.0.mlp.experts.down_proj": torch.randn(E, H, I)}
    save_file(fused, str(tmp_path / "model.safetensors"))
    for where, prefix, count in ((demo_model_dir, "model.layers.1.mlp.experts", 16),
                                 (tmp_path, "model.layers.0.mlp.experts", E)):
        whole = read_layer_experts(where, prefix, count)
        first = read_layer_experts(where, prefix, count, first=5)
        assert [t.shape[0] for t in first] == [5, 5, 5]
        assert all(torch.equal(a, b[:5]) for a, b in zip(first, whole))


def test_the_budget_gives_each_expert_layer_the_experts_it_holds(demo_model_dir, caplog):
    from transformers import AutoConfig, AutoModelForCausalLM

    from engines.kt.experts.notes import streamed_expert_count
    from engines.kt.options import KTOptions

    config = AutoConfig.from_pretrained(demo_model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = sum(1 for name, _ in model.named_modules() if name.endswith(".mlp.experts"))
    one = expert_copy_bytes(config.hidden_size, config.moe_intermediate_size)
    budget = 3 * layers * one / 1e9  # GB
    assert streamed_expert_count(KTOptions(kt_gpu_prefill_memory=budget), model, config, tokens=64) == 3
    assert streamed_expert_count(KTOptions(), model, config, tokens=64) is None  # every expert
    with caplog.at_level("WARNING", logger="ktserve.engine.kt"):
        assert streamed_expert_count(KTOptions(kt_gpu_prefill_memory=budget / 10), model, config, tokens=64) == 0
        assert streamed_expert_count(KTOptions(kt_gpu_prefill_memory=budget), model, config, tokens=0) is None
    assert "holds no expert's copy" in caplog.text and "does nothing while prompt chunks do not stream" in caplog.text


def test_the_start_up_log_says_what_a_chunk_of_streamed_experts_copies(caplog):
    from engines.kt.experts.notes import StreamedPrefill, log_streamed_experts
    from engines.kt.placement.operators import OperatorOptions

    options = OperatorOptions(gpu_prefill_tokens=128)
    streamer = options.streamers.for_device(torch.device("cpu"))
    streamer.register(1, HostExperts.quantize(*layer_weights(1)))
    streamer.pcie_bytes_per_s = streamer.layers[1].nbytes / 0.25  # as if one layer took 0.25 s to copy
    with caplog.at_level("INFO", logger="ktserve.engine.kt"):
        log_streamed_experts(options, StreamedPrefill(tokens=128, experts=None, chunk_size=2048))
    assert "copies them all, 0.25 s, once per chunk of up to chunk_size=2048 tokens" in caplog.text
    assert f"at most the first {E} of each layer's" in caplog.text


def test_decode_graphs_stop_below_the_batch_that_streams_its_experts():
    from engines.kt.families.deepseek_mla.runner import graph_max_batch

    assert graph_max_batch(32, 0) == 32  # streaming off: every batch replays a graph
    assert graph_max_batch(32, 128) == 32  # no decode step is that large
    assert graph_max_batch(32, 32) == 31  # steps of 32 run eagerly and stream
    assert graph_max_batch(8, 4) == 3
    assert graph_max_batch(8, 1) == 0  # every step streams: no graphs
