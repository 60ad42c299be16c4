"""DeepSeek-V4's cached attention as decode rows run it (engines/kt/families/deepseek_v4/batch.py): `attend`, the
arithmetic of transformers' `eager_attention_forward` over the one shared key-value head with per-head sinks,
without copying that head once per query head (decode rows come with no mask, prompt rows and the indexer's picks
with an additive one); and `csa_row`, a decode row through a CSA layer's compressor and indexer where it closes no
window, against the transformers module."""
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


def _cache_state(layer) -> dict:
    """A V4 CSA cache layer's tensors and counters, by name."""
    out = {"keys": layer.keys, "entry_count": dict(layer.entry_count)}
    for field in ("buffer_kv", "buffer_gate", "compressed_kv", "overlap_kv", "overlap_gate"):
        out.update({f"{field}.{name}": t for name, t in getattr(layer, field).items()})
    return out


def test_a_csa_decode_row_gives_the_compressors_entries_bias_and_cache_state(v4_model_dir):
    """`csa_row` (what decode rows that close no window run) against `DeepseekV4CSACompressor` on a copy of the
    same cache, row after row, while the entries grow past what the indexer keeps (the tiny V4 keeps 4)."""
    import copy

    from transformers import AutoConfig
    from transformers.cache_utils import DynamicCache
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACompressor

    from engines.kt.families.deepseek_v4.batch import closes_no_window, csa_row

    config = AutoConfig.from_pretrained(v4_model_dir)
    layer = config.layer_types.index("compressed_sparse_attention")
    torch.manual_seed(3)
    compressor = DeepseekV4CSACompressor(config).eval()
    with torch.no_grad():
        for name, p in compressor.named_parameters():
            p.copy_(torch.randn_like(p) * (0.05 if "proj" in name else 1.0))
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(1, 48, config.hidden_size, generator=generator)
    q_residual = torch.randn(1, 48, config.q_lora_rank, generator=generator)
    positions = torch.arange(48)[None]
    cache = DynamicCache(config=config)
    cache.update(torch.zeros(1, 1, 9, config.head_dim), torch.zeros(1, 1, 9, config.head_dim), layer)
    with torch.inference_mode():
        compressor(x[:, :9], q_residual[:, :9], positions[:, :9], cache, layer)  # the prompt: 2 entries
        seen = {"no bias": 0, "bias": 0, "closing": 0}
        for p in range(9, 48):
            row = (x[:, p:p + 1], q_residual[:, p:p + 1], positions[:, p:p + 1])
            state = cache.layers[layer]
            if not closes_no_window(compressor, state):
                seen["closing"] += 1
                compressor(*row, cache, layer)
                continue
            reference = copy.deepcopy(cache)
            expected, expected_bias = compressor(*row, reference, layer)
            got, bias = csa_row(compressor, *row, state)
            seen["no bias" if bias is None else "bias"] += 1
            assert torch.equal(got, expected)
            assert torch.equal(bias if bias is not None else torch.zeros_like(expected_bias), expected_bias)
            mine, theirs = _cache_state(state), _cache_state(reference.layers[layer])
            assert mine.keys() == theirs.keys()
            for name in mine:
                a, b = mine[name], theirs[name]
                assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), name
    assert seen["no bias"] and seen["bias"] and seen["closing"], seen
