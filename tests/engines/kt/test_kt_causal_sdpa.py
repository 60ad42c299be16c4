"""engines.kt.families.deepseek_mla.attention.causal_sdpa, the torch backend's attention over a prompt chunk: the last n of L
positions attend over all L causally, in float32 like torch's math kernel, through the fused kernels."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.kt.families.deepseek_mla.attention import causal_sdpa

HEADS, QK, V = 4, 48, 32  # the demo model's MLA: nope 32 + rope 16, values 32


def chunk(n: int, length: int, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(HEADS, rows, QK, generator=g).to(device, dtype) for rows in (n, length))
    v = torch.randn(HEADS, length, V, generator=g).to(device, dtype)
    return q, k, v


def visible(q, k):
    """[n, L]: query i (position L - n + i) sees positions 0..L - n + i."""
    n, length = q.shape[1], k.shape[1]
    return torch.arange(length, device=q.device).unsqueeze(0) <= torch.arange(length - n, length,
                                                                              device=q.device).unsqueeze(1)


def reference(q, k, v, scale):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=visible(q, k), scale=scale)


@pytest.mark.parametrize("n,length", [(7, 7), (64, 64), (5, 130), (128, 300), (1, 40)])
def test_a_chunk_attends_like_float32_masked_attention(n, length):
    q, k, v = chunk(n, length)
    out = causal_sdpa(q, k, v, QK ** -0.5)
    assert out.shape == (HEADS, n, V) and out.dtype == torch.bfloat16
    # one bf16 rounding of the float32 result: within half a step of the exact value (|out| < 4 here)
    assert (out.double() - reference(q, k, v, QK ** -0.5)).abs().max() <= 2 ** -8 * 4


def test_a_query_never_sees_a_later_position():
    n, length = 16, 80
    q, k, v = chunk(n, length, dtype=torch.float32)
    poisoned = v.clone()
    poisoned[:, -1] = 1e4  # only the chunk's last query may see the last position
    out = causal_sdpa(q, k, poisoned, QK ** -0.5)
    assert torch.allclose(out[:, :-1], causal_sdpa(q, k, v, QK ** -0.5)[:, :-1], atol=1e-5)
    assert out[:, -1].abs().max() > 1


def test_the_scale_is_the_one_given():
    q, k, v = chunk(32, 32, dtype=torch.float32)
    assert torch.allclose(causal_sdpa(q, k, v, 0.05), reference(q, k, v, 0.05).float(), atol=1e-5)
    assert not torch.allclose(causal_sdpa(q, k, v, 0.05), causal_sdpa(q, k, v, 0.5), atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n,length", [(9, 9), (300, 300), (17, 300), (2048, 2048)])
def test_on_the_gpu_a_chunk_is_as_exact_as_the_math_kernel(n, length):
    """On a GPU another fused kernel runs (memory-efficient attention in float32): as exact as torch's math
    kernel on the same bf16 inputs, which is what the torch backend ran before."""
    q, k, v = chunk(n, length, device="cuda")
    exact = reference(q, k, v, QK ** -0.5)
    math = F.scaled_dot_product_attention(q, k, v, attn_mask=visible(q, k), scale=QK ** -0.5)  # 3-d: the math kernel
    err = (causal_sdpa(q, k, v, QK ** -0.5).double() - exact).abs().mean()
    assert err <= (math.double() - exact).abs().mean() * 1.05
