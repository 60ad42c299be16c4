"""LoRA adapters: every supported file format is read into one in-memory form, `LoraAdapter`.

Formats (`read_adapter(path)` tells them apart; anything else is refused with the list below):

* **PEFT directory** — `adapter_config.json` plus `adapter_model.safetensors` (or `adapter_model.bin`).
  Keys may carry PEFT's `base_model.model.` prefix, an adapter-name segment (`lora_A.default.weight`) and
  KTransformers' `.orig_module` segment. LoRA on any linear: attention (`q_proj`, `q_a_proj`, `q_b_proj`,
  `kv_a_proj_with_mqa`, `kv_b_proj`, `o_proj`), dense MLP, shared experts, the router (`mlp.gate`, which
  PEFT >= 0.18 targets as the parameter `gate.weight`), and the routed experts either per expert
  (`mlp.experts.{j}.gate_proj`, transformers 4 layout) or as PEFT `target_parameters` on the fused
  `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` (saved as `mlp.experts[.base_layer].lora_{A,B}.weight`
  with A `[E*r, in]`, B `[out, r*E]`; which parameter a tensor belongs to is told by its shapes). The scale
  is `lora_alpha / r` (`/ sqrt(r)` with `use_rslora`), with `alpha_pattern` honoured; r comes from the shapes.
* **KTransformers fused-expert LoRA** — `fused_expert_lora.safetensors` beside the PEFT files, keys
  `layers.{i}.experts.{gate,up,down}_lora_{a,b}`, A `[E, r, in]`, B `[E, out, r]`, scale `lora_alpha / r`
  from the directory's `adapter_config.json` (kt-kernel's SFT scaling). KT-SFT's `kt_adapter_manifest.json`
  beside them (engines/lora/kt_manifest.py) binds the adapter to the checkpoint it was trained on: its files'
  hashes are checked when read, its base checkpoint when installed (a mismatch is refused naming both).
* **GGUF LoRA** — a `.gguf` file as llama.cpp's `convert_lora_to_gguf.py` writes it (`general.type` =
  adapter, tensors `blk.N.<llama.cpp name>.weight.lora_{a,b}`, scale `adapter.lora.alpha / r`), or a
  directory holding exactly one such file.
* **Value head** (reward models, LLaMA-Factory) — `value_head.safetensors` (or `value_head.bin`) with
  `v_head.summary.weight` `[1, H]` and `v_head.summary.bias` `[1]`, in the adapter directory.

Module names in the in-memory form are the transformers model's own (`model.layers.3.self_attn.q_a_proj`).
"""
from engines.lora.adapter import ExpertLora, LoraAdapter, LoraWeight, ValueHead
from engines.lora.formats import read_adapter

__all__ = ["ExpertLora", "LoraAdapter", "LoraWeight", "ValueHead", "read_adapter"]
