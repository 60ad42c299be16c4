"""The decode kernel queued on CUDA streams: a call over fixed pinned buffers that a stream starts and awaits in
order with its own work, eagerly or from a captured CUDA graph (engines/kt/experts/cpu.py's stream-ordered path).

Two ways for a stream to start and await a call (src/dk.c, "CUDA stream tasks"):
- **host memory** (the default where the driver takes stream memory operations): the stream writes the task's
  id into a doorbell cell of pinned host memory, which the pool's watcher thread spins on while calls keep
  coming, and waits for the task's done cell, which the call's last worker sets; both are stream memory
  operations (cuStreamWriteValue32 / cuStreamWaitValue32), which CUDA graphs capture as nodes;
- **host functions** (cudaLaunchHostFunc): the driver's callback thread starts the call and blocks until it
  ends, tens of microseconds from the stream to the call and back on each side.
`KTSERVE_DECODE_KERNEL_SIGNALS=callbacks` keeps the host functions (to compare the two in one process);
`signals()` says which one runs and why."""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

import torch

log = logging.getLogger("ktserve.engine.kt")

SIGNALS_ENV = "KTSERVE_DECODE_KERNEL_SIGNALS"  # "memory" (default) or "callbacks"
WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ

_lock = threading.Lock()
_driver: Any = None
_runtime_launch: Any = None
_checked: dict[int, str | None] = {}  # CUDA device index -> None (host memory works) or why not


class _Driver:
    """The CUDA driver's stream memory operations, from the libcuda torch loaded."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, u32, p = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p
        self.write = _first(lib, "cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        self.wait = _first(lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        for f in (self.write, self.wait):
            f.argtypes, f.restype = [p, u64, u32, ctypes.c_uint], ctypes.c_int
        self.device_pointer = _first(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
        self.device_pointer.argtypes = [ctypes.POINTER(u64), p, ctypes.c_uint]
        self.device_pointer.restype = ctypes.c_int

    def address(self, cell: torch.Tensor) -> int:
        """The device address of a pinned host tensor's first element."""
        out = ctypes.c_uint64()
        rc = self.device_pointer(ctypes.byref(out), cell.data_ptr(), 0)
        if rc:
            raise RuntimeError(f"cuMemHostGetDevicePointer failed ({rc})")
        return out.value

    def write_value(self, stream: int, address: int, value: int) -> None:
        rc = self.write(stream, address, value, 0)  # flags 0: a system-scope fence before the write
        if rc:
            raise RuntimeError(f"cuStreamWriteValue32 failed ({rc})")

    def wait_value(self, stream: int, address: int, value: int) -> None:
        rc = self.wait(stream, address, value, WAIT_EQ)
        if rc:
            raise RuntimeError(f"cuStreamWaitValue32 failed ({rc})")


def _first(lib: ctypes.CDLL, *names: str) -> Any:
    for name in names:
        f = getattr(lib, name, None)
        if f is not None:
            return f
    raise AttributeError(f"libcuda has none of {', '.join(names)}")


def _check(device: int) -> str | None:
    """None where a stream of `device` writes and waits on a pinned cell (tried once, outside any capture)."""
    global _driver
    asked = os.environ.get(SIGNALS_ENV, "memory")
    if asked == "callbacks":
        return f"{SIGNALS_ENV}=callbacks"
    if asked != "memory":
        log.warning("%s=%s is neither memory nor callbacks: memory is used", SIGNALS_ENV, asked)
    try:
        if _driver is None:
            _driver = _Driver()
        cell = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        address = _driver.address(cell)
        stream = torch.cuda.Stream(device)
        _driver.write_value(stream.cuda_stream, address, 5)
        _driver.wait_value(stream.cuda_stream, address, 5)
        _driver.write_value(stream.cuda_stream, address, 6)
        stream.synchronize()
        if int(cell.item()) != 6:
            return "a stream's write to pinned host memory was not seen"
    except (OSError, AttributeError, RuntimeError) as exc:
        return f"stream memory operations unavailable ({exc})"
    return None


def signals(device: int | torch.device) -> str:
    """How streams of `device` start and await the kernel's calls: "host memory", or "host functions (why)".
    The first call checks the driver (call it at load, outside any CUDA graph capture)."""
    if not torch.cuda.is_available():
        return "host functions (no CUDA device)"
    index = torch.device(device).index if not isinstance(device, int) else device
    index = torch.cuda.current_device() if index is None else index
    with _lock:
        if index in _checked:
            why = _checked[index]
        else:
            capturing = torch.cuda.is_current_stream_capturing()
            why = "first asked during a CUDA graph capture" if capturing else _check(index)
            if why is not None:
                log.info("decode kernel calls on CUDA streams: host functions (%s)", why)
            if not capturing:
                _checked[index] = why
    return "host memory" if why is None else f"host functions ({why})"


class Doorbells:
    """A pool's doorbells: pinned int32 cells its watcher thread spins on (src/dk.c `dk_pool_watch`, started with
    the first), one for each stream that starts its calls (round robin past the pool's count: streams sharing one
    never overlap calls, since one pool runs one call at a time)."""

    def __init__(self, lib: ctypes.CDLL, pool: int):
        self.cells = torch.zeros(lib.dk_pool_bells(), dtype=torch.int32, pin_memory=True)
        if lib.dk_pool_watch(pool, self.cells.data_ptr()):
            raise RuntimeError("the decode kernel's watcher thread did not start")
        self._of_stream: dict[int, int] = {}  # stream -> the device address of its cell

    def address(self, stream: int) -> int:
        address = self._of_stream.get(stream)  # every eager call asks: the lock only for a stream's first
        if address is None:
            with _lock:
                address = self._of_stream.get(stream)
                if address is None:
                    index = len(self._of_stream) % self.cells.numel()
                    address = self._of_stream[stream] = _driver.address(self.cells[index:])
        return address


class StreamTask:
    """A call queued on CUDA streams: `launch` starts it when the stream reaches it (the row count read from
    `tokens`, an int32 cell, then), `launch_wait` holds the stream until it ends. The buffers are kept; CUDA
    graphs may replay both."""

    def __init__(self, layer: Any, pool: Any, tokens: torch.Tensor, top_k: int, x: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor, out: torch.Tensor):
        lib = layer._lib
        self._keep = (layer, pool, tokens, x, ids, weights, out)
        self._lib, self._pool = lib, pool
        self._handle = lib.dk_task_create(pool.handle, layer.handle, tokens.data_ptr(), top_k, x.data_ptr(),
                                          int(x.dtype == torch.bfloat16), ids.data_ptr(), weights.data_ptr(),
                                          out.data_ptr(), int(out.dtype == torch.bfloat16))
        if not self._handle:
            raise RuntimeError("no memory for a decode kernel stream task")
        self._submit = ctypes.cast(lib.dk_task_submit, ctypes.c_void_p).value
        self._wait = ctypes.cast(lib.dk_task_wait, ctypes.c_void_p).value
        self._id = 0
        self._done: torch.Tensor | None = None
        if signals(torch.cuda.current_device()) == "host memory":  # the buffers are pinned host memory
            self._done = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            self._id = lib.dk_task_bind(self._handle, self._done.data_ptr())
            if self._id <= 0:
                self._id, self._done = 0, None
            else:
                self._done_address = _driver.address(self._done)

    @property
    def through_memory(self) -> bool:
        return self._id > 0

    def launch(self, stream: int) -> None:
        if self._id:
            _driver.write_value(stream, self._pool.doorbells().address(stream), self._id)
        else:
            _launch_host_func(stream, self._submit, self._handle)

    def launch_wait(self, stream: int) -> None:
        if self._id:
            _driver.wait_value(stream, self._done_address, 1)
            _driver.write_value(stream, self._done_address, 0)
        else:
            _launch_host_func(stream, self._wait, self._handle)

    def __del__(self) -> None:
        if getattr(self, "_handle", None):
            self._lib.dk_task_destroy(self._handle)
            self._handle = None


def _launch_host_func(stream: int, fn: int, arg: int) -> None:
    """cudaLaunchHostFunc from the CUDA runtime torch loaded (found in the process's mappings)."""
    global _runtime_launch
    if _runtime_launch is None:
        path = next((line.split()[-1] for line in open("/proc/self/maps") if "libcudart" in line), None)
        if path is None:
            raise RuntimeError("the CUDA runtime is not loaded: no stream to queue the decode kernel on")
        f = ctypes.CDLL(path).cudaLaunchHostFunc
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        f.restype = ctypes.c_int
        _runtime_launch = f
    rc = _runtime_launch(stream, fn, arg)
    if rc:
        raise RuntimeError(f"cudaLaunchHostFunc failed ({rc})")
