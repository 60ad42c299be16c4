"""What attention over a prompt chunk costs, per layer: torch's expanded form (the torch backend) against
FlashInfer's paged MLA kernel in the latent space (the flashinfer backend), V2-Lite's attention shape (16
heads, nope 128 + rope 64, values 128, latent 512), bfloat16, one sequence whose chunk of `n` new tokens are
the last of its `length` positions.

`expand`        the cached latents times kv_b (both backends' torch part for prefill: torch only)
`sdpa_mask`     scaled_dot_product_attention on [heads, n, d] tensors with a [n, length] boolean causal mask
                (what the torch backend did before: the unfused math kernel)
`sdpa_causal`   engines.kt.families.deepseek_mla.attention.causal_sdpa, what the torch backend does now: float32 like the math
                kernel, but 4-d tensors and a lower-right causal bias, so the fused kernels run it; on the
                CPU the values are padded to the key width (its flash kernel wants one head width)
`sdpa_causal_padded`  causal_sdpa's float32 call with the values padded on any device (on the GPU what
                causal_sdpa did before 2026-11-25 evening; on the CPU the same as sdpa_causal)
`sdpa_causal_bf16`  the same in bfloat16 (the flash kernels' precision: probabilities rounded to bf16)
`flashinfer`    BatchMLAPagedAttentionWrapper planned for the chunk (plan excluded) and run over 64-token
                pages (needs flashinfer)

    python -m bench.prefill_attention [--shapes 128x2048,2048x2048,8192x8192] [--device cuda]

Milliseconds, median of `--repeats` after a warm-up, CUDA events on a GPU; `*_mean_abs_err` against float64
(outputs of scale ~0.1). One JSON line per shape."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch

HEADS, NOPE, ROPE, V_DIM, LATENT, BLOCK = 16, 128, 64, 128, 512, 64
SCALE = (NOPE + ROPE) ** -0.5


def _time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    return round(statistics.median(times), 3)


def measure(n: int, length: int, device: torch.device, repeats: int) -> dict:
    from torch.nn.attention.bias import causal_lower_right

    from engines.kt.families.deepseek_mla.attention import causal_sdpa

    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=torch.bfloat16)

    latent, k_pe = rand(length, LATENT), rand(length, ROPE)
    kv_b = rand(HEADS * (NOPE + V_DIM), LATENT) * LATENT ** -0.5
    q_nope, q_pe = rand(n, HEADS, NOPE), rand(n, HEADS, ROPE)
    kv = (latent @ kv_b.T).view(length, HEADS, NOPE + V_DIM)
    k_nope, v = kv.split([NOPE, V_DIM], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, HEADS, -1)], dim=-1).transpose(0, 1)
    v = v.transpose(0, 1)
    mask = torch.arange(length, device=device).unsqueeze(0) <= torch.arange(length - n, length, device=device
                                                                            ).unsqueeze(1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    padded, bias = torch.nn.functional.pad(v, (0, NOPE + ROPE - V_DIM)).unsqueeze(0), causal_lower_right(n, length)
    variants = {
        "sdpa_mask": lambda: sdpa(q, k, v, attn_mask=mask, scale=SCALE),
        "sdpa_causal": lambda: causal_sdpa(q, k, v, SCALE),
        "sdpa_causal_padded": lambda: sdpa(q.float().unsqueeze(0), k.float().unsqueeze(0), padded.float(),
                                           attn_mask=bias, scale=SCALE)[0, ..., :V_DIM].to(q.dtype),
        "sdpa_causal_bf16": lambda: sdpa(q.unsqueeze(0), k.unsqueeze(0), padded, attn_mask=bias,
                                         scale=SCALE)[0, ..., :V_DIM],
    }
    reference = sdpa(q.double(), k.double(), v.double(), attn_mask=mask, scale=SCALE)
    row = {"tokens": n, "length": length, "device": str(device)}
    row["expand"] = _time(lambda: latent @ kv_b.T, device, repeats)
    for name, run in variants.items():
        row[name] = _time(run, device, repeats)
    for name, run in variants.items():
        row[f"{name}_mean_abs_err"] = float(f"{(run().float() - reference).abs().mean().item():.3g}")
    if device.type == "cuda":
        row["flashinfer"] = _flashinfer(n, length, latent, k_pe, q_nope, kv_b, q_pe, device, repeats)
    return row


def _flashinfer(n, length, latent, k_pe, q_nope, kv_b, q_pe, device, repeats) -> float | str:
    try:
        from engines.kt.families.deepseek_mla.flashinfer import FlashInferMLA, MLAShape
        flash = FlashInferMLA(MLAShape(HEADS, LATENT, ROPE, BLOCK, SCALE, torch.bfloat16, torch.bfloat16))
        paged = flash.eager(device)
    except ImportError as exc:
        return f"not run: {exc}"
    pages = -(-length // BLOCK)
    ckv = torch.zeros(pages * BLOCK, LATENT, dtype=torch.bfloat16, device=device)
    kpe = torch.zeros(pages * BLOCK, ROPE, dtype=torch.bfloat16, device=device)
    ckv[:length], kpe[:length] = latent, k_pe

    class Cache:  # the one method PagedMLA.run reads
        @staticmethod
        def pages(layer: int):
            return ckv.view(pages, BLOCK, LATENT), kpe.view(pages, BLOCK, ROPE)

    w_k = kv_b.view(HEADS, NOPE + V_DIM, LATENT)[:, :NOPE]
    q_latent = torch.einsum("nhd,hdr->nhr", q_nope, w_k)
    paged.plan([n], [length], [list(range(pages))], causal=True)
    return _time(lambda: paged.run(q_latent, q_pe, Cache, 0), device, repeats)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="128x2048,512x2048,2048x2048,2048x8192,8192x8192,128x16384")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    for shape in args.shapes.split(","):
        n, length = (int(x) for x in shape.split("x"))
        print(json.dumps(measure(n, length, device, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
