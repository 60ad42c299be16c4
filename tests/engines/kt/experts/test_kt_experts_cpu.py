"""RoutedExpertsCPU: kt-kernel's CPU experts against a plain torch reference, and the shared worker pool.

Tolerances are relative errors (norm of the difference / norm of the reference) on random bf16 weights.
BF16 is exact up to bf16 rounding (~0.4% measured); INT8 adds per-row weight and activation quantization
(~2.3%); INT4 per-row 4-bit weights (~24%, in line with a torch simulation of 4-bit rounding: ~22%);
FP8 e4m3 in 128x128 blocks ~4.4% (3 mantissa bits); RAWINT4, 4 bits per group of 32, ~17% (the kernel
agrees with the dequantized weights within 0.5%); LLAMAFILE with its default Q8_0 blocks ~1.5%.
Every method runs wherever this CPU's kt-kernel build has it; tests of the others skip with the reason.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest

from tests.helpers import require_kt_kernel
from tests.ops_support import child_pythonpath
import torch
import torch.nn.functional as F

require_kt_kernel()

from engines.kt.experts.cpuinfer import (  # noqa: E402
    default_cpu_threads, default_thread_choice, physical_cores, pool_threads, resolve_thread_count, shared_cpu_infer)
from engines.kt.experts import methods as expert_methods  # noqa: E402
from engines.kt.experts.methods import (  # noqa: E402
    METHODS, ExpertsUnsupportedError, available_methods, cpu_variant, default_pad_from, matrix_tokens, pads_to_matrix,
    reads_in_place)
from engines.kt.experts.cpu import RoutedExpertsCPU, SharedStaging  # noqa: E402

E, K, H, I = 16, 4, 256, 256
MAX_TOKENS = 32
TOLERANCE = {"BF16": 0.01, "AMXINT8": 0.05, "AMXINT4": 0.35, "FP8": 0.06, "RAWINT4": 0.25, "LLAMAFILE": 0.05,
             "MXFP4": 0.35}


@pytest.fixture(scope="module")
def weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(E, I, H, generator=g) / H**0.5).bfloat16()
    up = (torch.randn(E, I, H, generator=g) / H**0.5).bfloat16()
    down = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    return gate, up, down


@pytest.fixture(scope="module")
def experts_for(weights):
    """One loaded RoutedExpertsCPU per method, shared by the tests that only call it."""
    made: dict[str, RoutedExpertsCPU] = {}

    def get(method: str = "BF16") -> RoutedExpertsCPU:
        if method not in available_methods():
            pytest.skip(f"{method} not supported here")
        if method not in made:
            made[method] = loaded(weights, method)
        return made[method]
    return get


def make_experts(method: str = "BF16", **kwargs) -> RoutedExpertsCPU:
    kwargs = {"layer_idx": 0, "num_experts": E, "top_k": K, "hidden_size": H, "intermediate_size": I,
              "method": method, "max_tokens": MAX_TOKENS, **kwargs}
    return RoutedExpertsCPU(**kwargs)


def loaded(weights, method: str = "BF16", **kwargs) -> RoutedExpertsCPU:
    experts = make_experts(method, **kwargs)
    experts.load_weights(*weights)
    return experts


def routing(tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, K, dtype=torch.int64)
    return hidden, ids, torch.rand(tokens, K, generator=g)


def reference(weights, hidden, ids, topk_weights) -> torch.Tensor:
    """sum_k w_k * down(silu(gate(x)) * up(x)) in float32; id -1 contributes nothing."""
    gate, up, down = (w.float() for w in weights)
    x, out = hidden.float(), torch.zeros(hidden.shape[0], down.shape[1])
    for e in range(gate.shape[0]):
        token, k = (ids == e).nonzero(as_tuple=True)
        h = x[token]
        out.index_add_(0, token, topk_weights[token, k, None] * ((F.silu(h @ gate[e].T) * (h @ up[e].T)) @ down[e].T))
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


# ------------------------------------------------------------------------------------ methods and threads
def test_every_build_offers_bf16_an_8_bit_and_a_4_bit_method():
    here = available_methods()
    assert set(here) <= set(METHODS) and "BF16" in here
    assert {m for m in here if METHODS[m].bits == 8} and {m for m in here if METHODS[m].bits == 4}


def test_unsupported_method_error_names_it_and_the_supported_ones():
    missing = next((m for m in METHODS if m not in available_methods()), None)
    if missing is None:
        pytest.skip(f"kt-kernel's {cpu_variant()} build runs every method")
    with pytest.raises(ExpertsUnsupportedError) as info:
        make_experts(missing)
    assert isinstance(info.value, ValueError)
    assert f"'{missing}'" in str(info.value)
    assert all(m in str(info.value) for m in available_methods())


def on_avx2(code: str) -> str:
    """What `code` prints when run with kt-kernel's avx2 build forced (any x86-64 machine can load it)."""
    env = {**os.environ, "KT_KERNEL_CPU_VARIANT": "avx2", "PYTHONPATH": child_pythonpath()}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout, out.stderr
    return out.stdout


def construction_error(kwargs: str) -> str:
    return ("from engines.kt.experts.cpu import RoutedExpertsCPU\n"
            f"try:\n    RoutedExpertsCPU(layer_idx=0, num_experts=8, top_k=2, {kwargs})\n"
            "except ValueError as exc:\n    print(type(exc).__name__, exc)\n")


def test_avx2_build_runs_bf16_fp8_rawint4_llamafile_and_mxfp4_but_no_amx_methods():
    # kt-kernel's avx2 build (what a CPU without AVX-512 gets: AMD EPYC Rome/Milan) has no AMX* classes.
    lines = on_avx2("from engines.kt.experts.methods import available_methods, cpu_variant\n"
                    "print(cpu_variant(), ' '.join(available_methods()))\n"
                    + construction_error("hidden_size=128, intermediate_size=128, method='AMXINT8'")).splitlines()
    assert lines[0].split() == ["avx2", "BF16", "FP8", "RAWINT4", "LLAMAFILE", "MXFP4"]
    assert lines[1].startswith("ExpertsUnsupportedError") and "'AMXINT8'" in lines[1] and "FP8" in lines[1]


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (4, 2), (16, 14), (32, 28), (64, 56)])
def test_default_cpu_threads_leave_two_cores_or_an_eighth_free(cores, threads):
    assert default_thread_choice(cores)[0] == threads
    assert default_cpu_threads() == default_thread_choice(physical_cores())[0]


def test_the_pool_logs_its_thread_count_and_why():
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from engines.kt.experts.cpuinfer import shared_cpu_infer; shared_cpu_infer()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert f"started with {default_cpu_threads()} threads: {physical_cores()} physical cores less" in out.stderr


def test_more_threads_than_physical_cores_are_cut_to_the_core_count(caplog):
    with caplog.at_level(logging.WARNING, logger="engines.kt.experts.cpuinfer"):
        assert resolve_thread_count(physical_cores() + 3) == physical_cores()
    assert "physical cores" in caplog.text


@pytest.mark.parametrize("threads", [0, -2, 1.5, "4", True])
def test_thread_count_must_be_a_positive_integer(threads):
    with pytest.raises(ValueError, match="threads"):
        make_experts(threads=threads)


def test_worker_pool_is_one_per_process_and_the_first_thread_count_wins(caplog):
    pool = shared_cpu_infer()
    if physical_cores() == 1:
        pytest.skip("needs two cores to ask for a different thread count")
    other = 1 if pool_threads() != 1 else 2
    with caplog.at_level(logging.WARNING, logger="engines.kt.experts.cpuinfer"):
        assert shared_cpu_infer(other) is pool
    assert "already runs" in caplog.text


# ------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(("method", "hidden"), [("BF16", 48), ("AMXINT8", 96), ("AMXINT4", 192), ("FP8", 192),
                                               ("RAWINT4", 96), ("LLAMAFILE", 128)])
def test_sizes_the_kernel_cannot_tile_are_refused(method, hidden):
    if method not in available_methods():
        pytest.skip(f"{method} not supported here")
    with pytest.raises(ValueError, match="hidden_size"):
        make_experts(method, hidden_size=hidden)


@pytest.mark.parametrize(("method", "size"), [("BF16", 32), ("AMXINT8", 64), ("AMXINT4", 128), ("FP8", 128),
                                             ("RAWINT4", 64), ("LLAMAFILE", 256)])
def test_smallest_sizes_each_method_accepts_compute_correctly(method, size):
    if method not in available_methods():
        pytest.skip(f"{method} not supported here")
    g = torch.Generator().manual_seed(2)
    small = tuple((torch.randn(8, size, size, generator=g) / size**0.5).bfloat16() for _ in range(3))
    experts = RoutedExpertsCPU(layer_idx=0, num_experts=8, top_k=2, hidden_size=size, intermediate_size=size,
                               method=method)
    experts.load_weights(*small)
    hidden = torch.randn(12, size, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(12)])
    w = torch.rand(12, 2, generator=g)
    assert rel_err(experts(hidden, ids, w), reference(small, hidden, ids, w)) < TOLERANCE[method]


def test_weights_of_the_wrong_shape_are_refused(weights):
    gate, up, down = weights
    with pytest.raises(ValueError, match=r"down weights .* expected \(16, 256, 256\)"):
        make_experts().load_weights(gate, up, down[:, :128])


def test_expert_ids_outside_the_layer_are_refused(experts_for):
    hidden, ids, w = routing(3)
    ids[1, 0] = E
    with pytest.raises(ValueError, match="topk_ids"):
        experts_for()(hidden, ids, w)


def test_gpu_experts_outside_the_layer_are_refused():
    with pytest.raises(ValueError, match="gpu_experts"):
        make_experts(gpu_experts=[3, E])


# ------------------------------------------------------------------------------------------ correctness
@pytest.mark.parametrize("tokens", [1, 7, 75])
@pytest.mark.parametrize("method", METHODS)
def test_output_matches_torch_reference_within_the_method_tolerance(weights, experts_for, method, tokens):
    hidden, ids, w = routing(tokens)
    out = experts_for(method)(hidden, ids, w)
    assert out.shape == (tokens, H) and out.dtype == torch.bfloat16
    assert rel_err(out, reference(weights, hidden, ids, w)) < TOLERANCE[method]


def test_more_tokens_than_max_tokens_equal_feeding_them_in_chunks(experts_for):
    experts = experts_for()
    hidden, ids, w = routing(75)
    pieces = [experts(hidden[s:s + MAX_TOKENS], ids[s:s + MAX_TOKENS], w[s:s + MAX_TOKENS])
              for s in range(0, 75, MAX_TOKENS)]
    assert torch.equal(experts(hidden, ids, w), torch.cat(pieces))


@pytest.mark.parametrize("method", METHODS)
def test_expert_id_minus_one_contributes_nothing(weights, experts_for, method):
    hidden, ids, w = routing(40)  # one chunk of 32 and one of 8: both of kt-kernel's code paths
    ids[:, -1] = -1
    ids[2, :] = -1
    out = experts_for(method)(hidden, ids, w)
    assert rel_err(out, reference(weights, hidden, ids, w)) < TOLERANCE[method]
    assert not out[2].any()


def test_output_has_the_dtype_and_device_of_hidden(experts_for):
    hidden, ids, w = routing(3)
    out = experts_for()(hidden.float(), ids.int(), w.double())
    assert out.dtype == torch.float32 and out.device == hidden.device


def test_zero_tokens_give_an_empty_output(experts_for):
    hidden, ids, w = routing(0)
    assert experts_for()(hidden, ids, w).shape == (0, H)


@pytest.mark.parametrize("method", METHODS)
def test_only_kernels_that_read_their_weights_in_place_keep_them(weights, method):
    if method not in available_methods():
        pytest.skip(f"{method} not supported here")
    layer = make_experts(method)
    handed: dict[str, torch.Tensor] = {}
    build = layer._build_kernel

    def capture(prepared, **kwargs):
        handed.update(prepared)
        return build(prepared, **kwargs)

    layer._build_kernel = capture
    layer.load_weights(*(w.clone() for w in weights))
    hidden, ids, w = routing(5)
    before = layer(hidden, ids, w)
    for tensor in handed.values():  # what kt-kernel was loaded from
        tensor.zero_()
    assert (not torch.equal(before, layer(hidden, ids, w))) == reads_in_place(method)
    assert bool(layer._kernel_weights) == reads_in_place(method)  # the others' sources are not kept (FP8: 1 B a weight)


def test_load_weights_copies_so_the_source_tensors_may_change(weights):
    mine = tuple(t.clone() for t in weights)
    experts = loaded(mine)
    hidden, ids, w = routing(4)
    before = experts(hidden, ids, w)
    for t in mine:
        t.zero_()
    assert torch.equal(experts(hidden, ids, w), before)


def test_hot_experts_in_torch_match_all_experts_in_kt_kernel(weights, experts_for):
    hidden, ids, w = routing(20)
    all_cpu = experts_for()(hidden, ids, w)
    split = loaded(weights, gpu_experts=[0, 3, 9], gpu_device="cpu")(hidden, ids, w)
    assert rel_err(split, all_cpu.float()) < 0.01


@pytest.mark.parametrize("method", METHODS)
def test_hot_experts_leave_the_output_within_the_method_tolerance(weights, method):
    if method not in available_methods():
        pytest.skip(f"{method} not supported here")
    hidden, ids, w = routing(40)
    out = loaded(weights, method, gpu_experts=[0, 3, 9], gpu_device="cpu")(hidden, ids, w)
    assert rel_err(out, reference(weights, hidden, ids, w)) < TOLERANCE[method]


def test_llamafile_with_bf16_blocks_is_as_exact_as_bf16(weights):
    if cpu_variant() not in ("amx", "avx512_bf16"):
        pytest.skip(f"kt-kernel's {cpu_variant()} build has no llamafile BF16 path")
    hidden, ids, w = routing(12)
    out = loaded(weights, "LLAMAFILE", llamafile_type="BF16")(hidden, ids, w)
    assert rel_err(out, reference(weights, hidden, ids, w)) < TOLERANCE["BF16"]


def test_llamafile_bf16_blocks_are_refused_by_name_where_the_build_lacks_them():
    out = on_avx2(construction_error("hidden_size=256, intermediate_size=256, method='LLAMAFILE', "
                                     "llamafile_type='BF16'"))
    assert out.startswith("ExpertsUnsupportedError llamafile_type BF16")
    assert "avx2" in out and "Q8_0" in out


def test_unknown_llamafile_block_type_is_refused():
    if "LLAMAFILE" not in available_methods():
        pytest.skip("LLAMAFILE not supported here")
    with pytest.raises(ValueError, match="llamafile_type 'Q4_K'"):
        make_experts("LLAMAFILE", llamafile_type="Q4_K")


def test_llamafile_q8_0_blocks_are_the_ones_gguf_writes(weights):
    gguf = pytest.importorskip("gguf")
    from engines.kt.experts.cpu import _to_ggml_blocks

    gate = weights[0][:2]
    expected = gguf.quants.quantize(gate.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(_to_ggml_blocks(gate, "Q8_0"), torch.from_numpy(expected))


def test_submit_then_sync_equals_forward(experts_for):
    experts = experts_for("AMXINT8" if "AMXINT8" in available_methods() else "BF16")
    hidden, ids, w = routing(40)
    experts.submit(hidden, ids, w)
    assert torch.equal(experts.sync(), experts(hidden, ids, w))


def test_submit_twice_without_sync_is_refused(experts_for):
    experts = experts_for()
    hidden, ids, w = routing(2)
    experts.submit(hidden, ids, w)
    with pytest.raises(RuntimeError, match="before sync"):
        experts.submit(hidden, ids, w)
    experts.sync()


def test_layers_of_one_model_take_turns_with_one_set_of_staging_buffers(weights):
    staging = SharedStaging()
    layers = [loaded(weights, layer_idx=i, staging=staging) for i in range(2)]
    hidden, ids, w = routing(9)
    outputs = [layer(hidden, ids, w) for layer in layers]  # the second overwrites the buffers the first used
    assert torch.equal(outputs[0], outputs[1])
    assert rel_err(outputs[0], reference(weights, hidden, ids, w)) < TOLERANCE["BF16"]
    assert layers[0]._staging_for(9, hidden.device)[0].data_ptr() == layers[1]._staging_for(9, hidden.device)[0].data_ptr()
    other_model = loaded(weights)
    other_model(hidden, ids, w)
    assert other_model._staging_for(9, hidden.device)[0].data_ptr() != layers[0]._staging_for(9, hidden.device)[0].data_ptr()


def test_staging_buffers_grow_for_a_longer_call_and_stay_shared(weights):
    staging = SharedStaging()
    short, long = (loaded(weights, layer_idx=i, staging=staging) for i in range(2))
    short(*routing(3))
    hidden, ids, w = routing(MAX_TOKENS * 2 + 5)  # beyond the chunk the buffers were first sized for
    assert rel_err(long(hidden, ids, w), reference(weights, hidden, ids, w)) < TOLERANCE["BF16"]
    assert torch.equal(short(hidden, ids, w), long(hidden, ids, w))


# ------------------------------------------------------------------ padding up to kt-kernel's matrix kernels
PADDED = ("AMXINT8", "AMXINT4", "BF16")  # the methods with a measured padding default on the amx build


def test_matrix_kernels_take_calls_above_four_times_experts_per_top_k():
    assert matrix_tokens(64, 6) == 43  # DeepSeek-V2-Lite: up to 42 tokens take the vector path
    assert matrix_tokens(256, 8) == 129  # DeepSeek-V3
    assert matrix_tokens(E, K) == 17


def test_padding_starts_at_the_measured_tokens_per_expert_on_the_amx_build_only(monkeypatch):
    monkeypatch.setattr(expert_methods, "cpu_variant", lambda: "amx")
    assert [default_pad_from(m, 64, 6) for m in (*PADDED, "FP8", "RAWINT4", "LLAMAFILE")] == [24, 16, 12, 0, 0, 0]
    assert default_pad_from("AMXINT8", 256, 8) == 72
    monkeypatch.setattr(expert_methods, "cpu_variant", lambda: "avx512_bf16")
    assert [default_pad_from(m, 64, 6) for m in PADDED] == [0, 0, 0]


@pytest.mark.parametrize("method", PADDED)
def test_a_padded_call_gives_the_output_of_the_unpadded_one(weights, method):
    if method not in available_methods() or not pads_to_matrix(method):
        pytest.skip(f"this build's {method} kernel has no matrix switch to pad across")
    padded, plain = loaded(weights, method, pad_from=1), loaded(weights, method, pad_from=0)
    hidden, ids, w = routing(10)
    assert 10 in padded.padded_tokens() and not plain.padded_tokens()
    # measured: AMXINT8 and AMXINT4 equal to the bit, BF16's kernels round apart by up to 0.4%
    assert rel_err(padded(hidden, ids, w), plain(hidden, ids, w).float()) < 0.01
    assert rel_err(padded(hidden, ids, w), reference(weights, hidden, ids, w)) < TOLERANCE[method]


def test_padding_rows_name_no_expert_even_after_a_larger_call(weights):
    layer = loaded(weights, padding_method(), pad_from=1)
    layer(*routing(MAX_TOKENS))  # fills every staged row with real experts
    layer(*routing(5))
    ids = layer._staging_for(5, torch.device("cpu"))[1]
    assert torch.equal(ids[5:matrix_tokens(E, K)], torch.full((matrix_tokens(E, K) - 5, K), -1))


def test_kernels_without_a_matrix_switch_are_never_padded(weights):
    methods = [m for m in available_methods() if not pads_to_matrix(m)]
    if not methods:
        pytest.skip("every method of this build has a matrix switch")
    assert all(not loaded(weights, m, pad_from=1).padded_tokens() for m in methods)


@pytest.mark.parametrize("pad_from", [-1, 1.5, "8", True])
def test_a_padding_start_that_is_not_a_non_negative_integer_is_refused_by_name(weights, pad_from):
    with pytest.raises(ValueError, match=r"pad_from must be an integer >= 0, got "):
        make_experts(pad_from=pad_from)
    hidden, ids, w = routing(3)  # the refusal left nothing half-built behind
    assert rel_err(loaded(weights, pad_from=0)(hidden, ids, w), reference(weights, hidden, ids, w)) < TOLERANCE["BF16"]


def padding_method() -> str:
    method = next((m for m in PADDED if m in available_methods() and pads_to_matrix(m)), None)
    if method is None:
        pytest.skip("no kernel of this build has a matrix switch to pad across")
    return method


def test_a_call_is_padded_only_where_the_staged_rows_reach_the_matrix_kernels():
    method = padding_method()
    # 64 experts, 4 a token: the matrix path starts at 65 tokens, past the 32 rows staged for MAX_TOKENS
    assert make_experts(method, num_experts=64, pad_from=1).padded_tokens() == range(0)
    assert make_experts(method, num_experts=64, pad_from=1, max_tokens=65).padded_tokens() == range(1, 65)


def test_forward_works_from_a_thread_other_than_the_creator(experts_for):
    experts = experts_for()
    hidden, ids, w = routing(9)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("out", experts(hidden, ids, w)))
    worker.start()
    worker.join(timeout=60)
    assert torch.equal(result["out"], experts(hidden, ids, w))


# ---------------------------------------------------------------------------------------- weight cache
QUANTIZED = [m for m in available_methods() if METHODS[m].cacheable]


@pytest.mark.parametrize("method", QUANTIZED)
def test_quantized_weights_round_trip_through_the_cache(weights, tmp_path, method):
    first = make_experts(method, layer_idx=3)
    first.load_weights(*weights, cache_dir=tmp_path)
    second = make_experts(method, layer_idx=3)
    assert second.load_quantized(tmp_path)
    hidden, ids, w = routing(11)
    assert torch.equal(second(hidden, ids, w), first(hidden, ids, w))


@pytest.mark.skipif(not QUANTIZED, reason="no quantized method here")
def test_cache_keeps_the_hot_experts_weights(weights, tmp_path):
    kwargs = {"gpu_experts": [1, 2], "gpu_device": "cpu"}
    first = make_experts(QUANTIZED[0], **kwargs)
    first.load_weights(*weights, cache_dir=tmp_path)
    second = make_experts(QUANTIZED[0], **kwargs)
    assert second.load_quantized(tmp_path)
    hidden, ids, w = routing(11)
    assert torch.equal(second(hidden, ids, w), first(hidden, ids, w))


@pytest.mark.skipif(not QUANTIZED, reason="no quantized method here")
def test_cache_is_not_used_for_another_shape_layer_or_hot_expert_set(weights, tmp_path):
    make_experts(QUANTIZED[0]).load_weights(*weights, cache_dir=tmp_path)
    assert not make_experts(QUANTIZED[0], layer_idx=1).load_quantized(tmp_path)
    assert not make_experts(QUANTIZED[0], num_experts=8).load_quantized(tmp_path)
    assert not make_experts(QUANTIZED[0], gpu_experts=[0]).load_quantized(tmp_path)


@pytest.mark.skipif(not QUANTIZED, reason="no quantized method here")
def test_cache_with_a_missing_file_is_not_used(weights, tmp_path):
    make_experts(QUANTIZED[0]).load_weights(*weights, cache_dir=tmp_path)
    data = [p for p in (tmp_path / "_layer_0").rglob("*") if p.is_file() and p.suffix in (".kt", ".safetensors")]
    data[len(data) // 2].unlink()
    assert not make_experts(QUANTIZED[0]).load_quantized(tmp_path)


def test_bf16_has_nothing_to_cache(weights, tmp_path):
    make_experts("BF16").load_weights(*weights, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert not make_experts("BF16").load_quantized(tmp_path)


def test_loading_kt_kernel_keeps_ieee_subnormals_in_this_thread():
    from engines.kt.experts.cpuinfer import load_ext

    load_ext()
    assert 2.2250738585072014e-308 / 2 != 0.0
