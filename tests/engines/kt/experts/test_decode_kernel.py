"""The decode kernel (engines/kt/experts/decode_kernel): every format on every vector half this CPU has against
torch's dequantize-and-matmul in float64, and the same bits for a row whatever the thread count and the other rows;
layers whose down projection is of another ggml format than gate and up (a "Q4_K_M" GGUF's Q4_K / Q6_K) likewise.

Two tolerances. Where a half computes in float, the kernel differs from float64 by float32 rounding only
(relative error of the output's norm < 1e-5). Where it takes MXFP4 / INT4 / Q8_0 / Q4_0 / Q4_K / Q6_K dot products
in int8 (the integer path, dk.quantizes_activations: for the activations by gate's and up's format, for the SwiGLU
output by down's), the activations and the SwiGLU output are rounded per group of 32 to steps of amax / 127; that is
checked twice:
- against torch doing the same rounding (`quantized`) before its float64 matmuls: the integer sums are exact, so
  what is left is float32 rounding of the scales and sums (1e-5), and the odd SwiGLU output within float32
  rounding of a step's midpoint going the other way. x rounds alike both sides (the same float32 operations on
  the same bf16 values); a SwiGLU output that rounds one step apart moves its output row by w x its down column x
  the step, which `one_step` bounds, and two of them are allowed (measured: none in most calls, one in some,
  ~3e-4 of the output). A wrong lane, group, offset or scale is off by tens of percent;
- against torch without it, within INT8_BOUND (see there)."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from engines.checkpoints import mxfp4
from engines.checkpoints.gguf.quants import quantize as quantize_ggml
from engines.kt.experts import decode_kernel as dk
from engines.kt.experts.methods import quantize_fp8_blocks

pytestmark = pytest.mark.skipif(dk.unavailable_reason() is not None, reason=str(dk.unavailable_reason()))

E, H, I, TOP_K, LIMIT = 8, 256, 192, 3, 0.5  # I = 192: FP8's last block of 128 columns is partial, and so is
# the AVX-512 integer path's last chunk of 128 (four groups of 32) in the down projection
I_K = 256  # Q4_K's and Q6_K's rows are whole super-blocks of 256: the intermediate size where down is one
ISAS = list(dk.ISAS)
GGML = ["q8_0", "q4_0", "q4_k", "q6_k"]
# gate/up's format / down's: a Q4_K_M file's pair, and pairs where one side takes the integer path and the other
# the float one (on the integer-path halves), the SwiGLU output passed from one form to the other
MIXED = ["q4_k/q6_k", "q4_k/q8_0", "q4_0/q6_k"]
# The int8 rounding against exact activations. Rounding to the nearest of steps amax / 127 errs by at most half a
# step, uniformly: rms step / sqrt(12) = amax / 440 per element; for the Gaussian rows x here (amax about 2.2 x rms
# over 32) 0.5% of x's norm, and so 0.5% of gate's and up's rms (1.6) before the clamp. The clamp at LIMIT = 0.5,
# which three quarters of up's values pass, removes the error where it holds but shrinks the output more: the
# quarter left unclamped keeps its absolute error, ~3x larger against the output (1.5% measured with x rounded
# alone); the SwiGLU output's own rounding (a heavier-tailed vector) adds 0.3% (measured alone). Measured for
# both: 1.3-1.6% for MXFP4 and INT4; the bound is twice the expected 1.5%. Where x is 8 times larger (the clamp
# test: 97% of up's values clamped) the same reasoning gives ~4% (3.6-3.9% measured), hence twice that.
INT8_BOUND = 0.03
INT8_BOUND_CLAMPED = 0.08


def _weights(seed: int, hidden: int = H, inter: int = I) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(E, *shape, generator=g) * 0.1 for shape in ((inter, hidden), (inter, hidden),
                                                                        (hidden, inter)))


def _stacked(quantize, weights) -> dict[str, torch.Tensor]:
    out = {}
    for m, t in zip(("gate", "up", "down"), weights):
        parts = [quantize(e) for e in t]
        out[m], out[f"{m}_scale"] = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    return out


def _formats(fmt: str) -> tuple[str, str]:
    """"q4_k/q6_k" -> gate/up's and down's format; "q8_0" -> both."""
    return fmt.split("/")[0], fmt.split("/")[-1]


@functools.lru_cache(maxsize=None)  # read-only once made; quantizing is most of these tests' time
def make_layer(fmt: str, seed: int = 0, limit: float = LIMIT, hidden: int = H, inter: int | None = None
               ) -> dk.DecodeLayer:
    """A layer of `fmt` (or "gate_up/down" ggml formats) from random weights; inter: I, or I_K where down is
    Q4_K / Q6_K."""
    if inter is None:
        inter = I if dk.block_values(_formats(fmt)[1]) == 32 else I_K
    weights = _weights(seed, hidden, inter)
    if "/" in fmt or fmt in GGML:  # as a GGUF holds them: ggml blocks written by the gguf package's quantizer
        kinds = [f.upper() for f in (_formats(fmt)[0], _formats(fmt)[0], _formats(fmt)[1])]
        blocks = {m: torch.from_numpy(quantize_ggml(t.numpy(), kind))
                  for m, t, kind in zip(("gate", "up", "down"), weights, kinds)}
        return dk.DecodeLayer.ggml(blocks, tuple(kinds), swiglu_limit=limit)
    if fmt == "mxfp4":
        return dk.DecodeLayer.mxfp4(_stacked(mxfp4.quantize, weights), swiglu_limit=limit)
    if fmt == "fp8":
        return dk.DecodeLayer.fp8(_stacked(quantize_fp8_blocks, weights), swiglu_limit=limit)
    return dk.DecodeLayer.quantize(fmt, *weights, swiglu_limit=limit)


def quantized(v: torch.Tensor, passes: int = 1) -> torch.Tensor:
    """A float32 vector rounded as the integer path rounds it, in float64: per group of 32,
    q = round(v * (127 / amax)) (both float32, ties to even: the kernel's rintf), value q * d with d = amax / 127;
    with two passes (MXFP4), what that leaves, v - q * d rounded once to float32, in steps of d / 256 (saturated to
    int8) is added."""
    g = v.float().view(-1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    q = torch.round(g * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    d = amax / 127
    first = q.double() * d.double()
    if passes == 1:
        return first.view(-1)
    left = (g.double() - first).float()
    step = d / 256
    q2 = torch.round(left * torch.where(step > 0, 1 / step, torch.zeros_like(step))).clamp(-128, 127)
    return (first + q2.double() * step.double()).view(-1)


def _rounding(fmt: str, on: bool = True):
    """x's (or the SwiGLU output's) rounding where `fmt` takes it (and `on`), else none."""
    passes = dk.activation_passes(fmt) if on else 0
    return (lambda v: quantized(v, passes)) if passes else (lambda v: v.double())


def reference(layer: dk.DecodeLayer, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
              int8_activations: bool = False) -> torch.Tensor:
    """The layer in float64; int8_activations: x and the SwiGLU output rounded first (`quantized`) where the
    kernel rounds them (x by gate's and up's format, the SwiGLU output by down's)."""
    gate, up, down = (t.double() for t in layer.dequantized())
    round_x = _rounding(layer.format, int8_activations)
    rounded = _rounding(layer.down_format, int8_activations)
    out = torch.zeros(x.shape[0], layer.hidden, dtype=torch.float64)
    limit = layer.swiglu_limit
    for t in range(x.shape[0]):
        xt = round_x(x[t].float())
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            a, b = gate[e] @ xt, up[e] @ xt
            if limit:  # V4's clamp (transformers' DeepseekV4Experts._apply_gate)
                a, b = a.clamp(max=limit), b.clamp(-limit, limit)
            out[t] += float(w[t, k]) * (down[e] @ rounded((F.silu(a) * b).float()))
    return out


def one_step(layer: dk.DecodeLayer, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> float:
    """The most one SwiGLU output rounded one int8 step the other way can move the output (norm of the change)."""
    gate, up, down = (t.double() for t in layer.dequantized())
    largest = 0.0
    round_x = _rounding(layer.format)
    for t in range(x.shape[0]):
        xt = round_x(x[t].float())
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            a, b = gate[e] @ xt, up[e] @ xt
            if layer.swiglu_limit:
                a, b = a.clamp(max=layer.swiglu_limit), b.clamp(-layer.swiglu_limit, layer.swiglu_limit)
            step = ((F.silu(a) * b).float().view(-1, 32).abs().amax(-1) / 127).double().repeat_interleave(32)
            largest = max(largest, float((down[e].norm(dim=0) * step).max()) * abs(float(w[t, k])))
    return largest


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def check(layer: dk.DecodeLayer, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
          int8_bound: float = INT8_BOUND) -> None:
    """out against torch: within float rounding, or for the integer path as the module docstring says."""
    exact = reference(layer, x.float(), ids, w)
    if not (dk.quantizes_activations(layer.format) or dk.quantizes_activations(layer.down_format)):
        assert rel(out, exact) < 1e-5
        return
    same_rounding = reference(layer, x.float(), ids, w, int8_activations=True)
    steps = one_step(layer, x, ids, w) if dk.quantizes_activations(layer.down_format) else 0.0
    assert rel(out, same_rounding) < 1e-5 + 2 * steps / float(same_rounding.norm())
    assert rel(out, exact) < int8_bound


def _call(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, TOP_K, generator=g)


@pytest.fixture(scope="module")
def pools():
    return {n: dk.DecodePool(n) for n in (1, 2)}


@pytest.fixture(params=ISAS)
def isa(request):
    chosen = dk.isa()
    if not dk.force_isa(request.param):
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    dk.force_isa(chosen)


@pytest.mark.parametrize("fmt", list(dk.FORMATS))
def test_each_format_matches_torch_dequantized_matmul(fmt, isa, pools):
    layer = make_layer(fmt)
    x, ids, w = _call(5, seed=1)
    ids[1, 2] = -1  # an empty slot adds nothing
    check(layer, x, ids, w, layer.forward(x, ids, w, pools[2]))


def test_mxfp4_takes_its_activations_in_two_passes_and_lands_near_float64(isa, pools):
    """MXFP4's weights are the checkpoint's values exactly; where the integer path takes it, the activations and
    the SwiGLU output go in two int8 passes (the second quantizing what the first leaves in steps of 1/256 of the
    first's), so the output is within 1e-4 of float64 where one pass errs by 1.3-1.6% (INT8_BOUND), and within
    2e-5 of the same two roundings in float64 (`quantized`): a flipped second-pass rounding costs 1/65,000 of its
    group's largest value. bf16 rows leave remainders of exactly half a step (ties) that round to 128 and must
    saturate as the bytes do. Measured on the avx2 half, 16 rows, three seeds: 5.3-5.5e-5 against float64,
    1.8-5.7e-6 against the same roundings."""
    layer = make_layer("mxfp4")
    x, ids, w = _call(16, seed=1)
    out = layer.forward(x, ids, w, pools[2])
    if dk.activation_passes("mxfp4") == 0:
        assert rel(out, reference(layer, x.float(), ids, w)) < 1e-5
        return
    assert dk.activation_passes("mxfp4") == 2
    assert rel(out, reference(layer, x.float(), ids, w)) < 1e-4
    assert rel(out, reference(layer, x.float(), ids, w, int8_activations=True)) < 2e-5


@pytest.mark.parametrize("fmt", MIXED)
def test_gate_up_and_down_of_two_ggml_formats_match_torch_dequantized_matmul(fmt, isa, pools):
    layer = make_layer(fmt)
    assert (layer.format, layer.down_format) == _formats(fmt)
    x, ids, w = _call(5, seed=1)
    ids[1, 2] = -1
    check(layer, x, ids, w, layer.forward(x, ids, w, pools[2]))


@pytest.mark.parametrize("fmt", ["mxfp4", "int4", "q8_0", "q4_0"])
def test_sizes_that_end_in_part_of_a_chunk(fmt, isa, pools):
    """96 = 3 groups of 32 and 160 = 5: the integer path's last chunk (4 groups on AVX-512, 2 on AVX2) is partial
    in both projections, its weight bytes and scales read only as far as the row goes."""
    layer = make_layer(fmt, hidden=96, inter=160)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 96, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(3)])
    w = torch.rand(3, TOP_K, generator=g)
    check(layer, x, ids, w, layer.forward(x, ids, w, pools[1]))


@pytest.mark.parametrize("fmt", list(dk.FORMATS) + MIXED)
def test_results_are_bit_identical_with_one_and_two_threads(fmt, isa, pools):
    layer = make_layer(fmt)
    x, ids, w = _call(7, seed=2)
    assert torch.equal(layer.forward(x, ids, w, pools[1]), layer.forward(x, ids, w, pools[2]))


@pytest.mark.parametrize("fmt", list(dk.FORMATS) + MIXED)
def test_a_row_alone_gives_the_bits_it_gives_among_other_rows(fmt, isa, pools):
    layer = make_layer(fmt)
    x, ids, w = _call(16, seed=3)
    ids[5] = ids[4]  # rows sharing every expert, and one naming an expert twice
    ids[6, 1] = ids[6, 0]
    together = layer.forward(x, ids, w, pools[2])
    for t in range(16):
        alone = layer.forward(x[t:t + 1], ids[t:t + 1], w[t:t + 1], pools[2])
        assert torch.equal(alone[0], together[t]), f"row {t}"
    shuffled = torch.randperm(16)
    assert torch.equal(layer.forward(x[shuffled], ids[shuffled], w[shuffled], pools[2]), together[shuffled])


@pytest.mark.parametrize("fmt", GGML)
def test_ggml_blocks_dequantize_as_the_gguf_package_reads_them(fmt):
    import gguf

    blocks = make_layer(fmt).tensors["down"]
    ours = dk.dequantize(fmt, blocks, None)
    theirs = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[fmt.upper()])
    assert torch.equal(ours, torch.from_numpy(theirs).float())


def random_blocks(fmt: str, experts: int, rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """uint8 [experts, rows, row bytes] of random bytes, every code and (Q4_K) every 6-bit scale and min, with
    random fp16 scales in the block's d (and dmin) fields, scaled to weights of about 0.1; one an fp16 subnormal."""
    size, values = dk.GGML_BLOCK_BYTES[fmt], dk.block_values(fmt)
    b = torch.randint(0, 256, (experts, rows, cols // values, size), generator=g, dtype=torch.uint8)
    if fmt == "q8_0":  # -128 and 127 beside each other
        b[..., 2:6] = torch.tensor([0x80, 0x7F, 0x80, 0x00], dtype=torch.uint8)
    if fmt == "q4_0":  # nibbles 0 and 15 beside each other
        b[..., 2:6] = torch.tensor([0xF0, 0x0F, 0xFF, 0x00], dtype=torch.uint8)
    # where the fp16 scales lie, and how large (a value's largest multiple of d is 128, 8, 945 or 4064)
    fields = {"q8_0": ((0, 0.004),), "q4_0": ((0, 0.06),), "q4_k": ((0, 1e-4), (2, 2e-4)), "q6_k": ((208, 2.5e-5),)}
    for offset, scale in fields[fmt]:
        d = (torch.rand(experts, rows, cols // values, generator=g) * scale).half()
        d[:, 0, 0] = 2 ** -20  # an fp16 subnormal
        b[..., offset:offset + 2] = d.view(torch.uint8).view(experts, rows, cols // values, 2)
    return b.view(experts, rows, -1)


@pytest.mark.parametrize("fmt", GGML)
def test_random_ggml_blocks_dequantize_as_the_gguf_package_reads_them(fmt):
    """Every code, Q4_K's every 6-bit scale and min and Q6_K's every int8 scale, random fp16 scales."""
    import gguf

    blocks = random_blocks(fmt, 2, 64, 1024, torch.Generator().manual_seed(9))
    ours = dk.dequantize(fmt, blocks, None)
    theirs = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[fmt.upper()])
    assert torch.equal(ours, torch.from_numpy(theirs).float())


@pytest.mark.parametrize("fmt", GGML)
def test_ggml_blocks_of_every_code_are_read(fmt, isa, pools):
    """Random bytes: every code, and blocks no quantizer of ours writes but a GGUF may hold: Q8_0's -128 (which
    |q| and q + 128 must both carry) beside 127, Q4_0's nibbles 0 and 15 beside each other, Q4_K's and Q6_K's
    every scale; fp16 scales down to a subnormal."""
    hidden, inter = (128, 64) if dk.block_values(fmt) == 32 else (256, 256)
    g = torch.Generator().manual_seed(8)
    blocks = {m: random_blocks(fmt, E, rows, cols, g)
              for m, (rows, cols) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter)))}
    layer = dk.DecodeLayer.ggml(blocks, fmt.upper())
    x = torch.randn(3, hidden, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(3)])
    w = torch.rand(3, TOP_K, generator=g)
    check(layer, x, ids, w, layer.forward(x, ids, w, pools[2]))


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_super_block_formats_refuse_rows_not_a_multiple_of_256(fmt):
    g = torch.Generator().manual_seed(10)
    blocks = {m: random_blocks(fmt, 2, rows, 256, g) for m, rows in (("gate", 128), ("up", 128), ("down", 256))}
    with pytest.raises(ValueError, match=f"{fmt} rows need a multiple of 256 values, got intermediate 128"):
        dk.DecodeLayer.ggml(blocks, fmt.upper())
    tensors = {m: random_blocks(fmt, 2, 256, 256, g) for m in ("gate", "up", "down")}
    with pytest.raises(ValueError, match=f"{fmt} rows need a multiple of 256 values, got hidden 288"):
        dk.DecodeLayer(fmt, 288, 256, tensors)


def test_gate_and_up_of_two_ggml_types_are_refused():
    blocks = {m: make_layer("q4_k").tensors[m] for m in ("gate", "up", "down")}
    with pytest.raises(ValueError, match="gate and up must be of one ggml type, got Q4_K/Q6_K/Q4_K"):
        dk.DecodeLayer.ggml(blocks, ("Q4_K", "Q6_K", "Q4_K"))


def test_the_clamp_changes_the_result_and_matches_the_reference(isa, pools):
    x, ids, w = _call(2, seed=4)
    x = x * 8  # large enough that gate and up pass the limit
    clamped, plain = make_layer("mxfp4", limit=LIMIT), make_layer("mxfp4", limit=0.0)
    a, b = clamped.forward(x, ids, w, pools[2]), plain.forward(x, ids, w, pools[2])
    assert not torch.allclose(a, b)
    check(clamped, x, ids, w, a, INT8_BOUND_CLAMPED)


def test_bf16_output_is_the_float_output_rounded(pools):
    layer = make_layer("int8")
    x, ids, w = _call(3, seed=5)
    f32 = layer.forward(x, ids, w, pools[2])
    assert torch.equal(layer.forward(x, ids, w, pools[2], out_dtype=torch.bfloat16), f32.bfloat16())


def test_rows_without_experts_come_back_zero(pools):
    layer = make_layer("int4")
    x, ids, w = _call(2, seed=6)
    out = layer.forward(x, torch.full_like(ids, -1), w, pools[2])
    assert torch.equal(out, torch.zeros_like(out))


def _wait_for(cell: torch.Tensor, value: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while int(cell[0]) != value and time.monotonic() < deadline:
        time.sleep(0.0002)
    return int(cell[0]) == value


def test_a_doorbell_starts_a_call_whose_done_cell_is_set_when_it_ends():
    """What a CUDA stream does through host memory (streams.py), written here from Python: the task's id into one
    of the pool's doorbells, then the task's done cell read until it is 1 (and reset). The watcher starts the call;
    its results are the blocking call's bits, round after round; a call of no rows is done at once."""
    lib = dk.library()
    layer = make_layer("int8")
    pool = dk.DecodePool(2)
    x, ids, w = _call(3, seed=9)
    x, ids, w = x.contiguous(), ids.to(torch.int64).contiguous(), w.float().contiguous()
    out = torch.zeros(3, H)
    tokens = torch.tensor([3], dtype=torch.int32)
    task = lib.dk_task_create(pool.handle, layer.handle, tokens.data_ptr(), TOP_K, x.data_ptr(), 1, ids.data_ptr(),
                              w.data_ptr(), out.data_ptr(), 0)
    try:
        done = torch.zeros(1, dtype=torch.int32)
        task_id = lib.dk_task_bind(task, done.data_ptr())
        assert task_id > 0
        bells = torch.zeros(lib.dk_pool_bells(), dtype=torch.int32)
        assert lib.dk_pool_watch(pool.handle, bells.data_ptr()) == 0
        expected = layer.forward(x, ids, w, pool)
        for round_, bell in enumerate((0, 3, 0)):
            out.zero_()
            bells[bell] = task_id
            assert _wait_for(done, 1), f"round {round_}: the call never ended"
            assert int(bells[bell]) == 0  # the watcher took the ring
            assert torch.equal(out, expected), round_
            done[0] = 0
        tokens[0] = 0
        bells[1] = task_id
        assert _wait_for(done, 1)
    finally:
        lib.dk_task_destroy(task)
        pool.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_watcher_is_named_and_keeps_off_the_workers_cpus():
    lib = dk.library()
    first = min(os.sched_getaffinity(0))
    pool = dk.DecodePool(1, [first])
    try:
        bells = torch.zeros(lib.dk_pool_bells(), dtype=torch.int32)
        assert lib.dk_pool_watch(pool.handle, bells.data_ptr()) == 0
        deadline, cpus = time.monotonic() + 10, None
        while cpus is None and time.monotonic() < deadline:  # the thread names and places itself as it starts
            for tid in os.listdir("/proc/self/task"):
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() == "ktserve-dk-bell" and first not in os.sched_getaffinity(int(tid)):
                        cpus = os.sched_getaffinity(int(tid))
            time.sleep(0.001)
        assert cpus == os.sched_getaffinity(0) - {first}
    finally:
        pool.close()


def test_the_environment_variable_forces_the_avx2_half():
    code = "from engines.kt.experts import decode_kernel as dk; print(dk.isa())"
    env = {**os.environ, dk.ISA_ENV: "avx2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "avx2", done.stderr


FORCED = """
import sys, torch
from engines.kt.experts import decode_kernel as dk
saved = torch.load(sys.argv[1])
layer = dk.DecodeLayer.ggml(saved["blocks"], saved["types"], swiglu_limit=saved["limit"])
torch.save({"isa": dk.isa(), "out": layer.forward(saved["x"], saved["ids"], saved["w"], dk.DecodePool(1))}, sys.argv[2])
"""


@pytest.mark.parametrize("fmt", ["q4_k/q6_k", "q4_k/q8_0"])
def test_the_forced_avx2_half_computes_super_block_layers_as_the_avx2_half_does_in_process(fmt, tmp_path, pools):
    """KTSERVE_DECODE_KERNEL_ISA=avx2 in a fresh process: the bits of force_isa("avx2") here (the plain AVX2
    half, which takes Q8_0, Q4_K and Q6_K on its integer path)."""
    chosen = dk.isa()
    if not dk.force_isa("avx2"):
        pytest.skip("this CPU has no avx2")
    layer = make_layer(fmt)
    x, ids, w = _call(4, seed=11)
    try:
        here = layer.forward(x, ids, w, pools[1])
    finally:
        dk.force_isa(chosen)
    kinds = tuple(f.upper() for f in (layer.format, layer.format, layer.down_format))
    torch.save({"blocks": {m: layer.tensors[m] for m in ("gate", "up", "down")}, "types": kinds,
                "limit": layer.swiglu_limit, "x": x, "ids": ids, "w": w}, tmp_path / "in.pt")
    env = {**os.environ, dk.ISA_ENV: "avx2"}
    done = subprocess.run([sys.executable, "-c", FORCED, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    there = torch.load(tmp_path / "out.pt")
    assert there["isa"] == "avx2"
    assert torch.equal(there["out"], here)


def test_a_failed_build_names_the_compiler(tmp_path, monkeypatch):
    from engines.kt.experts.decode_kernel import build

    monkeypatch.setattr(build, "candidate_dirs", lambda: [tmp_path])
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(RuntimeError, match="no-such-compiler"):
        build.build()
