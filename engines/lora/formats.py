"""Which format an adapter path holds, and reading it into a `LoraAdapter` (see the package docstring)."""
from __future__ import annotations

import stat
from pathlib import Path

from engines.lora.adapter import AdapterFormatError, LoraAdapter

FORMATS = ("a PEFT directory (adapter_config.json + adapter_model.safetensors or .bin, optionally with "
           "KTransformers' fused_expert_lora.safetensors)", "a GGUF LoRA file (llama.cpp convert_lora_to_gguf)",
           "a directory with only a reward value head (value_head.safetensors)")


def read_adapter(path: str | Path) -> LoraAdapter:
    """Read the adapter at `path`. AdapterFormatError names the problem and, for unknown layouts, the formats.

    Only directories and regular files are opened (a FIFO or a device would block the read, or never end).
    Whatever else goes wrong reading the files — a config that is not a JSON object, a value of the wrong
    type, corrupt tensors — is the adapter's fault and says so, never a server error."""
    try:
        return _read(Path(path))
    except AdapterFormatError:
        raise
    except Exception as exc:  # the parsers' own errors: json, safetensors, pickle, gguf, float("abc"), OSError
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise AdapterFormatError(f"adapter {str(path)[:512]!r} cannot be read: {type(exc).__name__}: "
                                 f"{reason}"[:2000]) from None


def regular_file(path: Path) -> Path:
    """`path`, checked to be a regular file before anything opens it."""
    if not stat.S_ISREG(path.stat().st_mode):
        raise AdapterFormatError(f"{path} is not a regular file")
    return path


def _read(p: Path) -> LoraAdapter:
    from engines.lora import gguf_format, kt_format, peft_format, value_head

    if not p.exists():
        raise AdapterFormatError(f"adapter path {str(p)!r} does not exist")
    if not (p.is_file() or p.is_dir()):
        raise AdapterFormatError(f"adapter path {str(p)!r} is neither a regular file nor a directory")
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
