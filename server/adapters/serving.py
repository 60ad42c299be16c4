"""Runtime adapter loading: only from inside the configured adapter roots, off the event loop."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

from engines.base import Engine
from server.errors import APIError


def resolve_inside_roots(path: str, roots: list[str]) -> Path:
    """The real path of `path` if it lies inside one of `roots` (after resolving `..` and symlinks); 403
    otherwise, and when no roots are configured at all."""
    if not roots:
        raise APIError(403, "runtime adapter loading is disabled: no adapter roots are configured "
                            "(--adapter-root / adapter_roots)", type="permission_error", param="lora_path")
    if "\x00" in path:  # no file system path holds one; os.path would raise instead of answering
        raise APIError(400, "lora_path must not contain a NUL character", param="lora_path")
    real = Path(os.path.realpath(path))
    for root in roots:
        if real.is_relative_to(os.path.realpath(root)):
            return real
    raise APIError(403, f"lora_path {path!r} is outside the adapter roots this server may load from",
                   type="permission_error", param="lora_path")


class AdapterServing:
    def __init__(self, engine: Engine, roots: list[str]):
        self.engine = engine
        self.roots = roots

    async def load(self, name: str, path: str) -> str:
        real = resolve_inside_roots(path, self.roots)
        info = await asyncio.to_thread(self.engine.load_adapter, name, str(real))
        return f"Success: LoRA adapter '{info.name}' added successfully."

    async def unload(self, name: str) -> str:
        await asyncio.to_thread(self.engine.unload_adapter, name)
        return f"Success: LoRA adapter '{name}' removed successfully."
