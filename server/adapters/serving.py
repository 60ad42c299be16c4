"""Runtime adapter loading: only from inside the configured adapter roots, off the event loop, within a
time limit."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from pathlib import Path

from engines.base import Engine, NotFoundError
from server.errors import APIError

log = logging.getLogger("ktserve.server")

# Reading an adapter is disk-bound (seconds for a large one). Past this, the client gets an answer and the
# load is abandoned: if it still finishes, the adapter is unloaded again.
LOAD_TIMEOUT_SECONDS = 300.0


def resolve_inside_roots(path: str, roots: list[str]) -> Path:
    """The real path of `path` if it lies inside one of `roots` (after resolving `..` and symlinks); 403
    otherwise, and when no roots are configured at all."""
    if not roots:
        raise APIError(403, "runtime adapter loading is disabled: no adapter roots are configured "
                            "(--adapter-root / adapter_roots)", type="permission_error", param="lora_path")
    if "\x00" in path:  # no file system path holds one; os.path would raise instead of answering
        raise APIError(400, "lora_path must not contain a NUL character", param="lora_path")
    try:
        real = Path(os.path.realpath(path))
    except OSError as exc:  # e.g. a symlink loop on some platforms
        raise APIError(400, f"lora_path cannot be resolved: {exc.strerror}", param="lora_path") from None
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
        future = self._load_in_background(name, str(real))
        try:
            info = await asyncio.wait_for(asyncio.wrap_future(future), LOAD_TIMEOUT_SECONDS)
        except TimeoutError:
            future.add_done_callback(lambda f: self._unload_abandoned(name, f))
            raise APIError(408, f"loading the adapter did not finish within {LOAD_TIMEOUT_SECONDS:g} seconds; "
                                "nothing was loaded", type="timeout_error", param="lora_path",
                           code="adapter_load_timeout") from None
        return f"Success: LoRA adapter '{info.name}' added successfully."

    def _load_in_background(self, name: str, path: str) -> concurrent.futures.Future:
        """`engine.load_adapter` on a daemon thread: one stuck in the file system cannot hold up the
        process's exit, as a thread of asyncio's default executor would (they are joined at exit)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # a timed-out waiter cannot cancel it; it still reports its end

        def run() -> None:
            try:
                future.set_result(self.engine.load_adapter(name, path, self.roots))
            except BaseException as exc:  # handed to the waiting request
                future.set_exception(exc)

        threading.Thread(target=run, name=f"adapter-load-{name[:32]}", daemon=True).start()
        return future

    def _unload_abandoned(self, name: str, future: concurrent.futures.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        try:
            self.engine.unload_adapter(name)
            log.warning("adapter %s finished loading after its request had timed out; unloaded it", name)
        except NotFoundError:
            pass

    async def unload(self, name: str) -> str:
        await asyncio.to_thread(self.engine.unload_adapter, name)
        return f"Success: LoRA adapter '{name}' removed successfully."
