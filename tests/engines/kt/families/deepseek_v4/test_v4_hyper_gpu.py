"""DeepSeek-V4's fused hyper-connection kernel (engines/kt/families/deepseek_v4/hyper.py) against transformers'
`DeepseekV4HyperConnection` and `DeepseekV4HyperHead` at V4-Flash's shape (hidden 4096, 4 streams, the config's
20 Sinkhorn iterations), random weights, bf16 streams. Run on a GPU machine (pytest -m gpu); on a CPU with Triton
installed, `TRITON_INTERPRET=1 pytest -m gpu tests/engines/kt/families/deepseek_v4/test_v4_hyper_gpu.py` runs the same
kernel in Triton's interpreter (the smaller row counts only: it is slow).

Tolerances, measured in the interpreter against transformers and a float64 evaluation of the same formulas (7 rows):
transformers' own float32 result is off the float64 one by up to 1.8e-6 (post) and 7.7e-6 (comb) relative, the
kernel's by 2.7e-6 and 1.1e-5 (the projection sums the un-normed streams, then scales); over this file's inputs
the two agree to 5.6e-6 (post) and 1.7e-5 (comb). The collapse is summed in float32 as transformers does and,
cast to bf16 with round-to-nearest as the GPU does, differs from it by one ulp where the rounding of `pre` tips it
(25 of 28,672 values); the interpreter's own bf16 cast does not round to nearest and differs in about half of
them, by one ulp."""
from __future__ import annotations

import os

import pytest
import torch

from engines.kt.experts.mapped import triton_available

INTERPRETED = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETED) or not triton_available(),
                                 reason="needs a CUDA device and Triton (or TRITON_INTERPRET=1 with Triton)")]

# CUDA graphs and the installer (modules on a CUDA device) are not for the interpreter
ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device, not Triton's interpreter")
ROWS = (1, 7) if INTERPRETED else (1, 7, 2048)
PROBABILITIES = {"rtol": 5e-5, "atol": 1e-6}  # post and comb, float32: ~3x the largest difference measured
COLLAPSE = {"rtol": 2**-7, "atol": 1e-4}  # one bf16 ulp, and pre's float32 rounding where the streams cancel


@pytest.fixture(scope="module")
def config():
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    return DeepseekV4Config(hidden_size=4096)  # V4-Flash's; hc_mult, hc_sinkhorn_iters, eps: the defaults


def _randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The module with random weights on DEVICE: a projection giving mixes of a few units (as trained ones do),
    biases and scales around their trained sizes."""
    generator = torch.Generator().manual_seed(seed)
    fn, base, scale = module.parameters()
    with torch.no_grad():
        fn.copy_(torch.randn(fn.shape, generator=generator) * 0.02)
        base.copy_(torch.randn(base.shape, generator=generator) * 0.5)
        scale.copy_(torch.rand(scale.shape, generator=generator) * 1.5 + 0.5)
    return module.to(DEVICE).eval()


@pytest.fixture(scope="module")
def connection(config):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    return _randomized(DeepseekV4HyperConnection(config), 0)


@pytest.fixture(scope="module")
def head(config):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    return _randomized(DeepseekV4HyperHead(config), 1)


def _streams(config, rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, rows, config.hc_mult, config.hidden_size, generator=generator).bfloat16().to(DEVICE)


def _ulps(served: torch.Tensor, expected: torch.Tensor) -> str:
    differs = served != expected
    largest = (served.float() - expected.float()).abs().max()
    return f"{int(differs.sum())} of {differs.numel()} differ, max |d| {largest:.3g}"


@pytest.mark.parametrize("rows", ROWS)
@torch.inference_mode()
def test_the_fused_hyper_connection_gives_transformers_post_comb_and_collapse(config, connection, rows):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    from engines.kt.families.deepseek_v4.hyper import fused_connection

    streams = _streams(config, rows, rows)
    expected = DeepseekV4HyperConnection.forward(connection, streams)
    served = fused_connection(connection, streams)
    for name, got, want in zip(("post", "comb", "collapsed"), served, expected):
        assert (got.shape, got.dtype, got.device) == (want.shape, want.dtype, want.device), name
    post, comb, collapsed = served
    print(f"\nrows {rows}: post max rel {((post - expected[0]).abs() / expected[0].abs()).max():.3g}, comb max rel "
          f"{((comb - expected[1]).abs() / expected[1].abs()).max():.3g}, collapsed {_ulps(collapsed, expected[2])}")
    torch.testing.assert_close(post, expected[0], **PROBABILITIES)
    torch.testing.assert_close(comb, expected[1], **PROBABILITIES)
    torch.testing.assert_close(collapsed, expected[2], **COLLAPSE)


@pytest.mark.parametrize("rows", ROWS)
@torch.inference_mode()
def test_the_fused_hyper_head_gives_transformers_collapse(config, head, rows):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    from engines.kt.families.deepseek_v4.hyper import fused_head

    streams = _streams(config, rows, 100 + rows)
    expected = DeepseekV4HyperHead.forward(head, streams)
    served = fused_head(head, streams)
    assert (served.shape, served.dtype, served.device) == (expected.shape, expected.dtype, expected.device)
    print(f"\nrows {rows}: head collapse {_ulps(served, expected)}")
    torch.testing.assert_close(served, expected, **COLLAPSE)


@ON_CUDA
@torch.inference_mode()
def test_the_fused_hyper_connection_replays_from_a_cuda_graph_with_new_streams(config, connection):
    from engines.kt.families.deepseek_v4.hyper import fused_connection

    streams = _streams(config, 4, 0)
    fused_connection(connection, streams)  # compiled before the capture, as the step graphs' warm-up does
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_connection(connection, streams)
    fresh = _streams(config, 4, 1)
    streams.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, fused_connection(connection, fresh)):
        assert torch.equal(got, want)


def _gpu_and_cpu_modules(config) -> torch.nn.ModuleDict:
    """A hyper-connection on the GPU and a hyper head on the CPU (keys other than nn.Module's `cpu` / `cuda`)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

    return torch.nn.ModuleDict({"on_gpu": _randomized(DeepseekV4HyperConnection(config), 2),
                                 "on_cpu": _randomized(DeepseekV4HyperHead(config), 3).cpu()})


@ON_CUDA
def test_the_installer_gives_the_gpu_modules_the_kernel(config):
    from engines.kt.families.deepseek_v4.hyper import install_fused_hyper_connections, is_fused

    model = _gpu_and_cpu_modules(config)
    described = install_fused_hyper_connections(model, torch.bfloat16)
    assert described == ("fused Triton kernel: 1 of 2 hyper-connection modules (those on a GPU); the others keep "
                         "transformers' forward"), described
    assert is_fused(model["on_gpu"]) and not is_fused(model["on_cpu"])


@ON_CUDA
def test_a_kernel_that_fails_to_build_leaves_transformers_forward(config, monkeypatch):
    from engines.kt.families.deepseek_v4 import hyper

    def broken():
        raise RuntimeError("no compiler")

    monkeypatch.setattr(hyper, "_kernel", broken)
    model = _gpu_and_cpu_modules(config)
    described = hyper.install_fused_hyper_connections(model, torch.bfloat16)
    assert described == "transformers' modules: the Triton kernel failed (RuntimeError)"
    assert not hyper.is_fused(model["on_gpu"])
    post, comb, collapsed = model["on_gpu"](_streams(config, 1, 0))  # transformers' forward
    assert comb.shape == (1, 1, config.hc_mult, config.hc_mult)
