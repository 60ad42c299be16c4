"""Triton probe: a decode step's experts [0, m) computed on the GPU straight from pinned host memory."""
import json
import sys
import threading
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
sys.path.insert(0, "scratch/zc")
from probe import cuda_alias  # noqa: E402
from bench.expert_floor import cold_layers, _inputs  # noqa: E402
from engines.kt.expert_streaming import HostExperts  # noqa: E402


@triton.jit
def _gate_up(x_ptr, ids_ptr, w_ptr, s_ptr, h_ptr, B, M, H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
             BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, K_P: tl.constexpr):
    e = tl.program_id(0)
    rb = tl.program_id(1)
    b = tl.arange(0, BLOCK_B)
    k = tl.arange(0, K_P)
    ids = tl.load(ids_ptr + b[:, None] * K + k[None, :], mask=(b[:, None] < B) & (k[None, :] < K), other=-1)
    sel = tl.sum((ids == e).to(tl.int32), axis=1) > 0
    if tl.max(sel.to(tl.int32), axis=0) == 0:
        return
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    base = w_ptr + e.to(tl.int64) * (2 * I * H)
    acc_g = tl.zeros((BLOCK_B, BLOCK_R), tl.float32)
    acc_u = tl.zeros((BLOCK_B, BLOCK_R), tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        xb = tl.load(x_ptr + b[:, None] * H + hh[None, :], mask=sel[:, None], other=0.0)
        wg = tl.load(base + r[:, None] * H + hh[None, :]).to(tl.bfloat16)
        wu = tl.load(base + (I + r[:, None]) * H + hh[None, :]).to(tl.bfloat16)
        acc_g += tl.dot(xb, tl.trans(wg))
        acc_u += tl.dot(xb, tl.trans(wu))
    sg = tl.load(s_ptr + e * (2 * I) + r)
    su = tl.load(s_ptr + e * (2 * I) + I + r)
    g = acc_g * sg[None, :]
    u = acc_u * su[None, :]
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + (b[:, None] * M + e) * I + r[None, :], act.to(tl.bfloat16), mask=sel[:, None])


@triton.jit
def _down(h_ptr, ids_ptr, wt_ptr, w_ptr, s_ptr, part_ptr, B, M, H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
          BLOCK_B: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, K_P: tl.constexpr):
    e = tl.program_id(0)
    ob = tl.program_id(1)
    b = tl.arange(0, BLOCK_B)
    k = tl.arange(0, K_P)
    m2 = (b[:, None] < B) & (k[None, :] < K)
    ids = tl.load(ids_ptr + b[:, None] * K + k[None, :], mask=m2, other=-1)
    wts = tl.load(wt_ptr + b[:, None] * K + k[None, :], mask=m2, other=0.0)
    hit = ids == e
    sel = tl.sum(hit.to(tl.int32), axis=1) > 0
    wsel = tl.sum(tl.where(hit, wts, 0.0), axis=1)
    o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
    out = part_ptr + (e * B + b[:, None]) * H + o[None, :]
    if tl.max(sel.to(tl.int32), axis=0) == 0:
        tl.store(out, tl.zeros((BLOCK_B, BLOCK_O), tl.float32), mask=b[:, None] < B)
        return
    base = w_ptr + e.to(tl.int64) * (H * I)
    acc = tl.zeros((BLOCK_B, BLOCK_O), tl.float32)
    for i0 in range(0, I, BLOCK_I):
        ii = i0 + tl.arange(0, BLOCK_I)
        hb = tl.load(h_ptr + (b[:, None] * M + e) * I + ii[None, :], mask=sel[:, None], other=0.0)
        wd = tl.load(base + o[:, None] * I + ii[None, :]).to(tl.bfloat16)
        acc += tl.dot(hb, tl.trans(wd))
    sd = tl.load(s_ptr + e * H + o)
    tl.store(out, acc * sd[None, :] * wsel[:, None], mask=b[:, None] < B)


class HostMoE:
    def __init__(self, host: HostExperts, device, block_r=32, block_h=128, block_o=32, block_i=64):
        self.m, two_i, self.H = host.gate_up.shape
        self.I = two_i // 2
        self.gu = cuda_alias(host.gate_up.view(torch.int8))
        self.dn = cuda_alias(host.down.view(torch.int8))
        self.gus = host.gate_up_scale.to(device)
        self.dns = host.down_scale.to(device)
        self.blocks = block_r, block_h, block_o, block_i
        self.device = device

    def __call__(self, x, ids, wts, h=None, part=None):
        B, K = ids.shape
        BB = max(16, triton.next_power_of_2(B))
        br, bh, bo, bi = self.blocks
        h = torch.empty(B, self.m, self.I, dtype=torch.bfloat16, device=self.device) if h is None else h
        part = torch.empty(self.m, B, self.H, dtype=torch.float32, device=self.device) if part is None else part
        KP = triton.next_power_of_2(K)
        _gate_up[(self.m, self.I // br)](x, ids, self.gu, self.gus, h, B, self.m, self.H, self.I, K, BB, br, bh, KP)
        _down[(self.m, self.H // bo)](h, ids, wts, self.dn, self.dns, part, B, self.m, self.H, self.I, K, BB, bo, bi, KP)
        return part.sum(0)


def reference(host: HostExperts, x, ids, wts, device):
    out = torch.zeros(x.shape[0], host.gate_up.shape[2], dtype=torch.float32, device=device)
    inter = host.down.shape[2]
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0 or e >= host.held:
                continue
            gu = host.gate_up[e].to(device).float() * host.gate_up_scale[e].to(device)[:, None]
            d = host.down[e].to(device).float() * host.down_scale[e].to(device)[:, None]
            h = x[t].float() @ gu.T
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(wts[t, k]) * (a @ d.T)
    return out


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 14
    dev = torch.device("cuda")
    L, M, E = 12, 32, 64
    g = torch.Generator(device=dev).manual_seed(0)
    hosts = []
    for _ in range(L):
        gate = torch.randn(M, 1408, 2048, generator=g, device=dev, dtype=torch.bfloat16) * 0.02
        up = torch.randn(M, 1408, 2048, generator=g, device=dev, dtype=torch.bfloat16) * 0.02
        down = torch.randn(M, 2048, 1408, generator=g, device=dev, dtype=torch.bfloat16) * 0.02
        hosts.append(HostExperts.quantize(gate.cpu(), up.cpu(), down.cpu(), work_device=dev, pin=True))
    mods = [HostMoE(h, dev) for h in hosts]
    gc = torch.Generator().manual_seed(1)
    for B in (1, 4, 32):
        x = torch.randn(B, 2048, generator=gc).to(dev, torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=gc)[:6] for _ in range(B)]).to(dev)
        wts = torch.rand(B, 6, generator=gc).to(dev)
        got = mods[0](x, ids, wts)
        want = reference(hosts[0], x, ids, wts, dev)
        err = ((got - want).abs().max() / want.abs().max()).item()
        # timing over rotating layers
        n = 60
        h = torch.empty(B, M, 1408, dtype=torch.bfloat16, device=dev)
        part = torch.empty(M, B, 2048, dtype=torch.float32, device=dev)
        for i in range(5):
            mods[i % L](x, ids, wts, h, part)
        torch.cuda.synchronize()
        s, e_ = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        idss = [torch.stack([torch.randperm(E, generator=gc)[:6] for _ in range(B)]).to(dev) for _ in range(n)]
        s.record()
        for i in range(n):
            mods[i % L](x, idss[i], wts, h, part)
        e_.record()
        e_.synchronize()
        ms = s.elapsed_time(e_) / n
        chosen = sum(len(set(t for t in i.flatten().tolist() if t < M)) for i in idss) / n
        print(json.dumps({"B": B, "rel_err": err, "ms": round(ms, 3), "experts_read": chosen,
                          "GB_s": round(chosen * 3 * 2048 * 1408 / ms / 1e6, 1)}), flush=True)

    # concurrency with kt-kernel at batch 1: kt-kernel's 3 experts of 6 (ids >= 32 of 64) vs all 6
    stack = cold_layers("AMXINT8", 6, threads)
    inputs = _inputs(300, seed=1)
    half = [(x, torch.where(ids >= M, ids, -1), w) for x, ids, w in inputs]
    for x, ids, w in inputs[:8]:
        stack[0].forward(x, ids, w)

    def kt_ms(data):
        t = time.perf_counter()
        for i, (x, ids, w) in enumerate(data):
            stack[i % 6].forward(x, ids, w)
        return (time.perf_counter() - t) / len(data) * 1e3

    full, halfms = kt_ms(inputs), kt_ms(half)
    x = torch.randn(1, 2048, generator=gc).to(dev, torch.bfloat16)
    idss = [torch.randperm(E, generator=gc)[:6].view(1, 6).to(dev) for _ in range(64)]
    wts = torch.rand(1, 6, generator=gc).to(dev)
    h = torch.empty(1, M, 1408, dtype=torch.bfloat16, device=dev)
    part = torch.empty(M, 1, 2048, dtype=torch.float32, device=dev)
    stop, count = threading.Event(), [0]

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for i in range(3):
            mods[i % L](x, idss[i], wts, h, part)
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for i in range(64):
            mods[i % L](x, idss[i], wts, h, part)
    side.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    alone_gpu = (time.perf_counter() - t) / 320 * 1e3
    print(json.dumps({"gpu_layer_ms_alone_graph": round(alone_gpu, 3)}), flush=True)

    def gpu_loop():
        while not stop.is_set():
            graph.replay()
            torch.cuda.synchronize()
            count[0] += 64

    th = threading.Thread(target=gpu_loop, daemon=True)
    th.start()
    time.sleep(0.3)
    c0, t = count[0], time.perf_counter()
    together = kt_ms(half)
    calls = count[0] - c0
    dt = time.perf_counter() - t
    stop.set()
    th.join()
    print(json.dumps({"threads": threads, "kt_6_ms": round(full, 3), "kt_3of6_ms": round(halfms, 3),
                      "kt_3of6_with_gpu_ms": round(together, 3),
                      "gpu_layer_ms_meanwhile": round(dt / calls * 1e3, 3) if calls else None}), flush=True)


if __name__ == "__main__":
    main()
