"""What the ktransformers engine does differently for a GGUF checkpoint (engines/checkpoints/gguf): finding it
(`--model` a .gguf file, the first part of a split set or a folder of them; or KTransformers' `gguf_path` with
`model_path` naming the folder that holds the original config and tokenizer) and reporting how it is stored."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("ktserve.engine.kt")


def open_gguf(model_path: Path, gguf_path: str | None) -> Any:
    """The GGUF checkpoint the settings name, or None when `model_path` holds safetensors."""
    from engines.checkpoints.gguf import GGUFCheckpoint, is_gguf

    if gguf_path:
        return GGUFCheckpoint(gguf_path, hf_dir=model_path)
    if is_gguf(model_path):
        return GGUFCheckpoint(model_path)
    return None


def gguf_details(checkpoint: Any, experts_method: str, dtype: torch.dtype) -> dict[str, str]:
    """The checkpoint's format and each part's storage, logged once and shown in /version."""
    details = {"checkpoint_format": checkpoint.describe(), "checkpoint_storage": checkpoint.storage(experts_method,
                                                                                                    dtype)}
    log.info("checkpoint: %s; %s", details["checkpoint_format"], details["checkpoint_storage"])
    return details
