"""Which format a checkpoint path holds, and the source that reads it (engines/checkpoints/source.py: the contract
and safetensors; gguf/: GGUF files)."""
from __future__ import annotations

from pathlib import Path

from engines.checkpoints.gguf import GGUFCheckpoint, is_gguf
from engines.checkpoints.source import CheckpointSource, SafetensorsSource


def open_source(path: str | Path, gguf_path: str | Path | None = None) -> CheckpointSource:
    """The checkpoint `path` names, as a source: a GGUF checkpoint (a .gguf file, the first part of a split set, a
    folder of them; or KTransformers' `gguf_path`, `path` then naming the folder of the original config and
    tokenizer) as `GGUFCheckpoint`, else the safetensors folder as `SafetensorsSource`. The one place that tells
    the formats apart."""
    if gguf_path:
        return GGUFCheckpoint(gguf_path, hf_dir=path)
    if is_gguf(path):
        return GGUFCheckpoint(path)
    return SafetensorsSource(path)
