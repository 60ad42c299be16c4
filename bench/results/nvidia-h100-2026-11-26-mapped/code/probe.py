"""Can the GPU read part of a decode step's experts straight out of pinned host memory (zero-copy, UVA) while
kt-kernel reads the rest from DRAM, and how fast do both go together?"""
import ctypes
import json
import sys
import threading
import time

import torch

sys.path.insert(0, ".")
from bench.expert_floor import cold_layers, _inputs  # noqa: E402

HIDDEN, INTER = 2048, 1408
EXPERT_BYTES = 3 * HIDDEN * INTER


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]
_keep = []


@DELETER
def _noop(_):
    pass


def cuda_alias(host: torch.Tensor, device: int = 0) -> torch.Tensor:
    """A CUDA tensor over pinned `host` int8 memory (UVA: the same address is valid on the device)."""
    assert host.dtype == torch.int8 and host.is_contiguous()
    shape = (ctypes.c_int64 * host.dim())(*host.shape)
    m = DLManagedTensor()
    m.dl_tensor = DLTensor(host.data_ptr(), DLDevice(2, device), host.dim(), DLDataType(0, 8, 1), shape, None, 0)
    m.deleter = _noop
    _keep.append((m, shape, host))
    pycapsule_new = ctypes.pythonapi.PyCapsule_New
    pycapsule_new.restype = ctypes.py_object
    pycapsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    cap = pycapsule_new(ctypes.addressof(m), b"dltensor", None)
    return torch.utils.dlpack.from_dlpack(cap)


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 14
    dev = torch.device("cuda")
    L, E = 16, 32
    t0 = time.perf_counter()
    host = torch.empty(L, E, EXPERT_BYTES, dtype=torch.int8).pin_memory()
    host.view(-1)[:: 4096].fill_(1)
    print(json.dumps({"pinned_gb": host.numel() / 1e9, "pin_s": round(time.perf_counter() - t0, 2)}), flush=True)
    alias = cuda_alias(host)
    assert alias.device.type == "cuda"
    # correctness of the alias
    host[3, 5, :16] = torch.arange(16, dtype=torch.int8)
    assert alias[3, 5, :16].cpu().tolist() == list(range(16)), alias[3, 5, :16].cpu()
    g = torch.Generator().manual_seed(0)
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    for k in (1, 3, 6, 16, 32):
        buf = torch.empty(k, EXPERT_BYTES, dtype=torch.int8, device=dev)
        idx = [torch.randperm(E, generator=g)[:k].to(dev) for _ in range(64)]
        # zero-copy gather
        for i in range(4):
            torch.index_select(alias[i % L], 0, idx[i], out=buf)
        torch.cuda.synchronize()
        s, e = ev(), ev()
        s.record()
        for i in range(64):
            torch.index_select(alias[i % L], 0, idx[i], out=buf)
        e.record()
        e.synchronize()
        zc = s.elapsed_time(e) / 64
        # DMA copies of the same experts (host knows the ids)
        ids_host = [i.cpu().tolist() for i in idx]
        s.record()
        for i in range(64):
            for j, x in enumerate(ids_host[i]):
                buf[j].copy_(host[i % L, x], non_blocking=True)
        e.record()
        e.synchronize()
        dma = s.elapsed_time(e) / 64
        print(json.dumps({"experts": k, "MB": round(k * EXPERT_BYTES / 1e6, 1), "zero_copy_ms": round(zc, 3),
                          "zero_copy_GB_s": round(k * EXPERT_BYTES / zc / 1e6, 1), "dma_ms": round(dma, 3),
                          "dma_GB_s": round(k * EXPERT_BYTES / dma / 1e6, 1)}), flush=True)

    # kt-kernel alone, then with the GPU gathering 3 experts a call in a loop
    stack = cold_layers("AMXINT8", 6, threads)
    inputs = _inputs(400, seed=1)
    for x, ids, w in inputs[:8]:
        stack[0].forward(x, ids, w)

    def kt_ms(n=400):
        t = time.perf_counter()
        for i, (x, ids, w) in enumerate(inputs[:n]):
            stack[i % 6].forward(x, ids, w)
        return (time.perf_counter() - t) / n * 1e3

    alone = kt_ms()
    stop = threading.Event()
    count = [0]
    buf3 = torch.empty(3, EXPERT_BYTES, dtype=torch.int8, device=dev)
    idx3 = [torch.randperm(E, generator=g)[:3].to(dev) for _ in range(64)]

    def gpu_loop():
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            while not stop.is_set():
                for i in range(64):
                    torch.index_select(alias[(count[0] + i) % L], 0, idx3[i], out=buf3)
                side.synchronize()
                count[0] += 64

    th = threading.Thread(target=gpu_loop, daemon=True)
    th.start()
    time.sleep(0.3)
    c0, t = count[0], time.perf_counter()
    together = kt_ms()
    gathers = count[0] - c0
    dt = time.perf_counter() - t
    stop.set()
    th.join()
    print(json.dumps({"threads": threads, "kt_alone_ms": round(alone, 3),
                      "kt_alone_GB_s": round(6 * EXPERT_BYTES / alone / 1e6, 1),
                      "kt_with_gpu_reads_ms": round(together, 3),
                      "kt_with_GB_s": round(6 * EXPERT_BYTES / together / 1e6, 1),
                      "gpu_GB_s_meanwhile": round(gathers * 3 * EXPERT_BYTES / dt / 1e9, 1)}), flush=True)


if __name__ == "__main__":
    main()
