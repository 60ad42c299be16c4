"""The tiny DeepSeek-V4 of the tests and its reference: transformers' `DeepseekV4ForCausalLM` in float32 on the
dequantized weights, loaded here independently of the engine's loader (names mapped by kt-kernel's own
`canonical_non_expert_key`, FP8 blocks decoded by kt-kernel's `dequantize_fp8_blocks`)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

# Served logprobs vs the float32 reference: kt-kernel computes the experts with bf16 activations, and the
# served model keeps the non-expert weights in float32 on the CPU.
V4_LOGPROB_TOLERANCE = 0.05


def v4_reference_model(model_dir: Path):
    from kt_kernel.sft.deepseek_v4 import canonical_non_expert_key, dequantize_fp8_blocks
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4ForCausalLM

    from engines.checkpoints.mxfp4 import dequantize

    config = AutoConfig.from_pretrained(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"].values())):
        tensors.update(load_file(str(model_dir / shard)))
    state: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str, int], torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.startswith("mtp.") or name.endswith(".scale"):
            continue
        parts = name.split(".")
        if ".ffn.experts." in name:
            layer, expert, proj = int(parts[1]), int(parts[4]), parts[5]
            experts[(layer, proj, expert)] = dequantize(tensor, tensors[name[:-len("weight")] + "scale"], torch.float32)
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = dequantize_fp8_blocks(tensor, tensors[name[:-len("weight")] + "scale"])
        state[canonical_non_expert_key(name)] = tensor.float() if tensor.is_floating_point() else tensor.long()
    for layer in range(config.num_hidden_layers):
        def stack(proj: str) -> torch.Tensor:
            return torch.stack([experts[(layer, proj, e)] for e in range(config.n_routed_experts)])
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([stack("w1"), stack("w3")], dim=1)
        state[f"model.layers.{layer}.mlp.experts.down_proj"] = stack("w2")
    model = DeepseekV4ForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise AssertionError(f"reference load: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model


def reference_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log-softmax of one full forward pass: row i predicts token i + 1."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)
