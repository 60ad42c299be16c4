"""Which format an adapter path holds, and reading it into a `LoraAdapter` (see the package docstring)."""
from __future__ import annotations

from pathlib import Path

from engines.lora.adapter import AdapterFormatError, LoraAdapter

FORMATS = ("a PEFT directory (adapter_config.json + adapter_model.safetensors or .bin, optionally with "
           "KTransformers' fused_expert_lora.safetensors)", "a GGUF LoRA file (llama.cpp convert_lora_to_gguf)",
           "a directory with only a reward value head (value_head.safetensors)")


def read_adapter(path: str | Path) -> LoraAdapter:
    """Read the adapter at `path`. AdapterFormatError names the problem and, for unknown layouts, the formats."""
    from engines.lora import gguf_format, kt_format, peft_format, value_head

    p = Path(path)
    if not p.exists():
        raise AdapterFormatError(f"adapter path {str(path)!r} does not exist")
    if p.is_file():
        if p.suffix == ".gguf":
            return gguf_format.read(p)
        raise AdapterFormatError(f"{p.name} is not a supported adapter format; supported: {'; '.join(FORMATS)}")
    if (p / "adapter_config.json").is_file():
        adapter = peft_format.read(p)
        kt_format.read_into(adapter, p)
    elif len(ggufs := sorted(p.glob("*.gguf"))) == 1:
        adapter = gguf_format.read(ggufs[0])
    elif value_head.find(p) is not None:
        adapter = LoraAdapter(path=str(p), format="value-head")
    else:
        found = ", ".join(sorted(c.name for c in p.iterdir())[:8]) or "nothing"
        raise AdapterFormatError(f"{p} is not a supported adapter (it holds {found}); supported: {'; '.join(FORMATS)}")
    adapter.value_head = value_head.read(p) if p.is_dir() else None
    if adapter.is_empty():
        raise AdapterFormatError(f"{p} holds no LoRA tensors")
    return adapter
