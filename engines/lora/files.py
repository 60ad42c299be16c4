"""How an adapter's files are opened: resolved, and refused unless they are regular files where the server
may read (engines/lora/formats.py: read_adapter says why)."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from engines.lora.adapter import AdapterFormatError


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    """The one way an adapter's files are opened: `open_path()` resolves a file (symlinks included) and
    refuses it unless it is a regular file inside `roots` (any place when there are none)."""

    roots: tuple[Path, ...] = ()

    def has(self, path: Path) -> bool:
        """Whether `path` is there at all — a link or a FIFO too, so that `open_path()` refuses it by name
        rather than the reader skipping it."""
        return os.path.lexists(path)

    def open_path(self, path: Path) -> Path:
        real = Path(os.path.realpath(path))
        if self.roots and not any(real.is_relative_to(root) for root in self.roots):
            raise AdapterFormatError(f"{path} links outside the adapter roots this server may load from")
        if not stat.S_ISREG(real.stat().st_mode):
            raise AdapterFormatError(f"{path} is not a regular file")
        return real
