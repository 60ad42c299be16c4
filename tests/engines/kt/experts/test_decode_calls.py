"""kt_decode_kernel: which calls of a CPU-expert layer our decode kernel computes instead of kt-kernel
(engines/kt/experts/decode_calls.py), on the CPU-only path CI runs.

Tolerances: the kernel's result against kt-kernel's on the same layer (relative error of the norms). Where both
read the same weights (FP8 blocks, RAWINT4 groups, MXFP4) they differ by the activations' rounding: kt-kernel's
bf16 and, where our kernel's half takes four-bit dot products in int8 (decode_kernel.quantizes_activations), ours
(float path: 0.4-1.2%; int8 path on avx512-vnni: MXFP4 1.1-1.3%, RAWINT4 0.7%); LLAMAFILE's Q8_0 blocks (a GGUF's,
or converted at load) and a GGUF's Q4_0 ones by both kernels' int8 activations per 32 (Q8_0 0.27-0.39%, Q4_0
0.25-0.33% at 1 / 5 / 16 tokens, three routings each, on kt-kernel's avx512_bf16 and avx2 builds, ours on
avx512-vnni and avx2 alike); a GGUF's Q4_K and Q6_K blocks (and a "Q4_K_M" layer's Q4_K gate/up with Q6_K down) by
kt-kernel's int8 activations per 256 (ggml's Q8_K) against ours per 32 (and its SwiGLU output's): kt-kernel's
1.7-2.0% from a float64 reference of the same blocks (engines/kt/experts/methods.py measured 1.6-2.2%), ours
1.1-1.4% (0.16%, the bf16 output's rounding, where a half computes them in float), 1.8-2.3% apart (1 / 5 / 16
tokens, three routings, on kt-kernel's avx512_bf16 build, ours on avx512-vnni and avx2 alike), so ours is held to
the reference too; INT8 is quantized per row both
ways (1.8%); INT4 is per 32 ours against kt-kernel's per row (24.9%: kt-kernel's INT4 is itself 24% off the bf16
reference, tests/engines/kt/experts/test_kt_experts_cpu.py)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import require_kt_kernel

require_kt_kernel()

from engines.checkpoints import mxfp4  # noqa: E402
from engines.kt.experts import decode_kernel  # noqa: E402
from engines.kt.experts.cpu import RoutedExpertsCPU, _DecodePending  # noqa: E402
from engines.kt.experts.decode_calls import FORMATS, MAX_ROWS, DecodeKernelPolicy, check_setting  # noqa: E402
from engines.kt.experts.methods import available_methods  # noqa: E402

if decode_kernel.unavailable_reason() is not None:
    pytest.skip(decode_kernel.unavailable_reason(), allow_module_level=True)

E, K, H, I = 16, 4, 256, 256
ROWS = 160  # the layers' max_tokens: past every format's MAX_ROWS, so calls the kernel does not take can be made
AGREEMENT = {"AMXINT8": 0.04, "AMXINT4": 0.35, "FP8": 0.02, "RAWINT4": 0.03, "MXFP4": 0.02, "LLAMAFILE": 0.01}
SUPER_BLOCK_AGREEMENT = 0.04  # LLAMAFILE Q4_K / Q6_K: twice the largest measured (the module docstring)
FLOAT_DOTS = 0.005  # ours against float64 where both compute in float: the bf16 output's rounding (0.16%) and margin
# ours against float64 where our half rounds x and the SwiGLU output to int8 per 32 (Q4_K / Q6_K on the integer path:
# 1.1-1.4% measured, three routings at 1 / 5 / 16 tokens, avx512-vnni and avx2 alike): test_decode_kernel's INT8_BOUND
INT8_DOTS = 0.03


@pytest.fixture(scope="module")
def weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return ((torch.randn(E, I, H, generator=g) / H**0.5).bfloat16(), (torch.randn(E, I, H, generator=g) / H**0.5)
            .bfloat16(), (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16())


def layer(method: str, weights, setting: str = "auto", **policy) -> RoutedExpertsCPU:
    if method not in available_methods():
        pytest.skip(f"{method} not supported by this kt-kernel build")
    experts = RoutedExpertsCPU(layer_idx=0, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                               method=method, max_tokens=ROWS, decode_kernel=DecodeKernelPolicy(setting, **policy))
    experts.load_weights(*weights)
    return experts


def routing(tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    return torch.randn(tokens, H, generator=g).bfloat16(), ids, torch.rand(tokens, K, generator=g)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def released_mxfp4(weights) -> dict[str, torch.Tensor]:
    """The layer's experts as V4 releases them: E2M1 pairs and UE8M0 scales per 32."""
    packed: dict[str, torch.Tensor] = {}
    for m, t in zip(("gate", "up", "down"), weights):
        parts = [mxfp4.quantize(e) for e in t]
        packed[m], packed[f"{m}_scale"] = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    return packed


def submitted(experts: RoutedExpertsCPU, tokens: int) -> type:
    experts.submit(*routing(tokens))
    kind = type(experts._pending)
    experts.sync()
    return kind


@pytest.mark.parametrize("method", sorted(AGREEMENT))
def test_decode_calls_agree_with_kt_kernel_within_the_method_tolerance(weights, method):
    ours, theirs = layer(method, weights), layer(method, weights, "off")
    assert ours.decode_calls is not None and theirs.decode_calls is None
    for tokens in (1, 5, 16, 100):
        hidden, ids, w = routing(tokens)
        assert rel(ours(hidden, ids, w), theirs(hidden, ids, w)) < AGREEMENT[method]


def test_calls_up_to_the_format_s_max_rows_go_to_the_kernel_and_larger_ones_to_kt_kernel(weights):
    experts = layer("AMXINT8", weights)
    rows = MAX_ROWS[FORMATS["AMXINT8"]]
    assert rows == 128 and experts.decode_calls.max_rows == rows
    assert submitted(experts, rows) is _DecodePending
    assert submitted(experts, rows + 1) is not _DecodePending


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4"])
def test_a_load_from_a_weight_cache_serves_decode_calls_as_the_load_that_wrote_it(weights, method, tmp_path):
    if method not in available_methods():
        pytest.skip(f"{method} not supported by this kt-kernel build")

    def loaded(cached: bool) -> RoutedExpertsCPU:
        experts = RoutedExpertsCPU(layer_idx=0, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                                   method=method, max_tokens=ROWS, decode_kernel=DecodeKernelPolicy("auto"))
        if cached:
            assert experts.load_quantized(tmp_path)
        else:
            experts.load_weights(*weights, cache_dir=tmp_path)
        return experts

    first, again = loaded(cached=False), loaded(cached=True)
    assert again.decode_calls is not None and again.decode_calls.own_form
    hidden, ids, w = routing(5)
    assert torch.equal(again(hidden, ids, w), first(hidden, ids, w))


def test_a_weight_cache_whose_decode_kernel_file_is_damaged_loads_with_kt_kernel_serving(weights, tmp_path):
    if "AMXINT8" not in available_methods():
        pytest.skip("AMXINT8 not supported by this kt-kernel build")

    def loaded(setting: str, cached: bool) -> RoutedExpertsCPU:
        experts = RoutedExpertsCPU(layer_idx=0, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                                   method="AMXINT8", max_tokens=ROWS, decode_kernel=DecodeKernelPolicy(setting))
        if cached:
            assert experts.load_quantized(tmp_path)
        else:
            experts.load_weights(*weights, cache_dir=tmp_path)
        return experts

    loaded("auto", cached=False)
    (damaged,) = tmp_path.rglob("ktserve-decode-int8.safetensors")
    damaged.write_bytes(damaged.read_bytes()[:100])  # cut short, as by a full disk
    again, theirs = loaded("auto", cached=True), loaded("off", cached=True)
    assert again.decode_calls is None
    assert "no AMXINT8 weights for the kernel" in again.decode_kernel.details()["decode_kernel"]
    hidden, ids, w = routing(5)
    assert torch.equal(again(hidden, ids, w), theirs(hidden, ids, w))


def test_off_keeps_every_call_on_kt_kernel(weights):
    experts = layer("AMXINT8", weights, "off")
    assert experts.decode_calls is None and submitted(experts, 1) is not _DecodePending
    assert experts.decode_kernel.details() == {"decode_kernel": "off (kt_decode_kernel=off): kt-kernel serves every "
                                                                "call"}


def test_bf16_experts_stay_on_kt_kernel_and_the_details_say_why(weights):
    experts = layer("BF16", weights)
    assert experts.decode_calls is None
    assert "does not compute BF16" in experts.decode_kernel.details()["decode_kernel"]


def test_a_row_gives_the_same_bits_alone_and_among_other_rows(weights):
    experts = layer("AMXINT8", weights)
    hidden, ids, w = routing(9)
    together = experts(hidden, ids, w)
    for row in (0, 4, 8):
        assert torch.equal(experts(hidden[row:row + 1], ids[row:row + 1], w[row:row + 1])[0], together[row])


@pytest.mark.parametrize("method, setting, served", [("MXFP4", "auto", True), ("RAWINT4", "auto", True),
                                                     ("AMXINT4", "auto", True), ("AMXINT8", "auto", True),
                                                     ("FP8", "auto", False), ("FP8", "on", True)])
def test_auto_takes_only_mxfp4_int4_and_int8_layers_whose_output_is_on_a_gpu(weights, method, setting, served):
    """Where a layer's output goes to a GPU, auto serves the formats measured faster served there (AUTO_ON_GPU:
    MXFP4, INT4, INT8) and leaves the others to kt-kernel, saying why; `on` takes them too. (The layer is only built
    here: no GPU is used.)"""
    if method not in available_methods():
        pytest.skip(f"{method} not supported by this kt-kernel build")
    experts = RoutedExpertsCPU(layer_idx=0, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                               method=method, max_tokens=ROWS, out_device="cuda",
                               decode_kernel=DecodeKernelPolicy(setting))
    experts.load_weights(*weights)
    assert (experts.decode_calls is not None) == served
    if not served:
        assert "auto leaves FP8 layers whose output is on a GPU to kt-kernel" in \
            experts.decode_kernel.details()["decode_kernel"]


def test_released_mxfp4_bytes_are_read_as_they_are(weights):
    if "MXFP4" not in available_methods():
        pytest.skip("MXFP4 not supported by this kt-kernel build")
    packed = released_mxfp4(weights)
    ours = RoutedExpertsCPU(layer_idx=0, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, method="MXFP4",
                            max_tokens=32, decode_kernel=DecodeKernelPolicy("auto"))
    ours.load_packed(packed)
    assert ours.decode_calls.kernel.tensors["gate"].data_ptr() == packed["gate"].data_ptr()
    hidden, ids, w = routing(3)
    assert rel(ours(hidden, ids, w), layer("MXFP4", weights, "off")(hidden, ids, w)) < AGREEMENT["MXFP4"]


def test_released_mxfp4_bytes_a_streamer_copies_are_read_from_its_copy_and_cost_no_memory(weights):
    from engines.kt.experts.streaming import ExpertStreamer

    if "MXFP4" not in available_methods():
        pytest.skip("MXFP4 not supported by this kt-kernel build")
    packed = released_mxfp4(weights)
    # a CPU streamer stands in for a GPU's: prompt chunks would stream every expert, so it copies them all
    streamer = ExpertStreamer(torch.device("cpu"))
    ours = RoutedExpertsCPU(layer_idx=0, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, method="MXFP4",
                            max_tokens=32, streamer=streamer, stream_tokens=32,
                            decode_kernel=DecodeKernelPolicy("auto"))
    ours.load_packed(packed)
    copy = streamer.layers[0]
    kernel = ours.decode_calls.kernel.tensors
    assert kernel["gate"].untyped_storage().data_ptr() == copy.gate_up.untyped_storage().data_ptr()
    assert kernel["down_scale"].untyped_storage().data_ptr() == copy.down_scale.untyped_storage().data_ptr()
    assert ours.decode_calls.extra_bytes == 0
    assert "host memory beside" not in ours.decode_kernel.details()["decode_kernel"]
    hidden, ids, w = routing(3)
    assert rel(ours(hidden, ids, w), layer("MXFP4", weights, "off")(hidden, ids, w)) < AGREEMENT["MXFP4"]


def gguf_layer(kind: str, weights, setting: str = "auto") -> tuple[RoutedExpertsCPU, dict[str, torch.Tensor]]:
    """A LLAMAFILE layer loaded from `kind` blocks as a GGUF file holds them (load_ggml), and the blocks; kind
    "Q4_K/Q6_K": gate and up of the first type, down of the second (a "Q4_K_M" file's)."""
    from engines.checkpoints.gguf.quants import quantize

    if "LLAMAFILE" not in available_methods():
        pytest.skip("LLAMAFILE not supported by this kt-kernel build")
    gate_up, down = kind.split("/")[0], kind.split("/")[-1]
    kinds = {"gate": gate_up, "up": gate_up, "down": down}
    blocks = {m: torch.from_numpy(quantize(t.float().numpy(), kinds[m]))
              for m, t in zip(("gate", "up", "down"), weights)}
    experts = RoutedExpertsCPU(layer_idx=0, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                               method="LLAMAFILE", max_tokens=32, decode_kernel=DecodeKernelPolicy(setting))
    assert experts.load_ggml({m: (b, kinds[m]) for m, b in blocks.items()})
    return experts, blocks


def float64_reference(kernel, hidden: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The layer's experts as the kernel's blocks dequantize (no SwiGLU clamp), in float64."""
    import torch.nn.functional as F

    gate, up, down = (t.double() for t in kernel.dequantized())
    out = torch.zeros(hidden.shape[0], kernel.hidden, dtype=torch.float64)
    for r in range(hidden.shape[0]):
        x = hidden[r].double()
        for k in range(ids.shape[1]):
            e = int(ids[r, k])
            out[r] += float(w[r, k]) * (down[e] @ (F.silu(gate[e] @ x) * (up[e] @ x)))
    return out


def dots_bound(kernel) -> float:
    """The bound against float64 for the kernel's half: INT8_DOTS where it rounds activations, else FLOAT_DOTS."""
    rounds = decode_kernel.quantizes_activations(kernel.format) or decode_kernel.quantizes_activations(
        kernel.down_format)
    return INT8_DOTS if rounds else FLOAT_DOTS


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_gguf_blocks_the_kernel_reads_are_read_in_place_and_agree_with_kt_kernels_llamafile(weights, kind):
    ours, blocks = gguf_layer(kind, weights, "on")
    theirs, _ = gguf_layer(kind, weights, "off")
    kernel = ours.decode_calls.kernel
    assert kernel.format == kernel.down_format == kind.lower() and ours.decode_calls.extra_bytes == 0
    assert all(kernel.tensors[m].data_ptr() == blocks[m].data_ptr() for m in blocks)
    assert ours.decode_kernel.details()["decode_kernel"].startswith(
        f"ktserve {decode_kernel.isa()} for calls <= 16 rows (LLAMAFILE {kind})")
    super_blocks = kind in ("Q4_K", "Q6_K")
    for tokens in (1, 5, 16):
        hidden, ids, w = routing(tokens)
        assert submitted(ours, tokens) is _DecodePending
        out = ours(hidden, ids, w)
        assert rel(out, theirs(hidden, ids, w)) < (SUPER_BLOCK_AGREEMENT if super_blocks else AGREEMENT["LLAMAFILE"])
        if super_blocks:
            assert rel(out, float64_reference(kernel, hidden, ids, w)) < dots_bound(kernel)


def test_a_q4_k_m_layer_of_q4_k_gate_up_and_q6_k_down_is_served_in_place_and_agrees_with_kt_kernels_llamafile(
        weights):
    ours, blocks = gguf_layer("Q4_K/Q6_K", weights, "on")
    theirs, _ = gguf_layer("Q4_K/Q6_K", weights, "off")
    kernel = ours.decode_calls.kernel
    assert (kernel.format, kernel.down_format) == ("q4_k", "q6_k") and ours.decode_calls.extra_bytes == 0
    assert ours.decode_kernel.formats[0] == "q4_k/q6_k"
    assert all(kernel.tensors[m].data_ptr() == blocks[m].data_ptr() for m in blocks)
    assert ours.decode_kernel.details()["decode_kernel"].startswith(
        f"ktserve {decode_kernel.isa()} for calls <= 16 rows (LLAMAFILE Q4_K gate/up, Q6_K down)")
    for tokens in (1, 5, 16):
        hidden, ids, w = routing(tokens)
        assert submitted(ours, tokens) is _DecodePending
        out = ours(hidden, ids, w)
        assert rel(out, theirs(hidden, ids, w)) < SUPER_BLOCK_AGREEMENT
        assert rel(out, float64_reference(kernel, hidden, ids, w)) < dots_bound(kernel)


def test_auto_serves_super_block_layers_as_on_does(weights):
    """Q4_K / Q6_K take the kernel's integer path, measured at least as fast as kt-kernel's LLAMAFILE at 1-16
    tokens (decode_calls.py's MAX_ROWS): auto serves a Q4_K_M layer as it serves the other ggml types."""
    experts, _ = gguf_layer("Q4_K/Q6_K", weights)
    assert experts.decode_calls is not None and submitted(experts, 1) is _DecodePending
    assert experts.decode_kernel.details()["decode_kernel"].startswith(
        f"ktserve {decode_kernel.isa()} for calls <= 16 rows (LLAMAFILE Q4_K gate/up, Q6_K down)")


def test_gguf_blocks_of_other_ggml_types_stay_on_kt_kernel_and_the_details_say_why(weights):
    experts, _ = gguf_layer("Q5_K", weights)
    assert experts.decode_calls is None and submitted(experts, 1) is not _DecodePending
    details = experts.decode_kernel.details()["decode_kernel"]
    assert ("does not compute LLAMAFILE experts of ggml type Q5_K (it reads Q8_0, Q4_0, Q4_K, Q6_K blocks)"
            in details), details


def test_a_down_projection_of_a_type_the_kernel_does_not_read_keeps_the_layer_on_kt_kernel(weights):
    experts, _ = gguf_layer("Q4_K/Q5_K", weights)
    assert experts.decode_calls is None
    assert "ggml type Q5_K" in experts.decode_kernel.details()["decode_kernel"]


def test_super_block_rows_not_a_multiple_of_256_stay_on_kt_kernel_and_the_reason_says_so():
    """ggml writes no such rows, but a layer naming them must be refused, not read past its blocks."""
    from types import SimpleNamespace

    fake = SimpleNamespace(method="LLAMAFILE", ggml_types=("Q4_K", "Q4_K", "Q6_K"), hidden_size=256,
                           intermediate_size=160, gpu_experts=None, owned=0, deferred=0)
    why = DecodeKernelPolicy("auto")._structural_reason(fake)
    assert why == "Q6_K rows of 160 values (intermediate size) are not whole blocks of 256; the kernel refuses them"


def test_auto_leaves_layers_whose_copy_passes_the_memory_budget_on_kt_kernel(weights):
    experts = layer("AMXINT8", weights, budget=1000)
    assert experts.decode_calls is None
    assert "past 0.3 of the host memory" in experts.decode_kernel.details()["decode_kernel"]
    assert layer("AMXINT8", weights, "on", budget=1000).decode_calls is not None  # on: whatever the memory


def test_expert_ids_outside_the_layer_are_refused_on_the_kernel_path_too(weights):
    experts = layer("AMXINT8", weights)
    hidden, ids, w = routing(2)
    ids[1, 0] = E
    with pytest.raises(ValueError, match="topk_ids of layer 0"):
        experts(hidden, ids, w)


def test_a_bad_value_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="kt_decode_kernel must be one of auto, on, off"):
        check_setting("fast")
    from server.settings import SettingsError, load_settings

    with pytest.raises(SettingsError, match=r"kt_decode_kernel \(from environment\)"):
        load_settings(None, env={"KTSERVE_KT_DECODE_KERNEL": "fast"})
    assert load_settings(None, env={}).engine_config("m").settings["kt_decode_kernel"] == "auto"


# ------------------------------------------------------------------------------------------- the engine
def _serve(demo_model_dir, setting: str, **overrides):
    from tests.conftest import start_server
    from engines.kt.experts.methods import best_method

    # the CPU-only rules, so that a GPU machine too serves the layers' output on the CPU, where the kernel serves
    return start_server(demo_model_dir, engine="ktransformers", kt_method=best_method(8), kt_decode_kernel=setting,
                        kt_optimize_rule="DeepSeek-CPU.yaml", **overrides)


def _prompt_logprobs(running, ids: list[int]) -> list[float]:
    reply = running.openai().completions.create(model=running.engine.info.id, prompt=ids, max_tokens=0, echo=True,
                                                logprobs=1)
    return reply.choices[0].logprobs.token_logprobs[1:]


@pytest.fixture(scope="module")
def served(demo_model_dir, tokenizer):
    """Prompt logprobs of one text in chunks of 8 tokens (calls the kernel takes), and /version's details, with
    the kernel on (auto) and off."""
    text = ("The river begins in the mountains, where snow melts each spring and feeds a hundred small streams. "
            "They join in the valley, turn the old mills and slow down in the plain. ") * 2
    ids = tokenizer.encode(text)
    out = {}
    for setting in ("auto", "off"):
        running = _serve(demo_model_dir, setting, chunk_size=8)
        try:
            out[setting] = (_prompt_logprobs(running, ids), running.engine.info.details,
                            running.http().get("/version").json())
        finally:
            running.stop()
    return out


def test_the_engine_computes_decode_calls_on_the_kernel_and_version_says_so(served):
    from engines.kt.experts.methods import best_method

    details = served["auto"][1]["decode_kernel"]
    rows = MAX_ROWS[FORMATS[best_method(8)]]
    assert details.startswith(f"ktserve {decode_kernel.isa()} for calls <= {rows} rows ({best_method(8)})"), details
    assert served["auto"][2]["engine_details"]["decode_kernel"] == details


def test_off_keeps_kt_kernel_and_version_says_so(served):
    assert served["off"][1]["decode_kernel"] == "off (kt_decode_kernel=off): kt-kernel serves every call"


def test_logprobs_with_the_kernel_agree_with_kt_kernels(served):
    # the two quantize the 8-bit experts each their own way: measured median 0.025 and at most 0.088 apart on the
    # demo model (whose logprobs lie around -40); kt-kernel's BF16 against transformers' float32: 0.03 median
    ours, theirs = served["auto"][0], served["off"][0]
    diffs = sorted(abs(a - b) for a, b in zip(ours, theirs))
    assert len(diffs) > 40
    assert diffs[len(diffs) // 2] < 0.05 and diffs[-1] < 0.5, (diffs[len(diffs) // 2], diffs[-1])


@pytest.fixture(scope="module")
def gguf_served(tmp_path_factory):
    """The demo model as a GGUF with Q8_0 experts (LLAMAFILE, its blocks read in place): prompt logprobs in chunks
    of 8 tokens and the engine details, with the kernel on (auto) and off."""
    from engines.demo_model import write_demo_gguf
    from tests.conftest import start_server

    if "LLAMAFILE" not in available_methods():
        pytest.skip("LLAMAFILE not supported by this kt-kernel build")
    [path] = write_demo_gguf(tmp_path_factory.mktemp("gguf-q8"), {"experts": "Q8_0"})
    text = ("The river begins in the mountains, where snow melts each spring and feeds a hundred small streams. "
            "They join in the valley, turn the old mills and slow down in the plain. ") * 2
    out = {}
    for setting in ("auto", "off"):
        running = start_server(path, engine="ktransformers", kt_decode_kernel=setting, chunk_size=8)
        try:
            ids = running.engine.tokenizer.encode(text)
            out[setting] = (_prompt_logprobs(running, ids), running.engine.info.details)
        finally:
            running.stop()
    return out


def test_a_gguf_s_q8_0_experts_are_served_by_the_kernel_and_agree_with_kt_kernels_llamafile(gguf_served):
    details = gguf_served["auto"][1]
    assert details["experts_method"] == "LLAMAFILE"
    assert details["decode_kernel"].startswith(f"ktserve {decode_kernel.isa()} for calls <= 16 rows (LLAMAFILE Q8_0)")
    assert gguf_served["off"][1]["decode_kernel"].startswith("off (kt_decode_kernel=off)")
    # both read the same blocks and round the activations to int8 per 32, each its own way: measured median 0.0134,
    # at most 0.051 apart over the 73 positions, on kt-kernel's avx512_bf16 and avx2 builds and our avx512-vnni and
    # avx2 halves alike
    ours, theirs = gguf_served["auto"][0], gguf_served["off"][0]
    diffs = sorted(abs(a - b) for a, b in zip(ours, theirs))
    assert len(diffs) > 40
    assert diffs[len(diffs) // 2] < 0.03 and diffs[-1] < 0.15, (diffs[len(diffs) // 2], diffs[-1])


def test_by_default_v4_decode_calls_read_the_released_mxfp4_experts_on_the_kernel(v4_server):
    details = v4_server.engine.info.details["decode_kernel"]
    assert details.startswith(f"ktserve {decode_kernel.isa()} for calls <= 128 rows (MXFP4)"), details


def test_auto_gives_the_kernel_up_in_every_layer_when_kt_kernel_keeps_some(weights):
    if "AMXINT8" not in available_methods():
        pytest.skip("AMXINT8 not supported by this kt-kernel build")
    policy = DecodeKernelPolicy("auto")
    layers = [RoutedExpertsCPU(layer_idx=i, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, method=m,
                               max_tokens=32, decode_kernel=policy) for i, m in ((1, "AMXINT8"), (2, "BF16"))]
    for experts in layers:
        experts.load_weights(*weights)
    assert layers[0].decode_calls is not None
    details = policy.finish()["decode_kernel"]
    assert layers[0].decode_calls is None and "a step must not mix the two" in details, details


NICE_SCRIPT = """
import json, os, sys, torch
from engines.kt.experts.cpu import RoutedExpertsCPU
from engines.kt.experts.cpuinfer import KT_WORKER_PREFIX, _thread_name
from engines.kt.experts.decode_calls import DecodeKernelPolicy

def nice_of_kt_kernel_workers():
    tids = [int(t) for t in os.listdir("/proc/self/task") if _thread_name(int(t)).startswith(KT_WORKER_PREFIX)]
    return sorted({os.getpriority(os.PRIO_PROCESS, t) for t in tids})

policy = DecodeKernelPolicy("on")
g = torch.Generator().manual_seed(0)
layer = RoutedExpertsCPU(layer_idx=0, num_experts=8, top_k=2, hidden_size=256, intermediate_size=256,
                         method=sys.argv[1], max_tokens=16, decode_kernel=policy)
layer.load_weights(*(torch.randn(8, 256, 256, generator=g).bfloat16() for _ in range(3)))
before = nice_of_kt_kernel_workers()
details = policy.finish()
print(json.dumps({"served": layer.decode_calls is not None, "before": before, "after": nice_of_kt_kernel_workers(),
                  "details": details["decode_kernel"]}))
"""


def test_a_model_the_kernel_serves_gives_kt_kernels_idle_workers_the_lowest_priority():
    """kt-kernel's idle workers spin ~50 ms on the kernel's cores after each call (cpuinfer.yield_idle_spin): once a
    model is loaded with layers the kernel serves, they run at nice 19 (in a child: the change is for good)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from engines.kt.experts.methods import best_method

    repo = Path(__file__).resolve().parents[4]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", NICE_SCRIPT, best_method(8)], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))  # kt-kernel prints too
    assert found["served"], found["details"]
    assert found["before"] == [os.getpriority(os.PRIO_PROCESS, 0)] and found["after"] == [19]
    assert "at nice 19, their idle spin yielding to it" in found["details"]
