"""A DeepSeek-V4 adapter laid out as KT-SFT writes it, and its merged reference.

KT-SFT (LLaMA-Factory with kt-kernel's SFT, `kt_kernel/sft/artifacts.py: save_kt_adapter_artifacts`) leaves in
its output folder:

* `adapter_config.json` + `adapter_model.safetensors` — PEFT's LoRA on the non-expert projections of
  transformers' `DeepseekV4ForCausalLM` (attention `q_a_proj` / `q_b_proj` / `kv_proj` / `o_b_proj`, the
  compressors' `kv_proj` / `gate_proj`, the shared experts), keys
  `base_model.model.model.layers.N.<module>.lora_{A,B}.weight`;
* `fused_expert_lora.safetensors` — the routed experts' LoRA of kt-kernel's `MXFP4_SFT_MOE` wrappers, BF16,
  `layers.N.experts.{gate,up,down}_lora_{a,b}`, A `[E, r, in]`, B `[E, out, r]`;
* `kt_adapter_manifest.json` — version 1, `expert_weight_format: mxfp4`, `base` {the source checkpoint's path and
  kt-kernel's fingerprint of it (`inspect_native_checkpoint`)}, `lora` {rank, alpha}, the non-expert cache and
  native experts it was trained from, and each file's size and SHA-256 (the fused file with its tensor contract).

The fingerprint here is computed by kt-kernel's own `inspect_native_checkpoint`, so the test checks the server
against the binding kt-kernel writes."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch

RANK, ALPHA = 4, 8.0
# Served logprobs with the adapter vs the merged float32 reference: the LoRA'd rows' experts run in kt-kernel's
# MXFP4_SFT_MOE on the released experts, its products in bf16: each layer's expert output 0.54% from float32 torch
# at the median row and 1.0% at the worst (the base MXFP4 kernel: 0.28%). Measured over the 146 positions of
# test_v4_lora's prompt: median 0.0068, max 0.469 (avx512_bf16 build); 0.0045 / 0.145 (avx2). The one position
# past 0.03 is where this tiny random model is most sensitive to its experts' rounding (every router picks the
# reference's experts there); the adapter itself moves the logprobs by up to 2.36.
V4_LORA_MEDIAN_TOLERANCE = 0.02
V4_LORA_TOLERANCE = 0.6
LORA_GAIN = 0.15  # the update's size relative to the weight it changes: moves the logprobs, keeps the model sane
# the modules KT-SFT trains LoRA on for V4 (kt_kernel/sft/export_dsv4_sglang_adapter.py: _TARGET)
TARGETS = re.compile(r"^model\.layers\.\d+\.(?:self_attn\.(?:q_a_proj|q_b_proj|kv_proj|o_b_proj|"
                     r"compressor\.(?:kv_proj|gate_proj))|mlp\.shared_experts\.(?:gate_proj|up_proj|down_proj))$")


def target_linears(model_dir: Path) -> dict[str, tuple[int, int]]:
    """The linears of the V4 model that KT-SFT's PEFT LoRA targets: name -> weight shape [out, in]."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4ForCausalLM

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(AutoConfig.from_pretrained(model_dir))
    return {name: tuple(m.weight.shape) for name, m in model.named_modules() if TARGETS.match(name)}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_kt_sft_v4_adapter(model_dir: Path, out_dir: Path, seed: int, base_path: Path | None = None) -> Path:
    """Write a random V4 adapter in KT-SFT's layout, bound to `base_path` (default: `model_dir`)."""
    from kt_kernel.sft.deepseek_v4 import inspect_native_checkpoint
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    experts, inter, hidden = config["n_routed_experts"], config["moe_intermediate_size"], config["hidden_size"]
    generator = torch.Generator().manual_seed(seed)

    def factor(rows: int, cols: int, batch: tuple[int, ...] = ()) -> torch.Tensor:
        return torch.randn(*batch, rows, cols, generator=generator) * (LORA_GAIN / cols ** 0.5)

    out_dir.mkdir(parents=True, exist_ok=True)
    linears = target_linears(model_dir)
    peft = {}
    for name, (rows, cols) in linears.items():
        peft[f"base_model.model.{name}.lora_A.weight"] = factor(RANK, cols)
        peft[f"base_model.model.{name}.lora_B.weight"] = factor(rows, RANK) * (RANK / ALPHA) ** 0.5
    save_file(peft, str(out_dir / "adapter_model.safetensors"))
    fused = {}
    for layer in range(config["num_hidden_layers"]):
        for proj, (rows, cols) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            fused[f"layers.{layer}.experts.{proj}_lora_a"] = factor(RANK, cols, (experts,)).bfloat16()
            fused[f"layers.{layer}.experts.{proj}_lora_b"] = factor(rows, RANK, (experts,)).bfloat16()
    save_file(fused, str(out_dir / "fused_expert_lora.safetensors"))
    leaves = sorted({name.rpartition(".")[2] for name in linears})
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir), "r": RANK,
        "lora_alpha": ALPHA, "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False,
        "target_modules": leaves, "exclude_modules": ".*\\.mlp\\.experts.*", "fan_in_fan_out": False,
        "inference_mode": True}))
    source = inspect_native_checkpoint(base_path or model_dir)
    artifacts = {name: {"size": (out_dir / name).stat().st_size, "sha256": _sha256(out_dir / name)}
                 for name in ("adapter_config.json", "adapter_model.safetensors", "fused_expert_lora.safetensors")}
    contract = {key: {"shape": list(t.shape), "dtype": "BF16"} for key, t in sorted(fused.items())}
    artifacts["fused_expert_lora.safetensors"].update(tensor_count=len(contract), tensors=contract)
    cache = str(out_dir.parent / "v4-non-expert-cache")
    manifest = {
        "version": 1, "status": "ready", "expert_weight_format": "mxfp4",
        "base": {"model_name_or_path": source["model_name_or_path"], "fingerprint": source["fingerprint"]},
        "lora": {"rank": RANK, "alpha": ALPHA},
        "non_expert_cache": {"path": cache, "fingerprint": "0" * 64},
        "native_experts": {"path": source["model_name_or_path"], "manifest": "kt_non_expert_manifest.json",
                           "manifest_sha256": "0" * 64, "fingerprint": "0" * 64},
        "artifacts": artifacts,
    }
    (out_dir / "kt_adapter_manifest.json").write_text(json.dumps(manifest, indent=2))
    return out_dir


def merged_reference(model_dir: Path, adapter_dir: Path):
    """transformers' DeepseekV4ForCausalLM in float32 on the dequantized weights with the adapter merged:
    W += (alpha / r) B A on every linear, and per routed expert on gate / up / down."""
    from safetensors.torch import load_file

    from .v4_helpers import v4_reference_model

    model = v4_reference_model(model_dir)
    scale = ALPHA / RANK
    peft = load_file(str(adapter_dir / "adapter_model.safetensors"))
    fused = load_file(str(adapter_dir / "fused_expert_lora.safetensors"))
    inter = model.config.moe_intermediate_size
    with torch.no_grad():
        for key, a in peft.items():
            if key.endswith("lora_A.weight"):
                name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = peft[key.replace("lora_A", "lora_B")]
                model.get_submodule(name).weight += scale * (b.float() @ a.float())
        for layer in range(model.config.num_hidden_layers):
            experts = model.get_submodule(f"model.layers.{layer}.mlp.experts")

            def delta(proj: str) -> torch.Tensor:
                a, b = fused[f"layers.{layer}.experts.{proj}_lora_a"], fused[f"layers.{layer}.experts.{proj}_lora_b"]
                return scale * torch.bmm(b.float(), a.float())

            experts.gate_up_proj[:, :inter] += delta("gate")
            experts.gate_up_proj[:, inter:] += delta("up")
            experts.down_proj += delta("down")
    return model.eval()
