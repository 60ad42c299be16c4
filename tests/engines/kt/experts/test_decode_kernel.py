"""The decode kernel (engines/kt/experts/decode_kernel): every format on both vector halves against torch's
dequantize-and-matmul in float64, and the same bits for a row whatever the thread count and the other rows."""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engines.checkpoints import mxfp4
from engines.kt.experts import decode_kernel as dk
from engines.kt.experts.methods import quantize_fp8_blocks

pytestmark = pytest.mark.skipif(dk.unavailable_reason() is not None, reason=str(dk.unavailable_reason()))

E, H, I, TOP_K, LIMIT = 8, 256, 192, 3, 0.5  # I = 192: FP8's last block of 128 columns is partial
ISAS = ["avx512", "avx2"]


def _weights(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(E, *shape, generator=g) * 0.1 for shape in ((I, H), (I, H), (H, I)))


def _stacked(quantize, weights) -> dict[str, torch.Tensor]:
    out = {}
    for m, t in zip(("gate", "up", "down"), weights):
        parts = [quantize(e) for e in t]
        out[m], out[f"{m}_scale"] = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    return out


@functools.lru_cache(maxsize=None)  # read-only once made; quantizing is most of these tests' time
def make_layer(fmt: str, seed: int = 0, limit: float = LIMIT) -> dk.DecodeLayer:
    weights = _weights(seed)
    if fmt == "mxfp4":
        return dk.DecodeLayer.mxfp4(_stacked(mxfp4.quantize, weights), swiglu_limit=limit)
    if fmt == "fp8":
        return dk.DecodeLayer.fp8(_stacked(quantize_fp8_blocks, weights), swiglu_limit=limit)
    return dk.DecodeLayer.quantize(fmt, *weights, swiglu_limit=limit)


def reference(layer: dk.DecodeLayer, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up, down = (t.double() for t in layer.dequantized())
    out = torch.zeros(x.shape[0], layer.hidden, dtype=torch.float64)
    limit = layer.swiglu_limit
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            a, b = gate[e] @ x[t].double(), up[e] @ x[t].double()
            if limit:  # V4's clamp (transformers' DeepseekV4Experts._apply_gate)
                a, b = a.clamp(max=limit), b.clamp(-limit, limit)
            out[t] += float(w[t, k]) * (down[e] @ (F.silu(a) * b))
    return out


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
    if not dk.force_isa(request.param):
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    dk.force_isa("avx512") or dk.force_isa("avx2")


@pytest.mark.parametrize("fmt", list(dk.FORMATS))
def test_each_format_matches_torch_dequantized_matmul(fmt, isa, pools):
    layer = make_layer(fmt)
    x, ids, w = _call(5, seed=1)
    ids[1, 2] = -1  # an empty slot adds nothing
    out = layer.forward(x, ids, w, pools[2])
    ref = reference(layer, x.float(), ids, w)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("fmt", list(dk.FORMATS))
def test_results_are_bit_identical_with_one_and_two_threads(fmt, isa, pools):
    layer = make_layer(fmt)
    x, ids, w = _call(7, seed=2)
    assert torch.equal(layer.forward(x, ids, w, pools[1]), layer.forward(x, ids, w, pools[2]))


@pytest.mark.parametrize("fmt", list(dk.FORMATS))
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


def test_the_clamp_changes_the_result_and_matches_the_reference(isa, pools):
    x, ids, w = _call(2, seed=4)
    x = x * 8  # large enough that gate and up pass the limit
    clamped, plain = make_layer("mxfp4", limit=LIMIT), make_layer("mxfp4", limit=0.0)
    a, b = clamped.forward(x, ids, w, pools[2]), plain.forward(x, ids, w, pools[2])
    assert not torch.allclose(a, b)
    ref = reference(clamped, x.float(), ids, w)
    assert float((a.double() - ref).norm() / ref.norm()) < 1e-5


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


def test_the_environment_variable_forces_the_avx2_half():
    code = "from engines.kt.experts import decode_kernel as dk; print(dk.isa())"
    env = {**os.environ, dk.ISA_ENV: "avx2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "avx2", done.stderr


def test_a_failed_build_names_the_compiler(tmp_path, monkeypatch):
    from engines.kt.experts.decode_kernel import build

    monkeypatch.setattr(build, "candidate_dirs", lambda: [tmp_path])
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(RuntimeError, match="no-such-compiler"):
        build.build()
