"""Block sizes, warps and stages of the mapped-expert kernels: ms and GB/s per call over V2-Lite layers'
int8 copies in pinned host memory (6 layers in turn, so no cache holds them). Prints JSON lines."""
import json
import sys

import torch

from engines.kt.expert_streaming import HostExperts
from engines.kt.mapped_experts import MappedExperts, _kernels

E, H, I, K, NL = 64, 2048, 1408, 6, 6
tokens_list = [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "1").split(",")]
dev = torch.device("cuda", 0)
if len(sys.argv) > 2 and sys.argv[2] == "init-first":
    torch.zeros(1, device=dev)
mapped = MappedExperts(dev)
hosts = []  # a HostExperts unpins its memory when it goes: keep them
for layer in range(NL):
    host = HostExperts.empty(E, I, H, pin=True)
    hosts.append(host)
    host.gate_up.fill_(1); host.down.fill_(1); host.gate_up_scale.fill_(1e-3); host.down_scale.fill_(1e-3)
    mapped.register(layer, host, K)
triton, gate_up, down = _kernels()
x0 = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
ids0 = torch.randperm(E, device=dev)[:K][None]
print(json.dumps({"compute_ok": float(mapped.compute(0, x0, ids0, torch.ones(1, K, device=dev), E).abs().sum())}), flush=True)

g = torch.Generator().manual_seed(0)


def routing(tokens, n=120):
    return [(torch.randn(tokens, H, generator=g).to(dev, torch.bfloat16),
             torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).to(dev),
             torch.rand(tokens, K, generator=g).to(dev)) for _ in range(n)]


def timed(fn, calls):
    for i, c in enumerate(calls[:NL]):
        with torch.cuda.device(dev):
            fn(i % NL, *c)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    with torch.cuda.device(dev):
        for i, c in enumerate(calls):
            fn(i % NL, *c)
    e.record(); e.synchronize()
    return s.elapsed_time(e) / len(calls)


for tokens in tokens_list:
    calls = routing(tokens)
    read = sum(len({int(x) for x in ids.flatten()}) for _, ids, _ in calls) / len(calls)
    bt, kp = max(16, triton.next_power_of_2(tokens)), triton.next_power_of_2(K)
    part = mapped._part[:tokens * K * H].view(tokens, K, H)
    for br in (16, 32, 64):
        for bh in (128, 256, 512):
            for w in (4, 8):
                for st in (2, 3, 4):
                    def gu(layer, x, ids, wts):
                        c = mapped.layers[layer]
                        gate_up[(E, triton.cdiv(I, br))](x, ids, c.gate_up, c.gate_up_scale, mapped._h, tokens, H, I, K,
                                                          bt, br, bh, kp, num_warps=w, num_stages=st)
                    try:
                        ms = timed(gu, calls)
                    except Exception as exc:
                        print(json.dumps({"kernel": "gate_up", "tokens": tokens, "BLOCK_R": br, "BLOCK_H": bh, "warps": w, "stages": st, "error": repr(exc)[:120]}), flush=True)
                        continue
                    print(json.dumps({"kernel": "gate_up", "tokens": tokens, "BLOCK_R": br, "BLOCK_H": bh, "warps": w, "stages": st,
                                      "ms": round(ms, 4), "GB_s": round(read * 2 * I * H / ms / 1e6, 1)}), flush=True)
    for bo in (16, 32, 64):
        for bi in (64, 128, 256, 512):
            for w in (4, 8):
                for st in (2, 3, 4):
                    def dn(layer, x, ids, wts):
                        c = mapped.layers[layer]
                        down[(E, triton.cdiv(H, bo))](mapped._h, ids, wts, c.down, c.down_scale, part, tokens, H, I, K,
                                                      bt, bo, bi, kp, num_warps=w, num_stages=st)
                    try:
                        ms = timed(dn, calls)
                    except Exception as exc:
                        print(json.dumps({"kernel": "down", "tokens": tokens, "BLOCK_O": bo, "BLOCK_I": bi, "warps": w, "stages": st, "error": repr(exc)[:120]}), flush=True)
                        continue
                    print(json.dumps({"kernel": "down", "tokens": tokens, "BLOCK_O": bo, "BLOCK_I": bi, "warps": w, "stages": st,
                                      "ms": round(ms, 4), "GB_s": round(read * I * H / ms / 1e6, 1)}), flush=True)
