"""The adapters of one engine: loading (off the engine thread), use counts, and unloading once the
requests using an adapter are done. New requests for an adapter being unloaded are refused at once."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from engines.base import AdapterInfo, InvalidRequestError, NotFoundError
from engines.lora.adapter import LoraAdapter, ValueHead
from engines.lora.formats import read_adapter
from engines.lora.install import LoraModules


@dataclass
class _Entry:
    info: AdapterInfo
    adapter: LoraAdapter
    nbytes: int
    in_flight: int = 0
    unloading: bool = False


class AdapterManager:
    """`run_on_engine(fn)` runs fn on the engine thread between steps and returns its result."""

    def __init__(self, modules: LoraModules, run_on_engine: Callable[[Callable[[], Any]], Any], base_id: str):
        self.modules = modules
        self._run_on_engine = run_on_engine
        self._base_id = base_id
        self._lock = threading.Lock()
        self._visible: dict[str, _Entry] = {}
        self._busy_names: set[str] = set()  # loading, or unloaded while still in use
        self._draining: dict[str, _Entry] = {}  # unloaded, waiting for their last requests

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [e.info for e in self._visible.values()]

    def memory_bytes(self, name: str) -> int:
        with self._lock:
            return self._visible[name].nbytes

    def load(self, name: str, path: str, roots: Sequence[str] = ()) -> AdapterInfo:
        """Read, check and install an adapter (its files confined to `roots` when given). Blocking; call it
        off the event loop."""
        if not name or name == self._base_id:
            raise InvalidRequestError(f"an adapter cannot be named {name!r}", param="lora_name")
        with self._lock:
            if name in self._visible or name in self._busy_names:
                raise InvalidRequestError(f"an adapter named {name!r} is already loaded; unload it first",
                                          param="lora_name")
            self._busy_names.add(name)
        try:
            adapter = read_adapter(path, roots)
            prepared = self.modules.prepare(adapter)
            self._run_on_engine(lambda: self.modules.install(name, prepared))
            info = AdapterInfo(name=name, path=str(path), created=int(time.time()), size_bytes=prepared.nbytes,
                               expert_lora=prepared.expert_lora)
            with self._lock:
                self._visible[name] = _Entry(info, adapter, prepared.nbytes)
            return info
        finally:
            with self._lock:
                self._busy_names.discard(name)

    def unload(self, name: str) -> None:
        with self._lock:
            entry = self._visible.pop(name, None)
            if entry is None:
                raise NotFoundError(f"adapter {name!r} is not loaded", param="lora_name")
            entry.unloading = True
            if entry.in_flight:
                self._busy_names.add(name)  # the name stays taken until the last request ends
                self._draining[name] = entry
                return
        self._run_on_engine(lambda: self.modules.remove(name))

    def acquire(self, name: str) -> LoraAdapter:
        """Count a request that uses `name` (NotFoundError when it is not loaded or being unloaded)."""
        with self._lock:
            entry = self._visible.get(name)
            if entry is None:
                raise NotFoundError(f"adapter {name!r} is not loaded", param="model")
            entry.in_flight += 1
            return entry.adapter

    def release(self, name: str) -> None:
        """A request that used `name` has ended; the last one of an unloaded adapter removes it."""
        with self._lock:
            entry = self._visible.get(name) or self._draining.get(name)
            if entry is None:
                return
            entry.in_flight -= 1
            if not (entry.unloading and entry.in_flight == 0):
                return
            self._draining.pop(name, None)
            self._busy_names.discard(name)
        self._run_on_engine(lambda: self.modules.remove(name))

    def value_head(self, name: str) -> ValueHead | None:
        with self._lock:
            entry = self._visible.get(name)
        return None if entry is None else entry.adapter.value_head
