"""Decode-sized expert calls with part of the experts read by the GPU straight from host memory
(`kt_gpu_read_experts`, engines/kt/experts/mapped.py): V2-Lite MoE layers (64 experts of 2048 x 1408, top-6,
random weights, random routing), each call on the stream path the engine's decode takes (copies to pinned
buffers, kt-kernel started and awaited from the CUDA stream), timed per layer with CUDA events over many calls
that rotate through the layers so that no cache holds their experts.

For each call size, the GPU's share of the experts is set to each of `--shares` (0: kt-kernel computes every
expert, as without the setting; `auto`: the engine's balance, `decode_experts`); the layers keep copies of every
expert, so any share can be timed. Also the GPU kernels alone (`gpu_alone`, no kt-kernel task) and the read
rate they reached.

    python -m bench.mapped_experts [--method AMXINT8] [--tokens 1,4,16,32] [--shares 0,auto,16,24,32,40]
                                   [--layers 6] [--calls 240] [--threads N]

Needs a CUDA GPU, Triton and kt-kernel. Prints one JSON line per measurement and a summary line last."""
from __future__ import annotations

import argparse
import json

import torch

from bench.expert_floor import EXPERTS, HIDDEN, INTER, TOP_K  # one V2-Lite MoE layer


def _layers(method: str, count: int, streamers, threads: int | None) -> list:
    from engines.kt.experts.cpu import RoutedExpertsCPU
    from engines.kt.experts.mapped import MAX_TOKENS

    layers = []
    for i in range(count):
        layer = RoutedExpertsCPU(layer_idx=i, num_experts=EXPERTS, top_k=TOP_K, hidden_size=HIDDEN,
                                 intermediate_size=INTER, method=method, threads=threads, max_tokens=MAX_TOKENS,
                                 gpu_device="cuda", out_device="cuda", streamer=streamers.for_device(
                                     torch.device("cuda")), stream_tokens=MAX_TOKENS + 1,  # no ring streaming
                                 read_experts=None)  # decode calls read the balanced share of the copies
        weights = [torch.randn(EXPERTS, *shape, dtype=torch.bfloat16, device="cuda").mul_(0.02).cpu()
                   for shape in ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))]
        layer.load_weights(*weights)
        layers.append(layer)
    return layers


def _calls(tokens: int, count: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(tokens, HIDDEN, generator=g).to("cuda", torch.bfloat16),
             torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)]).cuda(),
             torch.rand(tokens, TOP_K, generator=g).cuda()) for _ in range(count)]


def _time(run, calls: list, layers: list) -> float:
    """Milliseconds per layer call, the calls taken in turn by the layers."""
    for i, call in enumerate(calls[:len(layers)]):  # warm-up (kernel compilation, buffers)
        run(layers[i], *call)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i, call in enumerate(calls):
        run(layers[i % len(layers)], *call)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / len(calls)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.mapped_experts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="AMXINT8")
    p.add_argument("--tokens", default="1,4,16,32")
    p.add_argument("--shares", default="0,auto,16,24,32,40")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--calls", type=int, default=240)
    p.add_argument("--threads", type=int)
    args = p.parse_args(argv)
    shares = args.shares.split(",")
    if not all(s == "auto" or (s.isdigit() and int(s) <= EXPERTS) for s in shares):
        p.error(f"--shares: expected 'auto' or whole numbers up to {EXPERTS}, got {args.shares!r}")
    sizes = [int(t) for t in args.tokens.split(",")]
    from engines.kt.experts.streaming import ExpertStreamers
    from engines.kt.experts.mapped import MAX_TOKENS

    if max(sizes) > MAX_TOKENS:
        p.error(f"--tokens: calls of at most {MAX_TOKENS} tokens go through the mapped experts")
    layers = _layers(args.method, args.layers, ExpertStreamers(), args.threads)
    mapped = layers[0].streamer.mapped
    if mapped is None:
        raise SystemExit("Triton is not installed: the GPU cannot read the experts from host memory")
    auto = layers[0].mapped_experts(1)
    summary = {"method": args.method, "layers": args.layers, "threads": layers[0].threads, "auto_share": auto,
               "copy_gbps": round(layers[0].streamer.pcie_bytes_per_s / 1e9, 1), "ms_per_layer": {}}

    def through_layer(layer, x, ids, w):
        layer.submit(x, ids, w)
        layer.sync()

    copies = layers[0].streamer.layers[layers[0].layer_idx]
    expert_bytes = copies.nbytes / copies.held  # int8, or int4 for 4-bit methods, with their scales
    for tokens in sizes:
        calls = _calls(tokens, args.calls, seed=tokens)
        row = summary["ms_per_layer"][str(tokens)] = {}
        for share in shares:
            n = auto if share == "auto" else int(share)
            for layer in layers:
                layer._mapped_share = n
            ms = _time(through_layer, calls, layers)
            row[share] = round(ms, 3)
            print(json.dumps({"tokens": tokens, "gpu_share": share, "experts": n, "ms_per_layer": round(ms, 4)}),
                  flush=True)
        # the GPU kernels alone over the layers' copies of every expert
        read = sum(len({int(e) for e in ids.flatten()}) for _, ids, _ in calls) / len(calls)
        ms = _time(lambda layer, x, ids, w: mapped.compute(layer.layer_idx, x, ids, w, EXPERTS), calls, layers)
        row["gpu_alone"] = round(ms, 3)
        print(json.dumps({"tokens": tokens, "gpu_alone_ms": round(ms, 4), "experts_read": read,
                          "gpu_read_GB_s": round(read * expert_bytes / ms / 1e6, 1)}), flush=True)
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
