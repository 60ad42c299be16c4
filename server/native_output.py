"""What native code prints to the process's stdout, routed through logging.

kt-kernel's C++ writes its own lines straight to file descriptor 1 while the model loads (`CPUInfer[...]:
Hello`, `TP MOE layer 1, pool ...`, `online quant from bf16`), landing between the structured log lines
and breaking a JSON log. Python's `sys.stdout` never sees them, so they are caught at the descriptor:
while `stdout_to_log()` is active, fd 1 is a pipe whose lines become debug records of `ktserve.native`.
The log handler writes to stderr, so nothing it writes comes back through the pipe."""
from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

log = logging.getLogger("ktserve.native")

_lock = threading.Lock()
_active = 0  # nested or concurrent users share one capture; the first in sets it up, the last out ends it
_restore: tuple[int, threading.Thread] | None = None


@contextmanager
def stdout_to_log() -> Iterator[None]:
    _begin()
    try:
        yield
    finally:
        _end()


def _begin() -> None:
    global _active, _restore
    with _lock:
        _active += 1
        if _active > 1:
            return
        _flush()
        saved = os.dup(1)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 1)
        os.close(write_end)
        reader = threading.Thread(target=_forward, args=(read_end,), name="native-stdout", daemon=True)
        reader.start()
        _restore = (saved, reader)


def _end() -> None:
    global _active, _restore
    with _lock:
        _active -= 1
        if _active > 0 or _restore is None:
            return
        saved, reader = _restore
        _restore = None
        _flush()
        os.dup2(saved, 1)  # the pipe's last write end closes: the reader sees the end and stops
        os.close(saved)
    reader.join(timeout=5)


def _flush() -> None:
    """Push out what Python and C stdio still buffer, so it lands on the side of the switch it was written."""
    sys.stdout.flush()
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to ask (not Linux/macOS): only Python's buffer mattered
        pass


def _forward(read_end: int) -> None:
    with os.fdopen(read_end, "rb") as pipe:
        for raw in pipe:
            line = raw.decode("utf-8", errors="replace").rstrip()
            if line:
                log.debug("%s", line)
