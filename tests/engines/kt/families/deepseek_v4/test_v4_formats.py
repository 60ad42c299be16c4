"""DeepSeek-V4's released formats: MXFP4 experts (engines/checkpoints/mxfp4.py, kt-kernel's MXFP4 method with
SwiGLU clamping), the released tensor names, and the tiny V4 that `ktserve make-demo-model --arch deepseek_v4`
writes in that layout."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from engines.checkpoints import mxfp4
from tests.helpers import require_kt_kernel
from .v4_helpers import shard_tensors


def test_mxfp4_round_trips_values_it_can_represent():
    codes = torch.tensor(mxfp4.E2M1_VALUES)
    row = torch.cat([codes, -codes, codes.flip(0), -codes.flip(0)]) * 4.0  # one group of 32: one power of two
    packed, scale = mxfp4.quantize(row[None])
    assert packed.shape == (1, 16) and scale.shape == (1, 1)
    assert torch.equal(mxfp4.dequantize(packed, scale, torch.float32), row[None])


def test_mxfp4_quantization_error_stays_within_half_a_step():
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    packed, scale = mxfp4.quantize(weight)
    error = (mxfp4.dequantize(packed, scale, torch.float32) - weight).abs()
    step = mxfp4.ue8m0_to_float(scale).repeat_interleave(mxfp4.GROUP, dim=1)  # E2M1's widest gap is 2 units
    assert bool((error <= step + 1e-6).all())


def test_mxfp4_rejects_a_scale_of_the_wrong_shape():
    with pytest.raises(ValueError, match="scale has shape"):
        mxfp4.dequantize(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))


def test_kt_kernel_mxfp4_experts_compute_the_clamped_swiglu_of_the_released_weights():
    require_kt_kernel()
    from engines.kt.experts.cpu import RoutedExpertsCPU

    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, limit = 4, 128, 64, 2.0
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    packed: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, (n, k) in shapes.items():
        parts = [mxfp4.quantize(torch.randn(n, k, generator=gen) * k ** -0.5) for _ in range(experts)]
        packed[name] = torch.stack([p for p, _ in parts]).view(torch.int8)
        packed[f"{name}_scale"] = torch.stack([s for _, s in parts]).view(torch.float8_e8m0fnu)
        dense[name] = torch.stack([mxfp4.dequantize(p, s, torch.float32) for p, s in parts])
    layer = RoutedExpertsCPU(layer_idx=0, num_experts=experts, top_k=2, hidden_size=hidden, intermediate_size=inter,
                             method="MXFP4", threads=1, swiglu_limit=limit)
    layer.load_packed(packed)
    x = torch.randn(3, hidden, generator=gen) * 4  # large enough that the clamp acts
    ids, weights = torch.tensor([[0, 1], [2, 3], [1, 3]]), torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.2, 0.8]])
    expected = torch.zeros(3, hidden)
    for t in range(3):
        for k in range(2):
            e = int(ids[t, k])
            gate, up = (x[t] @ dense["gate"][e].T).clamp(max=limit), (x[t] @ dense["up"][e].T).clamp(-limit, limit)
            expected[t] += weights[t, k] * (F.silu(gate) * up) @ dense["down"][e].T
    served = layer(x.bfloat16(), ids, weights).float()
    assert (served - expected).abs().max() < 0.02 * expected.abs().max()


def test_released_names_map_as_kt_kernel_maps_them(v4_model_dir):
    from kt_kernel.sft.deepseek_v4 import canonical_non_expert_key

    from engines.kt.families.deepseek_v4.names import EXPERT, module_name

    names = [n for n in shard_tensors(v4_model_dir) if not n.startswith("mtp.") and not EXPERT.match(n)
             and not n.endswith(".scale")]
    assert names and all(module_name(n) == canonical_non_expert_key(n) for n in names)


def test_demo_v4_is_written_in_the_released_layout(v4_model_dir):
    config = json.loads((v4_model_dir / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4"
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                                  "scale_fmt": "ue8m0", "activation_scheme": "dynamic"}
    tensors = shard_tensors(v4_model_dir)
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    assert tensors["layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert tensors["layers.1.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert tensors["layers.1.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert tuple(tensors["layers.1.ffn.experts.0.w1.weight"].shape) == (inter, hidden // 2)
    assert tuple(tensors["layers.1.ffn.experts.0.w2.scale"].shape) == (hidden, inter // 32)
    assert tensors["layers.0.hc_attn_fn"].dtype == torch.float32 and tensors["hc_head_fn"].dtype == torch.float32
    hashed = [f"layers.{i}.ffn.gate.tid2eid" for i in range(config["num_hash_layers"])]
    assert all(tensors[name].shape == (config["vocab_size"], config["num_experts_per_tok"]) for name in hashed)
    assert any(n.startswith("mtp.0.ffn.experts.") for n in tensors) and "embed.weight" in tensors
