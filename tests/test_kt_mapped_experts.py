"""Decode steps reading the held experts' copies from host memory on the GPU (`kt_gpu_decode_from_host`,
engines/kt/mapped_experts.py): the balance between the two readers and which calls take the path, checked on
the CPU. The kernels themselves: tests/test_kt_gpu_mapped_experts.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engines.kt.expert_streaming import ExpertStreamer, ExpertStreamers
from engines.kt.mapped_experts import MAPPED_SHARE_OF_COPY_RATE, MAX_TOKENS, decode_experts
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
    from engines.kt.experts_cpu import RoutedExpertsCPU

    return RoutedExpertsCPU(layer_idx=3, num_experts=16, top_k=4, hidden_size=128, intermediate_size=64,
                            method="BF16", max_tokens=128, streamer=streamer, stream_tokens=256, **kwargs)


def mapped_streamer(rate: float = 50e9 / MAPPED_SHARE_OF_COPY_RATE) -> ExpertStreamer:
    """A streamer whose decode steps may read layer 3's copies (what a CUDA device with Triton sets up)."""
    return ExpertStreamer(torch.device("cpu"), pcie_bytes_per_s=rate, mapped=SimpleNamespace(layers={3: None}))


def test_decode_calls_take_the_balanced_share_of_the_held_experts():
    # BF16 on the CPU: two bytes a weight there, one (plus a scale a row) on the GPU at the same rate
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


def test_streamers_read_from_host_memory_only_on_cuda_devices():
    assert ExpertStreamers(decode_from_host=True).for_device(torch.device("cpu")).mapped is None


@pytest.mark.parametrize(("value", "expected"), [("false", False), ("true", True)])
def test_decode_from_host_is_a_setting(value, expected):
    assert load_settings(None, env={"KTSERVE_KT_GPU_DECODE_FROM_HOST": value}).kt_gpu_decode_from_host is expected
    assert load_settings(None, env={}).kt_gpu_decode_from_host is True
