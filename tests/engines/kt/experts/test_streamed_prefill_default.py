"""Whether prompt chunks stream the routed experts to the GPU when the settings leave it open (kt_gpu_prefill_tokens
and chunk_size unset): on where the layers' output lies on a GPU and the host holds kt-kernel's experts and a copy
of each within AUTO_HOST_SHARE of its available memory, in chunks of 8,192 tokens; otherwise off, in chunks of
2,048, with the reason said (engines/kt/experts/notes.py: streamed_prefill)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from engines.kt.experts.host_copies import expert_copy_bytes
from engines.kt.experts import notes as expert_notes
from engines.kt.experts.notes import AUTO_HOST_SHARE, AUTO_PREFILL_TOKENS, streamed_prefill
from engines.kt.options import KTOptions

LAYERS, EXPERTS, HIDDEN, INTER = 3, 8, 256, 128
CONFIG = SimpleNamespace(hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=EXPERTS)
KERNEL_INT8 = LAYERS * EXPERTS * 3 * HIDDEN * INTER  # kt-kernel's int8 experts, bytes
COPIES_INT8 = LAYERS * EXPERTS * expert_copy_bytes(HIDDEN, INTER, 8)
NEEDED = KERNEL_INT8 + COPIES_INT8


def model_with_expert_layers(layers: int = LAYERS) -> nn.Module:
    """A module tree named as the families' models are: model.layers.N.mlp.experts."""
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList()
    for _ in range(layers):
        layer = nn.Module()
        layer.mlp = nn.Module()
        layer.mlp.experts = nn.Module()
        model.model.layers.append(layer)
    return model


@pytest.fixture
def host(monkeypatch):
    """A host with a GPU and `available` bytes of MemAvailable (set host.available)."""
    state = SimpleNamespace(available=10 * NEEDED)
    monkeypatch.setattr(expert_notes, "memory_available", lambda: state.available)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return state


def resolve(host, gpu: bool = True, chunk_size: int | None = None, methods=("AMXINT8",), **settings):
    return streamed_prefill(KTOptions(**settings), model_with_expert_layers(), CONFIG, set(methods), gpu, chunk_size)


def test_prompts_stream_by_default_in_8192_token_chunks_where_the_host_holds_the_copies(host):
    host.available = NEEDED / AUTO_HOST_SHARE + 1
    prefill = resolve(host)
    assert (prefill.tokens, prefill.experts, prefill.chunk_size, prefill.why) == (AUTO_PREFILL_TOKENS, None, 8192, "")


def test_prompts_stay_on_the_cpu_by_default_in_2048_token_chunks_where_the_copies_would_not_fit(host):
    host.available = NEEDED / AUTO_HOST_SHARE - 4096
    prefill = resolve(host)
    assert (prefill.tokens, prefill.chunk_size) == (0, 2048)
    assert f"{AUTO_HOST_SHARE:.0%} of the host memory available" in prefill.why
    assert "kt_gpu_prefill_tokens=N" in prefill.why and "kt_gpu_prefill_memory" in prefill.why


def test_a_budget_for_the_copies_counts_instead_of_every_copy(host):
    host.available = (KERNEL_INT8 + COPIES_INT8 / 2) / AUTO_HOST_SHARE + 1  # room for half the copies only
    assert resolve(host).tokens == 0
    half_gb = COPIES_INT8 / 2 / 1e9
    prefill = resolve(host, kt_gpu_prefill_memory=half_gb)
    assert prefill.tokens == AUTO_PREFILL_TOKENS and prefill.experts == EXPERTS // 2


def test_four_bit_methods_count_their_half_byte_copies(host):
    kernel, copies = KERNEL_INT8 // 2, LAYERS * EXPERTS * expert_copy_bytes(HIDDEN, INTER, 4)
    host.available = (kernel + copies) / AUTO_HOST_SHARE + 1
    assert resolve(host, methods=("AMXINT4",)).tokens == AUTO_PREFILL_TOKENS
    assert resolve(host).tokens == 0  # the same host holds no int8 experts with their copies


def test_mxfp4_experts_count_their_released_bytes(host):
    kernel = LAYERS * EXPERTS * 3 * HIDDEN * INTER // 2  # 4-bit weights; the scales are not counted
    copies = LAYERS * EXPERTS * expert_copy_bytes(HIDDEN, INTER, mxfp4=True)
    host.available = (kernel + copies) / AUTO_HOST_SHARE + 1
    prefill = streamed_prefill(KTOptions(), model_with_expert_layers(), CONFIG, {"MXFP4"}, True, None)
    assert (prefill.tokens, prefill.chunk_size) == (AUTO_PREFILL_TOKENS, 8192)


def test_settings_given_are_kept_whatever_the_host_holds(host):
    host.available = 1
    assert resolve(host, kt_gpu_prefill_tokens=512).tokens == 512
    assert resolve(host, kt_gpu_prefill_tokens=512).chunk_size == 8192
    assert resolve(host, chunk_size=4096, kt_gpu_prefill_tokens=512).chunk_size == 4096
    host.available = 10 * NEEDED
    off = resolve(host, kt_gpu_prefill_tokens=0)
    assert (off.tokens, off.chunk_size, off.why) == (0, 2048, "")
    assert resolve(host, chunk_size=1024).chunk_size == 1024


@pytest.mark.parametrize("method", ["BF16", "RAWINT4", "LLAMAFILE"])
def test_methods_whose_copies_would_be_coarser_than_their_own_form_do_not_stream_by_default(host, method):
    prefill = resolve(host, methods=(method, "AMXINT8"))
    assert prefill.tokens == 0 and f"copies of {method} experts" in prefill.why
    assert resolve(host, methods=(method,), kt_gpu_prefill_tokens=64).tokens == 64  # asked for: streams


def test_fp8_experts_stream_by_default(host):
    assert resolve(host, methods=("FP8",)).tokens == AUTO_PREFILL_TOKENS


@pytest.mark.parametrize("setting", ["kt_gpu_read_experts", "kt_gpu_resident_experts"])
def test_experts_handed_to_the_gpu_to_own_leave_prompts_unstreamed_by_default(host, setting):
    prefill = resolve(host, **{setting: 2})
    assert prefill.tokens == 0 and setting in prefill.why


def test_kt_gpu_read_experts_0_still_streams_by_default(host):
    assert resolve(host, kt_gpu_read_experts=0).tokens == AUTO_PREFILL_TOKENS


@pytest.mark.parametrize("gpu, methods, why", [(False, ("AMXINT8",), "no GPU in the placement"),
                                                (True, (None,), "no routed experts on the CPU")])
def test_nothing_streams_by_default_without_a_gpu_or_cpu_experts(host, gpu, methods, why):
    prefill = resolve(host, gpu=gpu, methods=methods)
    assert (prefill.tokens, prefill.chunk_size, prefill.why) == (0, 2048, why)


def test_streaming_asked_for_without_a_gpu_keeps_2048_token_chunks(host):
    assert resolve(host, gpu=False, kt_gpu_prefill_tokens=16).chunk_size == 2048


def test_a_budget_holding_no_expert_says_so(host):
    prefill = resolve(host, kt_gpu_prefill_tokens=16, kt_gpu_prefill_memory=1e-9)
    assert (prefill.tokens, prefill.chunk_size) == (0, 2048)
    assert "kt_gpu_prefill_memory holds no expert's copy" in prefill.off_detail()


def test_nothing_streams_by_default_where_torch_sees_no_cuda(host, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve(host).why == "no GPU in the placement"


def streamers_of(*streamers) -> SimpleNamespace:
    return SimpleNamespace(streamers=SimpleNamespace(active=lambda: list(streamers)))


def streamer(form: str, held: list[int], nbytes: int, gbps: float) -> SimpleNamespace:
    layers = {i: SimpleNamespace(form=form, held=n, nbytes=nbytes) for i, n in enumerate(held)}
    return SimpleNamespace(layers=layers, pcie_bytes_per_s=gbps * 1e9, device=torch.device("cuda", 0))


@pytest.mark.parametrize("form", ["int8", "mxfp4"], ids=["v2-v3-int8-copies", "v4-mxfp4-copies"])
def test_every_family_reports_streamed_prompts_under_the_same_engine_detail_keys(form):
    """/version's details of a streaming engine, whatever the family (both call streaming_details): the threshold,
    each layer's experts with copies (the fewest), what the copies are with the bytes pinned, the copy rate."""
    from engines.kt.experts.notes import StreamedPrefill, streaming_details

    options = streamers_of(streamer(form, [8, 6], 2_500_000_000, 55.14), streamer(form, [8], 1_000_000_000, 52.0))
    details = streaming_details(options, StreamedPrefill(128, None, 8192))
    assert details == {"gpu_prefill_tokens": "128", "gpu_prefill_experts": "6",
                       "gpu_prefill_copies": f"{form} copies, 6.00 GB pinned", "gpu_prefill_copy_gbps": "52.0"}


def test_where_no_prompt_streams_the_engine_details_say_why_under_the_one_key():
    from engines.kt.experts.notes import StreamedPrefill, streaming_details

    off = StreamedPrefill(0, None, 2048, "no GPU in the placement")
    assert streaming_details(streamers_of(), off) == {
        "gpu_prefill_tokens": "0: every routed expert of a prompt on the CPU (no GPU in the placement)"}
    no_layer = StreamedPrefill(16, None, 2048)  # asked for, but no expert layer's output is on a GPU
    assert streaming_details(streamers_of(), no_layer) == {
        "gpu_prefill_tokens": "0: every routed expert of a prompt on the CPU (no CPU-expert layer sends its output "
                              "to a GPU)"}
