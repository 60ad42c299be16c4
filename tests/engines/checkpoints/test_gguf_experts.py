"""GGUF routed experts and kt-kernel's llamafile kernel: the quantizers our writer uses produce blocks the gguf
package reads back, each ggml type the method table says the loaded build computes in place is computed as its
dequantized weights (on this machine's build and on the avx2 build), and the others are converted at load."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.helpers import require_kt_kernel
from tests.ops_support import REPO, child_pythonpath

require_kt_kernel()

from engines.checkpoints.gguf.quants import quantize  # noqa: E402
from engines.kt.experts.methods import (LLAMAFILE_IN_PLACE, METHODS, choose_gguf_method,  # noqa: E402
                                       choose_method, cpu_variant, llamafile_computes)

# Relative error of the writer's blocks against the values they quantize (random normal rows): a few times
# under the types' step (measured: Q8_0 0.5%, Q6_K 1.9%, Q5_K 3.7%, Q4_K 7.8%, IQ4_XS 8.9%, BF16 0.2%).
QUANTIZER_BOUNDS = {"Q8_0": 0.01, "Q6_K": 0.03, "Q5_K": 0.05, "Q4_K": 0.1, "IQ4_XS": 0.12, "BF16": 0.005}
# The llamafile kernel quantizes activations to 8 bits: against the dequantized weights its output differed by
# 1.2-2.2% for the types it computes in place (expert_methods.LLAMAFILE_IN_PLACE); 3% leaves room for seeds.
KERNEL_BOUND = 0.03
TYPES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "BF16", "Q4_0", "Q5_0")


@pytest.mark.parametrize("kind", sorted(QUANTIZER_BOUNDS))
def test_the_writer_quantizes_blocks_the_gguf_package_reads_back(kind):
    import gguf

    values = np.random.default_rng(0).normal(0, 0.05, (16, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize(values, kind), gguf.GGMLQuantizationType[kind])
    assert back.shape == values.shape
    assert np.linalg.norm(back - values) / np.linalg.norm(values) < QUANTIZER_BOUNDS[kind]


def kernel_error(kind: str, tokens: int) -> float | None:
    """The llamafile kernel's output on `kind` blocks relative to torch on their dequantized weights; None when
    the layer declines to read them in place."""
    import gguf
    import torch.nn.functional as F

    from engines.kt.experts.cpu import RoutedExpertsCPU

    E, H, I, K = 8, 256, 512, 2
    g = torch.Generator().manual_seed(0)
    shapes = {"gate": (E, I, H), "up": (E, I, H), "down": (E, H, I)}
    blocks = {m: quantize((torch.randn(*s, generator=g) * 0.05).numpy(), kind) for m, s in shapes.items()}
    weights = {m: torch.from_numpy(gguf.quants.dequantize(b, gguf.GGMLQuantizationType[kind])).reshape(shapes[m])
               for m, b in blocks.items()}
    experts = RoutedExpertsCPU(layer_idx=0, num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                               method="LLAMAFILE", max_tokens=64)
    if not experts.load_ggml({m: (torch.from_numpy(np.ascontiguousarray(b)), kind) for m, b in blocks.items()}):
        return None
    x = torch.randn(tokens, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    w = torch.rand(tokens, K, generator=g)
    out = experts(x, ids, w).float()
    h = x.float()[:, None, :, None]  # [T, 1, H, 1] against each token's chosen experts
    gate, up = (weights[m][ids] @ h for m in ("gate", "up"))
    ref = ((weights["down"][ids] @ (F.silu(gate) * up)).squeeze(-1) * w[..., None]).sum(1)
    return float((out - ref).norm() / ref.norm())


def kernel_errors(env: dict[str, str]) -> tuple[str, dict]:
    """(the build, {type: [error at 1 token, at 24 tokens] or None}) from a child process with `env` (another
    kt-kernel build)."""
    code = ("import json\nfrom tests.engines.checkpoints.test_gguf_experts import TYPES, kernel_error\n"
            "from engines.kt.experts.methods import cpu_variant\n"
            "errors = {k: kernel_error(k, 1) for k in TYPES}\n"
            "print(json.dumps([cpu_variant(), {k: None if e is None else [e, kernel_error(k, 24)] "
            "for k, e in errors.items()}]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": child_pythonpath(), **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return tuple(json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("["))))


def check_table(build: str, errors: dict) -> None:
    for kind in TYPES:
        if build in LLAMAFILE_IN_PLACE.get(kind, ()):
            assert errors[kind] is not None and max(errors[kind]) < KERNEL_BOUND, (build, kind, errors[kind])
        else:
            assert errors[kind] is None, (build, kind)


def test_llamafile_reads_in_place_exactly_the_types_the_table_gives_the_loaded_build():
    errors = {}
    for kind in TYPES:
        first = kernel_error(kind, 1)
        errors[kind] = None if first is None else [first, kernel_error(kind, 24)]
    check_table(cpu_variant(), errors)


def test_llamafile_reads_in_place_exactly_the_types_the_table_gives_the_avx2_build():
    build, errors = kernel_errors({"KT_KERNEL_CPU_VARIANT": "avx2"})
    assert build == "avx2"
    check_table(build, errors)


def test_experts_of_in_place_types_run_as_llamafile():
    choice = choose_gguf_method({"Q4_K", "Q6_K"})
    assert choice.method == "LLAMAFILE" and choice.reason == ""


def test_experts_of_a_type_the_build_does_not_compute_are_converted_to_a_4_bit_method_and_say_why():
    assert not llamafile_computes("IQ4_XS")
    choice = choose_gguf_method({"Q4_K", "IQ4_XS"})
    assert METHODS[choice.method].bits == 4 and choice.method != "LLAMAFILE"
    assert "IQ4_XS" in choice.reason and f"converted at load to {choice.method}" in choice.reason


def test_experts_of_too_small_a_model_for_llamafile_are_converted():
    from engines.kt.experts.methods import ExpertShape

    shape = ExpertShape(2048, 1408, 10 ** 9)  # V2-Lite's 1408 is no multiple of 256
    choice = choose_gguf_method({"Q8_0"}, shape=shape)
    # an 8-bit type goes where an 8-bit rule would (AMXINT8, or its replacement on this build)
    assert choice.method == choose_method("AMXINT8", shape=shape).method != "LLAMAFILE"
    assert "multiples of 256" in choice.reason


def test_an_explicit_kt_method_converts_gguf_experts_to_it():
    assert choose_gguf_method({"Q4_K"}, explicit="BF16").method == "BF16"
