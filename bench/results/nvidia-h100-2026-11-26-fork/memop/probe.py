"""Probe: kt-kernel started and awaited through stream memory operations (the GPU writes a flag, a host thread
runs the task and writes another, the GPU waits on it) against kt-kernel's stream API (two host callbacks).
V2-Lite AMXINT8 layers, batch 1, every expert in kt-kernel. Prints JSON."""
import ctypes
import json
import sys
import threading
import time

import faulthandler

import numpy as np
import torch

faulthandler.dump_traceback_later(int(sys.argv[2]) if len(sys.argv) > 2 else 100, exit=True)


def say(*a):
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)

from bench.expert_floor import HIDDEN, TOP_K
from bench.mapped_experts import _calls, _layers
from engines.kt.expert_streaming import ExpertStreamers

cu = ctypes.CDLL("libcuda.so.1")
WRITE, WAIT = cu.cuStreamWriteValue32_v2, cu.cuStreamWaitValue32_v2
for f in (WRITE, WAIT):
    f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    f.restype = ctypes.c_int
EQ = 0x1
L, R, TOKENS = 6, int(sys.argv[1]) if len(sys.argv) > 1 else 40, 1


def ok(rc):
    if rc != 0:
        raise RuntimeError(f"CUresult {rc}")


def host_int32(n):
    t = torch.zeros(n, dtype=torch.int32, pin_memory=True)
    return t, np.ctypeslib.as_array(ctypes.cast(t.data_ptr(), ctypes.POINTER(ctypes.c_int32)), shape=(n,))


layers = _layers("AMXINT8", L, ExpertStreamers(decode_from_host=False), None)
pool = layers[0]._pool
calls = _calls(TOKENS, L, seed=1)
result = {}

# A: the stream API, eager and captured
def a_step():
    return [layer(*call) for layer, call in zip(layers, calls)]

say("layers built")
for _ in range(3):
    ref = a_step()
say("A warm")
torch.cuda.synchronize()
ref = [o.float().cpu() for o in ref]
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(R):
    a_step()
e.record(); e.synchronize()
result["stream_api_eager_ms_per_layer"] = round(s.elapsed_time(e) / R / L, 4)
say(result)
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    a_step()
side.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    a_out = a_step()
for _ in range(3):
    g.replay()
torch.cuda.synchronize()
s.record()
for _ in range(R):
    g.replay()
e.record(); e.synchronize()
result["stream_api_graph_ms_per_layer"] = round(s.elapsed_time(e) / R / L, 4)
say(result)

# B: stream memory operations and a host thread
go_t, go = host_int32(L)
done_t, done = host_int32(L)
pin = lambda shape, dt: torch.zeros(*shape, dtype=dt, pin_memory=True)
xs = [pin((TOKENS, HIDDEN), torch.bfloat16) for _ in range(L)]
ids = [pin((TOKENS, TOP_K), torch.int64) for _ in range(L)]
ws = [pin((TOKENS, TOP_K), torch.float32) for _ in range(L)]
outs = [pin((TOKENS, HIDDEN), torch.bfloat16) for _ in range(L)]
size = pin((1,), torch.int32); size[0] = TOKENS
dev_out = [torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device="cuda") for _ in range(L)]


def b_step():
    stream = torch.cuda.current_stream().cuda_stream
    for i, (x, i_, w) in enumerate(calls):
        xs[i].copy_(x, non_blocking=True); ids[i].copy_(i_, non_blocking=True); ws[i].copy_(w, non_blocking=True)
        ok(WRITE(stream, go_t.data_ptr() + 4 * i, 1, 0))
        ok(WAIT(stream, done_t.data_ptr() + 4 * i, 1, EQ))
        ok(WRITE(stream, done_t.data_ptr() + 4 * i, 0, 0))
        dev_out[i].copy_(outs[i], non_blocking=True)


seen = []


def poller(steps):
    for _ in range(steps):
        for i in range(L):
            t0 = time.perf_counter()
            while go[i] == 0:
                if time.perf_counter() - t0 > 10:
                    raise RuntimeError("no go flag in 10 s")
            go[i] = 0
            if not seen:
                seen.append(1)
                say("first go seen")
            layer = layers[i]
            pool.submit(layer._kernel.forward_task(size.data_ptr(), TOP_K, ids[i].data_ptr(), ws[i].data_ptr(),
                                                   xs[i].data_ptr(), outs[i].data_ptr(), False))
            pool.sync()
            done[i] = 1


def run_b(launch, steps):
    th = threading.Thread(target=poller, args=(steps,))
    s.record()
    for _ in range(steps):
        launch()
    th.start()
    e.record()
    e.synchronize()
    th.join()
    return s.elapsed_time(e) / steps / L


say("B start")
run_b(b_step, 3)
say("B warm done")
torch.cuda.synchronize()
got = [o.float().cpu() for o in dev_out]
result["memop_matches"] = all(torch.allclose(a, b, atol=1e-2, rtol=1e-2) for a, b in zip(got, ref))
result["memop_eager_ms_per_layer_incl_launch"] = round(run_b(b_step, R), 4)
try:
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        b_step()
    result["memop_graph_ms_per_layer"] = round(run_b(g2.replay, R), 4)
    torch.cuda.synchronize()
    result["memop_graph_matches"] = all(torch.allclose(a.float().cpu(), b, atol=1e-2, rtol=1e-2)
                                        for a, b in zip(dev_out, ref))
except Exception as exc:  # capture unsupported?
    result["memop_graph_error"] = repr(exc)[:300]
print(json.dumps(result), flush=True)
