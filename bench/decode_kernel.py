"""The decode kernel (engines/kt/experts/decode_kernel) beside kt-kernel's MoE classes, at decode sizes:

    python -m bench.decode_kernel [--formats mxfp4,int8,int4,fp8,q4_k,q6_k,q4_k_m] [--threads 14] [--tokens 1,2,4,8,16]
                                  [--kt | --no-kt] [--out DIR]

One MoE layer call of T rows (random routing, top-k of E experts), cold: the layers of a format are taken in
turn and each call draws fresh experts, so no cache holds what a call reads. Shapes: mxfp4 = V4-Flash (256
experts, 4096 x 2048, top-6, released MXFP4 bytes, SwiGLU clamp 10), int8 / int4 = V2-Lite (64 experts,
2048 x 1408, top-6), fp8 = V3/R1's 7168 x 2048 with 128 x 128 blocks (64 experts allocated of 256, top-8:
fewer experts held, the same work per call), q4_k / q6_k / q4_k_m = a GGUF's super-blocks read in place (q4_k_m:
Q4_K gate/up, Q6_K down, as a "Q4_K_M" file's) at V2-Lite's width with its 1408 rounded up to whole super-blocks
(64 experts, 2048 x 1536, top-6). A call's bytes are the distinct experts it reads times one
expert's weights and scales; GB/s over the host's read bandwidth measured in the same run (a torch float32
sum over 4 GB on the same thread count) is the figure of merit. kt-kernel's class for the format runs in
the same child process after ours (MXFP4: AMXFP4_KGroup_MOE; INT8: AMXInt8_MOE; INT4: AMXInt4_MOE; FP8:
AMXFP8_MOE on the amx build; the ggml formats: LLAMAFILE on the same blocks), each driven from Python as the
CPU-only engine drives it.

Each (format, threads) pair runs in a child process (kt-kernel's pool is process-wide). Prints one JSON line
per measurement and a summary object last; with --out, writes decode_kernel.json there. Our rows name the
kernel's vector half in `impl` and `isa` (avx512-vnni, avx512, avx2-vnni, avx2; KTSERVE_DECODE_KERNEL_ISA picks
another) and in `dot_products` whether it took the format's dot products on int8-quantized activations ("int8":
MXFP4 and INT4 on the integer path) or in float."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Shape:
    experts: int
    hidden: int
    inter: int
    top_k: int
    layers: int
    limit: float = 0.0
    routed_over: int = 0  # experts the routing draws from (0: experts); FP8 holds fewer than V3 routes over


SHAPES = {
    "mxfp4": Shape(256, 4096, 2048, 6, layers=2, limit=10.0),
    "int8": Shape(64, 2048, 1408, 6, layers=6),
    "int4": Shape(64, 2048, 1408, 6, layers=8),
    "fp8": Shape(64, 7168, 2048, 8, layers=2),
    "q4_k": Shape(64, 2048, 1536, 6, layers=8),
    "q6_k": Shape(64, 2048, 1536, 6, layers=6),
    "q4_k_m": Shape(64, 2048, 1536, 6, layers=8),
}
KT_METHOD = {"mxfp4": "MXFP4", "int8": "AMXINT8", "int4": "AMXINT4", "fp8": "FP8", "q4_k": "LLAMAFILE",
             "q6_k": "LLAMAFILE", "q4_k_m": "LLAMAFILE"}
GGML_TYPES = {"q4_k": ("Q4_K",) * 3, "q6_k": ("Q6_K",) * 3, "q4_k_m": ("Q4_K", "Q4_K", "Q6_K")}  # gate, up, down


def _fill(shape: tuple[int, ...], low: int, high: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes quickly: one random 16 MB block, copied over the tensor and shifted per copy."""
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    block = torch.randint(low, high, (min(flat.numel(), 1 << 24),), dtype=dtype,
                          generator=torch.Generator().manual_seed(seed))
    for start in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - start)
        flat[start:start + n].copy_(block[:n].roll(start // block.numel() % 997))
    return out


def _tensors(fmt: str, s: Shape, seed: int) -> dict[str, torch.Tensor]:
    """Random experts in the format's stored form (decode_kernel.DecodeLayer's terms)."""
    from engines.kt.experts import decode_kernel as dk

    t: dict[str, torch.Tensor] = {}
    for i, (m, (n, k)) in enumerate((("gate", (s.inter, s.hidden)), ("up", (s.inter, s.hidden)),
                                     ("down", (s.hidden, s.inter)))):
        sd = seed * 8 + i
        if fmt in GGML_TYPES:  # random super-blocks, their fp16 d (and Q4_K's dmin) fields a normal 2^-12
            kind = dk.GGML_FORMATS[GGML_TYPES[fmt][i]]
            size = dk.GGML_BLOCK_BYTES[kind]
            b = _fill((s.experts, n, k // 256, size), 0, 256, torch.uint8, sd)
            for offset in ((0, 2) if kind == "q4_k" else (208,)):
                b[..., offset:offset + 2] = torch.tensor([0x00, 0x0C], dtype=torch.uint8)
            t[m] = b.view(s.experts, n, -1)
        elif fmt in ("mxfp4", "int4"):
            t[m] = _fill((s.experts, n, k // 2), 0, 256, torch.uint8, sd)
            t[f"{m}_scale"] = (_fill((s.experts, n, k // 32), 118, 122, torch.uint8, sd) if fmt == "mxfp4" else
                               torch.full((s.experts, n, k // 32), 0.01).bfloat16())
        elif fmt == "int8":
            t[m] = _fill((s.experts, n, k), -127, 128, torch.int8, sd)
            t[f"{m}_scale"] = torch.full((s.experts, n), 1e-3)
        else:  # e4m3 bytes without the NaN codes
            t[m] = _fill((s.experts, n, k), 0, 126, torch.uint8, sd) | (_fill((s.experts, n, k), 0, 2, torch.uint8,
                                                                                 sd + 4) << 7)
            t[f"{m}_scale"] = torch.full((s.experts, -(-n // 128), -(-k // 128)), 1e-3)
    return t


def _calls(s: Shape, tokens: int, count: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    over = s.routed_over or s.experts
    return [(torch.randn(tokens, s.hidden, generator=g).bfloat16(),
             torch.stack([torch.randperm(over, generator=g)[:s.top_k] for _ in range(tokens)]) % s.experts,
             torch.rand(tokens, s.top_k, generator=g)) for _ in range(count)]


def _time(run, layers: list, calls: list) -> float:
    """Seconds per call, calls taken in turn by the layers (median of three passes)."""
    for i, call in enumerate(calls[:2 * len(layers)]):
        run(layers[i % len(layers)], *call)
    passes = []
    for _ in range(3):
        started = time.perf_counter()
        for i, call in enumerate(calls):
            run(layers[i % len(layers)], *call)
        passes.append((time.perf_counter() - started) / len(calls))
    return sorted(passes)[1]


def _calls_for(s: Shape, tokens: int, expert_bytes: int, budget_s: float, read_gbps: float) -> int:
    per_call = s.top_k * tokens * expert_bytes / (read_gbps * 0.5e9)  # a pessimistic guess of a call's time
    return max(3 * s.layers, min(400, int(budget_s / max(per_call, 1e-5))))


def child(fmt: str, threads: int, tokens: list[int], kt: bool, pin: bool, budget_s: float,
          layer_count: int | None) -> None:
    from dataclasses import replace

    from bench.lib.bandwidth import measure_host_bandwidth
    from engines.kt.experts import decode_kernel as dk

    s = SHAPES[fmt] if not layer_count else replace(SHAPES[fmt], layers=layer_count)
    torch.set_num_threads(threads)
    bw = measure_host_bandwidth(threads, 4 << 30, repeats=5)
    read = bw["read_bandwidth"]["value"]
    print(json.dumps({"format": fmt, "threads": threads, "read_GB_s": read,
                      "copy_GB_s": bw["copy_bandwidth"]["value"]}), flush=True)
    torch.set_num_threads(max(1, os.cpu_count() - threads))
    stored = [_tensors(fmt, s, seed=i) for i in range(s.layers)]
    make = (dk.DecodeLayer.mxfp4 if fmt == "mxfp4" else dk.DecodeLayer.fp8 if fmt == "fp8" else
            (lambda t, swiglu_limit: dk.DecodeLayer.ggml(t, GGML_TYPES[fmt], swiglu_limit=swiglu_limit))
            if fmt in GGML_TYPES else None)
    layers = [make(t, swiglu_limit=s.limit) if make else dk.DecodeLayer(fmt, s.hidden, s.inter, t)
              for t in stored]
    expert_bytes = layers[0].nbytes_per_expert
    cpus = sorted(os.sched_getaffinity(0))[:threads] if pin else None
    pool = dk.DecodePool(threads, cpus)
    rows = []

    def report(impl: str, n: int, calls: list, sec: float, per_expert: int = expert_bytes, **more) -> None:
        distinct = sum(len({int(e) for e in ids.flatten()}) for _, ids, _ in calls) / len(calls)
        gbps = distinct * per_expert / sec / 1e9
        row = {"format": fmt, "impl": impl, "threads": threads, "tokens": n, "experts_read": round(distinct, 2),
               "MB_per_expert": round(per_expert / 1e6, 3),
               "ms_per_call": round(sec * 1e3, 4), "GB_s": round(gbps, 1), "of_read": round(gbps / read, 3), **more}
        rows.append(row)
        print(json.dumps(row), flush=True)

    work = {n: _calls(s, n, _calls_for(s, n, expert_bytes, budget_s, read), seed=n) for n in tokens}
    out = torch.empty(max(tokens), s.hidden, dtype=torch.bfloat16)
    for n in tokens:
        sec = _time(lambda layer, x, ids, w: layer.forward(x, ids, w, pool, out=out[:x.shape[0]]), layers, work[n])
        report(f"ktserve {dk.isa()}", n, work[n], sec, isa=dk.isa(),
               dot_products="int8" if layers_quantize(dk, fmt) else "float")
    pool.close()
    del layers
    if kt:
        rows += _kt_kernel(fmt, s, stored, threads, work, expert_bytes, report)
    print(json.dumps({"child_done": fmt, "threads": threads}), flush=True)


def layers_quantize(dk, fmt: str) -> bool:
    """Whether the kernel takes any of the format's dot products on int8 activations."""
    return any(dk.quantizes_activations(dk.GGML_FORMATS[t]) for t in GGML_TYPES[fmt]) if fmt in GGML_TYPES else \
        dk.quantizes_activations(fmt)


def _kt_kernel(fmt: str, s: Shape, stored: list, threads: int, work: dict, expert_bytes: int, report) -> list:
    from engines.kt.experts.cpu import RoutedExpertsCPU
    from engines.kt.experts.methods import kernel_class, unavailable_reason
    from engines.checkpoints.fp8 import dequantize_blocks
    from engines.kt.experts import decode_kernel as dk

    method = KT_METHOD[fmt]
    if unavailable_reason(method) is not None:
        print(json.dumps({"format": fmt, "kt_kernel": unavailable_reason(method)}), flush=True)
        return []
    layers = []
    for i, t in enumerate(stored):
        layer = RoutedExpertsCPU(layer_idx=i, num_experts=s.experts, top_k=s.top_k, hidden_size=s.hidden,
                                 intermediate_size=s.inter, method=method, threads=threads, max_tokens=16,
                                 swiglu_limit=s.limit)
        if fmt == "mxfp4":
            layer.load_packed({m: (v.view(torch.float8_e8m0fnu) if m.endswith("_scale") else v) for m, v in t.items()})
        elif fmt in GGML_TYPES:  # the same blocks, read in place by kt-kernel's llamafile kernel
            if not layer.load_ggml({m: (t[m], kind) for m, kind in zip(("gate", "up", "down"), GGML_TYPES[fmt])}):
                print(json.dumps({"format": fmt, "kt_kernel": "this build's LLAMAFILE does not compute these types "
                                  "in place"}), flush=True)
                return []
        elif fmt == "fp8":
            layer._load_prepared(lambda t=t: {m: (v if m.endswith("_scale") else v) for m, v in t.items()}, None)
        else:  # kt-kernel quantizes bf16 weights itself
            layer.load_weights(*(dk.dequantize(fmt, t[m], t[f"{m}_scale"]).bfloat16() for m in ("gate", "up", "down")))
        layers.append(layer)
        t.clear()
    name = kernel_class(method).__name__
    # kt-kernel's own bytes where it holds another form: INT8 one byte a weight, INT4 half of one (per-row scales)
    weights = 3 * s.hidden * s.inter
    own = {"int8": weights, "int4": weights // 2}.get(fmt, expert_bytes)
    for n, calls in work.items():
        sec = _time(lambda layer, x, ids, w: layer.forward(x, ids, w), layers, calls)
        report(f"kt-kernel {name}", n, calls, sec, own)
    return []


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.decode_kernel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="mxfp4,int8,int4,fp8")
    p.add_argument("--threads", default=None, help="comma-separated (default: the engine's default count)")
    p.add_argument("--tokens", default="1,2,4,8,16")
    p.add_argument("--kt", action=argparse.BooleanOptionalAction, default=True, help="kt-kernel beside ours")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="pin the kernel's workers one per CPU")
    p.add_argument("--budget", type=float, default=0.4, help="seconds of calls per pass and token count")
    p.add_argument("--layers", type=int, help="layers per format in rotation (default: the shape's)")
    p.add_argument("--out")
    p.add_argument("--child", nargs=2, metavar=("FORMAT", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.child:
        child(args.child[0], int(args.child[1]), tokens, args.kt, args.pin, args.budget, args.layers)
        return
    from bench.lib import sysinfo
    from engines.kt.experts.cpuinfer import default_cpu_threads

    threads = [int(t) for t in args.threads.split(",")] if args.threads else [default_cpu_threads()]
    lines, started = [], time.perf_counter()
    for fmt in args.formats.split(","):
        if fmt not in SHAPES:
            p.error(f"--formats: {fmt!r} is not one of {', '.join(SHAPES)}")
        for n in threads:
            cmd = [sys.executable, "-m", "bench.decode_kernel", "--child", fmt, str(n), "--tokens", args.tokens,
                   "--budget", str(args.budget), "--kt" if args.kt else "--no-kt", "--pin" if args.pin else "--no-pin"] + (["--layers", str(args.layers)] if args.layers else [])
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            got = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
            for line in got:
                print(json.dumps(line), flush=True)
            lines += got
            if run.returncode:
                failed = {"format": fmt, "threads": n, "failed": run.stderr[-3000:]}
                print(json.dumps(failed), flush=True)
                lines.append(failed)
    summary = {"cpu": sysinfo.cpu_model(), "elapsed_s": round(time.perf_counter() - started, 1),
               "shapes": {f: SHAPES[f].__dict__ for f in args.formats.split(",")},
               "measurements": [x for x in lines if "ms_per_call" in x],
               "bandwidth": [x for x in lines if "read_GB_s" in x],
               "notes": [x for x in lines if "failed" in x or "kt_kernel" in x]}
    table = {}
    for r in summary["measurements"]:
        table.setdefault(f"{r['format']} {r['impl']} t{r['threads']}", {})[r["tokens"]] = (r["ms_per_call"], r["of_read"])
    summary["table_ms_and_fraction_of_read"] = table
    print(json.dumps({"summary": summary}), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "decode_kernel.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
