"""Which format an adapter path holds, and reading it into a `LoraAdapter` (see the package docstring)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from engines.lora import gguf_format, kt_format, kt_manifest, peft_format, value_head
from engines.lora.adapter import AdapterFormatError, LoraAdapter
from engines.lora.files import AdapterFiles

FORMATS = ("a PEFT directory (adapter_config.json + adapter_model.safetensors or .bin, optionally with "
           "KTransformers' fused_expert_lora.safetensors and KT-SFT's kt_adapter_manifest.json)",
           "a GGUF LoRA file (llama.cpp convert_lora_to_gguf)",
           "a directory with only a reward value head (value_head.safetensors)")


def read_adapter(path: str | Path, roots: Sequence[str | Path] = ()) -> LoraAdapter:
    """Read the adapter at `path`. AdapterFormatError names the problem and, for unknown layouts, the formats.

    Every file the readers open goes through `AdapterFiles`: only regular files (a FIFO or a device would
    block the read, or never end), and with `roots` (runtime loading), only files that resolve inside them —
    a directory inside a root whose files link elsewhere is refused, naming the file. Whatever else goes
    wrong reading the files — a config that is not a JSON object, a value out of range, corrupt or
    non-finite tensors — is the adapter's fault and says so, never a server error."""
    try:
        return _read(Path(path), AdapterFiles(tuple(Path(os.path.realpath(r)) for r in roots)))
    except AdapterFormatError:
        raise
    except Exception as exc:  # the parsers' own errors: json, safetensors, pickle, gguf, OSError
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise AdapterFormatError(f"adapter {str(path)[:512]!r} cannot be read: {type(exc).__name__}: "
                                 f"{reason}"[:2000]) from None


def _read(p: Path, files: AdapterFiles) -> LoraAdapter:
    if not p.exists():
        raise AdapterFormatError(f"adapter path {str(p)!r} does not exist")
    if not (p.is_file() or p.is_dir()):
        raise AdapterFormatError(f"adapter path {str(p)!r} is neither a regular file nor a directory")
    if p.is_file():
        if p.suffix == ".gguf":
            return gguf_format.read(p, files)
        raise AdapterFormatError(f"{p.name} is not a supported adapter format; supported: {'; '.join(FORMATS)}")
    if files.has(p / "adapter_config.json"):
        binding = kt_manifest.read(p, files)
        adapter = peft_format.read(p, files)
        adapter.binding = binding
        kt_format.read_into(adapter, p, files)
    elif len(ggufs := sorted(p.glob("*.gguf"))) == 1:
        adapter = gguf_format.read(ggufs[0], files)
    elif value_head.find(p, files) is not None:
        adapter = LoraAdapter(path=str(p), format="value-head")
    else:
        found = ", ".join(sorted(c.name for c in p.iterdir())[:8]) or "nothing"
        raise AdapterFormatError(f"{p} is not a supported adapter (it holds {found}); supported: {'; '.join(FORMATS)}")
    adapter.value_head = value_head.read(p, files)
    if adapter.is_empty():
        raise AdapterFormatError(f"{p} holds no LoRA tensors")
    return adapter
