"""What the ktransformers engine does differently for a GGUF checkpoint (engines/checkpoints/gguf): finding it
(`--model` a .gguf file, the first part of a split set or a folder of them; or KTransformers' `gguf_path` with
`model_path` naming the folder that holds the original config and tokenizer). The GGUFCheckpoint is then the
loader's checkpoint source, as SafetensorsSource is for a Hugging Face folder."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def open_gguf(model_path: Path, gguf_path: str | None) -> Any:
    """The GGUF checkpoint the settings name, or None when `model_path` holds safetensors."""
    from engines.checkpoints.gguf import GGUFCheckpoint, is_gguf

    if gguf_path:
        return GGUFCheckpoint(gguf_path, hf_dir=model_path)
    if is_gguf(model_path):
        return GGUFCheckpoint(model_path)
    return None

