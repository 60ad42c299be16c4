"""Decode-sized expert calls with part of the experts read by the GPU straight from host memory
(`kt_gpu_read_experts`, engines/kt/experts/mapped.py): MoE layers of `--shape` (v2-lite: 64 experts of
2048 x 1408, top-6, random bf16 weights quantized by `--method`; v4-flash: 256 experts of 4096 x 2048, top-6,
random MXFP4 bytes as V4 releases them, read in place by kt-kernel and by the GPU, SwiGLU clamped), random
routing, each call on the stream path the engine's decode takes (copies to pinned buffers, kt-kernel started and
awaited from the CUDA stream), timed per layer with CUDA events over many calls that rotate through the layers so
that no cache holds their experts.

For each call size, the GPU's share of the experts is set to each of `--shares` (0: kt-kernel computes every
expert, as without the setting; `auto`: the engine's default, `default_read_share`); the layers keep copies of every
expert, so any share can be timed. Also the GPU kernels alone (`gpu_alone`, no kt-kernel task) and the read
rate they reached.

    python -m bench.mapped_experts [--method AMXINT8] [--tokens 1,4,16,32] [--shares 0,auto,16,24,32,40]
                                   [--layers 6] [--calls 240] [--threads N]
    python -m bench.mapped_experts --shape v4-flash --tokens 1,4 --shares 0,auto,64,128,192 --layers 4

Needs a CUDA GPU, Triton and kt-kernel. Prints one JSON line per measurement and a summary line last."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

from bench import expert_floor


@dataclass(frozen=True)
class LayerShape:
    experts: int
    hidden: int
    inter: int
    top_k: int
    swiglu_limit: float = 0.0  # V4 clamps its routed experts' SwiGLU inputs
    mxfp4: bool = False  # experts as V4 releases them (load_packed), the method MXFP4


SHAPES = {"v2-lite": LayerShape(expert_floor.EXPERTS, expert_floor.HIDDEN, expert_floor.INTER, expert_floor.TOP_K),
          "v4-flash": LayerShape(256, 4096, 2048, 6, swiglu_limit=10.0, mxfp4=True)}


def _packed_experts(shape: LayerShape, seed: int) -> dict[str, torch.Tensor]:
    """Random MXFP4 experts in `load_packed`'s terms (packed E2M1 bytes, UE8M0 scales of 2^-7, as
    bench/v4_flash.py writes V4-Flash-shaped checkpoints)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m, (n, k) in {"gate": (shape.inter, shape.hidden), "up": (shape.inter, shape.hidden),
                      "down": (shape.hidden, shape.inter)}.items():
        out[m] = torch.randint(-128, 128, (shape.experts, n, k // 2), dtype=torch.int8, generator=g)
        out[f"{m}_scale"] = torch.full((shape.experts, n, k // 32), 120, dtype=torch.uint8).view(
            torch.float8_e8m0fnu)
    return out


def _layers(shape: LayerShape, method: str, count: int, streamers, threads: int | None) -> list:
    from engines.kt.experts.cpu import RoutedExpertsCPU
    from engines.kt.experts.mapped import MAX_TOKENS

    layers = []
    for i in range(count):
        layer = RoutedExpertsCPU(layer_idx=i, num_experts=shape.experts, top_k=shape.top_k,
                                 hidden_size=shape.hidden, intermediate_size=shape.inter, method=method,
                                 threads=threads, max_tokens=MAX_TOKENS, gpu_device="cuda", out_device="cuda",
                                 streamer=streamers.for_device(torch.device("cuda")),
                                 stream_tokens=MAX_TOKENS + 1,  # no ring streaming
                                 read_experts=shape.experts,  # every copy readable: the shares are set below
                                 swiglu_limit=shape.swiglu_limit)
        if shape.mxfp4:
            layer.load_packed(_packed_experts(shape, seed=i))
        else:
            layer.load_weights(*[torch.randn(shape.experts, *dims, dtype=torch.bfloat16, device="cuda").mul_(0.02)
                                 .cpu() for dims in ((shape.inter, shape.hidden), (shape.inter, shape.hidden),
                                                     (shape.hidden, shape.inter))])
        layers.append(layer)
    return layers


def _calls(shape: LayerShape, tokens: int, count: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(tokens, shape.hidden, generator=g).to("cuda", torch.bfloat16),
             torch.stack([torch.randperm(shape.experts, generator=g)[:shape.top_k] for _ in range(tokens)]).cuda(),
             torch.rand(tokens, shape.top_k, generator=g).cuda()) for _ in range(count)]


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
    p.add_argument("--shape", choices=sorted(SHAPES), default="v2-lite")
    p.add_argument("--method", help="kt-kernel's method (default: AMXINT8; v4-flash: MXFP4, its only one here)")
    p.add_argument("--tokens", default="1,4,16,32")
    p.add_argument("--shares", default="0,auto,16,24,32,40")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--calls", type=int, default=240)
    p.add_argument("--threads", type=int)
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    method = args.method or ("MXFP4" if shape.mxfp4 else "AMXINT8")
    if shape.mxfp4 and method != "MXFP4":
        p.error(f"--method: the {args.shape} layers hold released MXFP4 experts, read by the MXFP4 method only")
    shares = args.shares.split(",")
    if not all(s == "auto" or (s.isdigit() and int(s) <= shape.experts) for s in shares):
        p.error(f"--shares: expected 'auto' or whole numbers up to {shape.experts}, got {args.shares!r}")
    sizes = [int(t) for t in args.tokens.split(",")]
    from engines.kt.experts.streaming import ExpertStreamers
    from engines.kt.experts.mapped import MAX_TOKENS, default_read_share

    if max(sizes) > MAX_TOKENS:
        p.error(f"--tokens: calls of at most {MAX_TOKENS} tokens go through the mapped experts")
    layers = _layers(shape, method, args.layers, ExpertStreamers(), args.threads)
    mapped = layers[0].streamer.mapped
    if mapped is None:
        raise SystemExit("Triton is not installed: the GPU cannot read the experts from host memory")
    auto = default_read_share(method, shape.experts, shape.experts, shape.hidden, shape.inter)
    summary = {"shape": args.shape, "method": method, "layers": args.layers, "threads": layers[0].threads,
               "auto_share": auto, "copy_gbps": round(layers[0].streamer.pcie_bytes_per_s / 1e9, 1),
               "ms_per_layer": {}}

    def through_layer(layer, x, ids, w):
        layer.submit(x, ids, w)
        layer.sync()

    copies = layers[0].streamer.layers[layers[0].layer_idx]
    expert_bytes = copies.nbytes / copies.held  # int8, or int4 for 4-bit methods, with their scales
    for tokens in sizes:
        calls = _calls(shape, tokens, args.calls, seed=tokens)
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
        ms = _time(lambda layer, x, ids, w: mapped.compute(layer.layer_idx, x, ids, w, shape.experts), calls, layers)
        row["gpu_alone"] = round(ms, 3)
        print(json.dumps({"tokens": tokens, "gpu_alone_ms": round(ms, 4), "experts_read": read,
                          "gpu_read_GB_s": round(read * expert_bytes / ms / 1e6, 1)}), flush=True)
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
