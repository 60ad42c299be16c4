"""DeepSeek-V4's attention over its one shared key-value head with per-head sinks (engines/kt/families/deepseek_v4/
batch.py `attend`): the arithmetic of transformers' `eager_attention_forward`, without copying the key-value head
once per query head. Decode rows come with no mask (the cache holds only the window's positions), prompt rows and
the indexer's picks with an additive one."""
from __future__ import annotations

import types

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,keys,masked", [(1, 40, False), (1, 40, True), (7, 50, True)])
def test_v4_attention_equals_transformers_eager_attention(dtype, rows, keys, masked):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

    from engines.kt.families.deepseek_v4.batch import attend

    generator = torch.Generator().manual_seed(rows * keys)
    heads, dim = 4, 16
    q = torch.randn(1, heads, rows, dim, generator=generator).to(dtype)
    kv = torch.randn(1, 1, keys, dim, generator=generator).to(dtype)
    sinks = torch.randn(heads, generator=generator)  # float32 in the checkpoint, as transformers keeps them
    mask = None
    if masked:
        mask = torch.zeros(1, 1, rows, keys, dtype=dtype)
        mask[..., 1::3] = float("-inf")
    module = types.SimpleNamespace(num_key_value_groups=heads, sinks=sinks, training=False)
    expected, _ = eager_attention_forward(module, q, kv, kv, mask, scaling=dim ** -0.5)
    got = attend(q, kv, mask, dim ** -0.5, sinks)
    assert got.dtype == expected.dtype and got.shape == expected.shape == (1, rows, heads, dim)
    assert torch.equal(got, expected)
