"""Where a prompt chunk's expert time goes with `kt_gpu_prefill_tokens`: V2-Lite MoE layers (64 experts of
2048 x 1408, top-6, random weights) in a row, each chunk size timed three ways:

`cpu`    every expert in kt-kernel (what a chunk costs without streaming),
`gpu`    every expert on the GPU from weights streamed out of pinned host memory (ExpertStreamer.compute),
`split`  what the engine does: the experts split between the two by ExpertStreamer.split,

plus the host-to-GPU copy rate of one layer's int8 experts. With `--held 4,16,...` each size is also timed as a
`kt_gpu_prefill_memory` budget leaves it, copies of only the first n experts of each layer kept: `split_held_n`
(the engine's split capped at n) and `cpu_without_n` (kt-kernel alone over the other experts: what the CPU side
of that split costs). Per-layer times are the median over the layers of
a few passes (CUDA events around each layer, the layers in a row so the next layer's prefetch counts).

    python -m bench.expert_streaming [--method AMXINT8] [--tokens 128,512,2048,8192] [--layers 4] [--held 4,16]

Needs a CUDA GPU and kt-kernel. Prints one JSON line per measurement and a summary line last."""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench.expert_floor import EXPERTS, HIDDEN, INTER, TOP_K  # one V2-Lite MoE layer


def _layers(method: str, count: int, max_tokens: int, streamer, threads: int | None):
    from engines.kt.experts.cpu import RoutedExpertsCPU

    layers = []
    for i in range(count):
        layer = RoutedExpertsCPU(layer_idx=i, num_experts=EXPERTS, top_k=TOP_K, hidden_size=HIDDEN,
                                 intermediate_size=INTER, method=method, threads=threads, max_tokens=max_tokens,
                                 gpu_device="cuda", out_device="cuda", streamer=streamer, stream_tokens=1)
        weights = [torch.randn(EXPERTS, *shape, dtype=torch.bfloat16, device="cuda").mul_(0.02).cpu()
                   for shape in ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))]
        layer.load_weights(*weights)
        layers.append(layer)
    return layers


def _time_layers(run, layers, passes: int) -> float:
    """Median milliseconds of one layer, the layers run in a row `passes` times."""
    times = []
    for _ in range(passes):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(layers) + 1)]
        events[0].record()
        for i, layer in enumerate(layers):
            run(layer)
            events[i + 1].record()
        events[-1].synchronize()
        times += [events[i].elapsed_time(events[i + 1]) for i in range(len(layers))]
    return statistics.median(times[len(layers):] or times)  # the first pass warms up


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.expert_streaming", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="AMXINT8")
    p.add_argument("--tokens", default="128,512,2048,8192")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--threads", type=int)
    p.add_argument("--held", default="", help="comma-separated counts of experts a budget keeps copies of")
    args = p.parse_args(argv)
    from engines.kt.experts.host_copies import HostExperts
    from engines.kt.experts.streaming import ExpertStreamer

    held_counts = [n for n in args.held.split(",") if n]
    if not all(n.isdigit() and int(n) > 0 for n in held_counts):
        p.error(f"--held: expected positive whole numbers, got {args.held!r}")
    held_counts = [int(n) for n in held_counts]

    sizes = [int(t) for t in args.tokens.split(",")]
    streamer = ExpertStreamer(torch.device("cuda"))
    layers = _layers(args.method, args.layers, max(sizes), streamer, args.threads)
    host = streamer.layers[0]
    layer_bytes = host.gate_up.nbytes + host.down.nbytes
    summary = {"method": args.method, "layers": args.layers, "copy_gbps": round(streamer.pcie_bytes_per_s / 1e9, 1),
               "layer_int8_bytes": layer_bytes}
    buffer = torch.empty(layer_bytes, dtype=torch.int8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    copies = []
    for _ in range(5):
        start.record()
        buffer[:host.gate_up.numel()].copy_(host.gate_up.view(-1), non_blocking=True)
        buffer[host.gate_up.numel():].copy_(host.down.view(-1), non_blocking=True)
        end.record()
        end.synchronize()
        copies.append(start.elapsed_time(end))
    summary["layer_copy_ms"] = round(statistics.median(copies), 2)
    summary["layer_copy_gbps"] = round(layer_bytes / statistics.median(copies) / 1e6, 1)
    print(json.dumps({"copy": summary}), flush=True)
    for tokens in sizes:
        g = torch.Generator().manual_seed(tokens)
        hidden = torch.randn(tokens, HIDDEN, generator=g).bfloat16().cuda()
        ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)]).cuda()
        weights = torch.rand(tokens, TOP_K, generator=g).cuda()
        row = {"tokens": tokens}
        for layer in layers:
            layer.stream_tokens = tokens + 1  # off: kt-kernel takes every expert
        row["cpu_ms"] = _time_layers(lambda layer: layer(hidden, ids, weights), layers, args.passes)
        row["gpu_ms"] = _time_layers(lambda layer: streamer.compute(layer.layer_idx, hidden, ids, weights, EXPERTS),
                                     layers, args.passes)
        for layer in layers:
            layer.stream_tokens = 1
        row["split_experts_on_gpu"] = layers[0]._streamed_experts(tokens)
        row["split_ms"] = _time_layers(lambda layer: layer(hidden, ids, weights), layers, args.passes)
        whole = dict(streamer.layers)
        for n in held_counts:
            without = ids.masked_fill(ids < n, -1)
            for layer in layers:
                layer.stream_tokens = tokens + 1
            row[f"cpu_without_{n}_ms"] = _time_layers(lambda layer: layer(hidden, without, weights), layers,
                                                      args.passes)
            for layer in layers:  # the first n experts' copies, as a budget keeps them (views: nothing copied)
                layer.stream_tokens = 1
                streamer.layers[layer.layer_idx] = HostExperts(*(t[:n] for t in whole[layer.layer_idx].tensors()))
            row[f"split_held_{n}_experts_on_gpu"] = layers[0]._streamed_experts(tokens)
            row[f"split_held_{n}_ms"] = _time_layers(lambda layer: layer(hidden, ids, weights), layers, args.passes)
            streamer.layers.update(whole)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        summary[f"t{tokens}"] = {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items() if k != "tokens"}
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
