"""DeepSeek-V4's hyper-connections on the GPU in one Triton kernel per call (kt_fused_hyper_connections).

transformers' `DeepseekV4HyperConnection` (each layer's `attn_hc` and `ffn_hc`) and `DeepseekV4HyperHead` (the
model's and the MTP block's `hc_head`) spend ~300 small kernels a layer on a token's 24 mixing weights: the
unweighted RMSNorm of the flattened streams, sigmoid and softmax, V4's 20 Sinkhorn iterations on the 4x4 `comb`,
then the collapse of the streams by `pre`. Here the projection stays a cuBLAS GEMM of the raw streams, and since
`F.linear(x * r, W) == r * F.linear(x, W)` the norm's factor `r` is applied to its 24 outputs afterwards: one kernel
per row then reads the row's streams for their sum of squares, computes pre, post and the Sinkhorn-balanced comb in
registers in transformers' order, and reads the streams again (from L2) for the collapse. Outputs are transformers'
(post and comb float32, the collapse in the streams' dtype), so the decoder layers and the CUDA graphs that capture
them are unchanged; every output is allocated at a static shape, so the launch is captured like any other.

Only modules on a CUDA device get the kernel, and only where Triton imports; the others keep transformers' forward
(the CPU path, and where the setting is off)."""
from __future__ import annotations

import functools
import logging
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engines.kt.experts.mapped import triton_available
from engines.kt.layers import device_scope

log = logging.getLogger("ktserve.engine.kt")

BLOCK_H = 1024  # a row's streams are read in [hc, BLOCK_H] tiles, twice


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def hyper(streams_ptr, mixes_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr, norm_eps, hc_eps,
              hidden: tl.constexpr, iters: tl.constexpr, HC: tl.constexpr, HC_P: tl.constexpr, MIXES: tl.constexpr,
              BLOCK: tl.constexpr, HEAD: tl.constexpr):
        """One row (token): streams [HC, hidden] at `streams_ptr + row * HC * hidden`, its raw mixes [MIXES] (the
        projection of the un-normed streams). HEAD: the hyper head (pre only, no post or comb). The model's
        hidden size and Sinkhorn iterations are compile-time constants: one compiled kernel per model."""
        row = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, HC_P)
        h = tl.arange(0, BLOCK)
        streams = streams_ptr + row * HC * hidden
        squares = tl.zeros([HC_P, BLOCK], tl.float32)
        for start in range(0, hidden, BLOCK):
            at = start + h[None, :]
            x = tl.load(streams + s[:, None] * hidden + at, mask=(s[:, None] < HC) & (at < hidden), other=0.0)
            x = x.to(tl.float32)
            squares += x * x
        mean = tl.sum(tl.sum(squares, axis=1), axis=0) / (HC * hidden)
        r = tl.math.div_rn(1.0, tl.sqrt_rn(mean + norm_eps))  # the unweighted RMSNorm's factor
        mixes = mixes_ptr + row * MIXES
        valid = s < HC
        pre_w = tl.load(mixes + s, mask=valid, other=0.0) * r
        pre = tl.sigmoid(pre_w * tl.load(scale_ptr).to(tl.float32)
                       + tl.load(base_ptr + s, mask=valid, other=0.0).to(tl.float32)) + hc_eps
        if not HEAD:
            post_w = tl.load(mixes + HC + s, mask=valid, other=0.0) * r
            post = 2 * tl.sigmoid(post_w * tl.load(scale_ptr + 1).to(tl.float32)
                                + tl.load(base_ptr + HC + s, mask=valid, other=0.0).to(tl.float32))
            tl.store(post_ptr + row * HC + s, post, mask=valid)
            ij = s[:, None] * HC + s[None, :]
            square = valid[:, None] & valid[None, :]
            comb_w = tl.load(mixes + 2 * HC + ij, mask=square, other=0.0) * r
            logits = (comb_w * tl.load(scale_ptr + 2).to(tl.float32)
                      + tl.load(base_ptr + 2 * HC + ij, mask=square, other=0.0).to(tl.float32))
            logits = tl.where(square, logits, float("-inf"))
            top = tl.max(logits, axis=1)
            e = tl.where(square, tl.exp(logits - tl.where(valid, top, 0.0)[:, None]), 0.0)
            total = tl.where(valid, tl.sum(e, axis=1), 1.0)
            comb = tl.where(square, tl.math.div_rn(e, total[:, None]) + hc_eps, 0.0)
            # Sinkhorn as transformers orders it: columns, then (iters - 1) x (rows, columns)
            comb = tl.math.div_rn(comb, tl.sum(comb, axis=0)[None, :] + hc_eps)
            for _ in range(iters - 1):
                comb = tl.math.div_rn(comb, tl.sum(comb, axis=1)[:, None] + hc_eps)
                comb = tl.math.div_rn(comb, tl.sum(comb, axis=0)[None, :] + hc_eps)
            tl.store(comb_ptr + row * HC * HC + ij, comb, mask=square)
        out = out_ptr + row * hidden
        for start in range(0, hidden, BLOCK):
            at = start + h[None, :]
            x = tl.load(streams + s[:, None] * hidden + at, mask=(s[:, None] < HC) & (at < hidden), other=0.0)
            collapsed = tl.sum(x.to(tl.float32) * pre[:, None], axis=0)
            tl.store(out + start + h, collapsed.to(out_ptr.dtype.element_ty), mask=start + h < hidden)

    return triton, hyper


def _launch(streams: torch.Tensor, mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
            hc_eps: float, iters: int, head: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """post [.., hc] float32, comb [.., hc, hc] float32 (both empty for the head) and the collapse [.., hidden] in
    the streams' dtype of streams [.., hc, hidden] and their raw mixes [.., (2 + hc) * hc] (or [.., hc])."""
    triton, hyper = _kernel()
    *lead, hc, hidden = streams.shape
    rows = streams.numel() // (hc * hidden)
    post = streams.new_empty(*lead, 0 if head else hc, dtype=torch.float32)
    comb = streams.new_empty(*lead, 0 if head else hc, 0 if head else hc, dtype=torch.float32)
    collapsed = streams.new_empty(*lead, hidden)
    if rows:
        with device_scope(streams.device):  # Triton launches on the current device: the model's need not be it
            hyper[(rows,)](streams, mixes, base, scale, post, comb, collapsed, norm_eps, hc_eps, hidden=hidden,
                           iters=iters, HC=hc, HC_P=triton.next_power_of_2(hc), MIXES=mixes.shape[-1],
                           BLOCK=min(BLOCK_H, triton.next_power_of_2(hidden)), HEAD=head, num_warps=4)
    return post, comb, collapsed


def _mixes(streams: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """The projection of the flattened, un-normed streams [.., hc * hidden] in float32 (cuBLAS)."""
    return F.linear(streams.flatten(-2).float(), fn.float()).contiguous()


def norm_eps(norm: nn.Module) -> float:
    """The epsilon of transformers' unweighted RMSNorm: `eps` up to transformers 5.24, `variance_epsilon` since."""
    eps = getattr(norm, "variance_epsilon", None)
    return float(norm.eps if eps is None else eps)


def fused_connection(self: nn.Module, hidden_streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`DeepseekV4HyperConnection.forward` (post, comb, collapsed) in one kernel after the projection."""
    streams = hidden_streams.contiguous()
    return _launch(streams, _mixes(streams, self.fn), self.base, self.scale, norm_eps(self.input_norm), self.hc_eps,
                   self.hc_sinkhorn_iters, head=False)


def fused_head(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`DeepseekV4HyperHead.forward`: the streams collapsed by the head's `pre`."""
    streams = x.contiguous()
    return _launch(streams, _mixes(streams, self.hc_fn), self.hc_base, self.hc_scale, norm_eps(self.input_norm),
                   self.eps, 1, head=True)[2]


def install_fused_hyper_connections(model: nn.Module, dtype: torch.dtype, enabled: bool = True) -> str:
    """Give the hyper-connection modules of `model` (and of an MTP block still in it) that sit on a CUDA device the
    fused kernel's forward, compiled for streams of `dtype` before any step runs (or CUDA graph captures) them;
    what the engine details say of it."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4HyperConnection,
                                                                       DeepseekV4HyperHead)

    forwards = {DeepseekV4HyperConnection: fused_connection, DeepseekV4HyperHead: fused_head}
    modules = [m for m in model.modules() if type(m) in forwards]
    on_gpu = [m for m in modules if _on_cuda(m)]
    if not enabled:
        return "transformers' modules: kt_fused_hyper_connections is off"
    if not on_gpu:
        return "transformers' modules: none on a GPU"
    if not triton_available():
        return "transformers' modules: Triton is not installed"
    for module in on_gpu:
        module.forward = types.MethodType(forwards[type(module)], module)
    try:
        _warm_up(on_gpu, dtype)
    except Exception as e:  # noqa: BLE001 - e.g. Triton without a working compiler: transformers' forward serves
        for module in on_gpu:
            del module.forward
        log.warning("kt_fused_hyper_connections: the Triton kernel failed (%s); transformers' modules run", e)
        return f"transformers' modules: the Triton kernel failed ({type(e).__name__})"
    return (f"fused Triton kernel: {len(on_gpu)} of {len(modules)} hyper-connection modules (those on a GPU)"
            + ("; the others keep transformers' forward" if len(on_gpu) < len(modules) else ""))


@torch.inference_mode()
def _warm_up(modules: list[nn.Module], dtype: torch.dtype) -> None:
    """One row through each module: compiles the kernel for its device and form."""
    for module in modules:
        fn = module.fn if hasattr(module, "fn") else module.hc_fn  # [mixes, hc * hidden]
        hc = module.hc_mult
        module(torch.zeros(1, 1, hc, fn.shape[1] // hc, dtype=dtype, device=fn.device))
        torch.cuda.synchronize(fn.device)


def _on_cuda(module: nn.Module) -> bool:
    return all(p.is_cuda for p in module.parameters(recurse=False))


def is_fused(module: Any) -> bool:
    """Whether `module`'s forward is the fused kernel's."""
    forward = getattr(module, "forward", None)
    return getattr(forward, "__func__", None) in (fused_connection, fused_head)
