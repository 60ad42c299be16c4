"""MLA attention through FlashInfer's paged MLA kernel (`BatchMLAPagedAttentionWrapper`) on our latent cache.

The kernel attends in the latent space (the absorbed form): the query arrives already multiplied by kv_b's
key half ([tokens, heads, kv_lora_rank] plus the rotary part), the output leaves in the latent space and is
expanded by kv_b's value half afterwards, so LoRA on kv_b stays in torch around it. It reads our pages in
place: the cache's [blocks * 64, latent + rope] tensor viewed as [blocks, 64, latent] and [blocks, 64, rope].

A step is planned once (host-side work and small copies) and run by every layer on that device. Under CUDA
graphs each batch-size bucket has its own wrapper whose index buffers have fixed addresses: planning
rewrites their contents outside the graph, the captured kernel reads them at replay.

FlashInfer compiles its kernels with nvcc the first time a shape is planned (about 30 s) and keeps them in
its JIT cache (FLASHINFER_WORKSPACE_BASE, default ~/.cache/flashinfer)."""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

log = logging.getLogger("ktserve.engine.kt")

# DeepSeek-V2/V3's MLA shape: the only one FlashInfer's MLA kernels are built and tested for (its fa2 kernel
# loads the rotary query in 64-wide pieces, so a 16-wide one would be silently dropped).
SUPPORTED_DIMS = (512, 64)
MIN_CAPABILITY = (8, 0)
WORKSPACE_BYTES = 128 * 1024 * 1024


def choose_backend(requested: str, devices: list[torch.device], latent_dim: int, rope_dim: int
                   ) -> tuple[str, str]:
    """("flashinfer" | "torch", why). `requested` "flashinfer" that cannot run is a start-up error."""
    if requested == "torch":
        return "torch", "attention_backend is torch"
    problem = _flashinfer_problem(devices, latent_dim, rope_dim)
    if problem is None:
        return "flashinfer", f"attention_backend is {requested} and FlashInfer supports this GPU and model"
    if requested == "flashinfer":
        raise ValueError(f"attention_backend: flashinfer cannot run here: {problem}")
    return "torch", problem


def _flashinfer_problem(devices: list[torch.device], latent_dim: int, rope_dim: int) -> str | None:
    if not devices or any(d.type != "cuda" for d in devices):
        return "attention runs on the CPU (FlashInfer needs every attention layer on a CUDA GPU)"
    for device in set(devices):
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            return f"{torch.cuda.get_device_name(device)} is SM {capability[0]}.{capability[1]}; FlashInfer needs 8.0+"
    if (latent_dim, rope_dim) != SUPPORTED_DIMS:
        return (f"the model's MLA has kv_lora_rank {latent_dim} and qk_rope_head_dim {rope_dim}; FlashInfer's MLA "
                f"kernels support {SUPPORTED_DIMS[0]} and {SUPPORTED_DIMS[1]} (DeepSeek-V2/V3)")
    try:
        import flashinfer  # noqa: F401
    except ImportError as exc:
        return f"flashinfer does not import ({exc}); install ktserve[gpu]"
    return None


class PagedMLA:
    """One FlashInfer MLA wrapper, planned for one step at a time."""

    def __init__(self, wrapper: Any, shape: "MLAShape", capacity: int | None = None):
        self.wrapper = wrapper
        self.shape = shape
        self.capacity = capacity  # rows of a CUDA-graph wrapper, whose buffers have this fixed size

    def plan(self, q_lens: list[int], kv_lens: list[int], pages: list[list[int]], causal: bool) -> "PagedMLA":
        """Rows of sequence i are the last q_lens[i] of its kv_lens[i] positions, held in `pages[i]`."""
        s = self.shape
        qo_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
        kv_indptr = torch.zeros(len(pages) + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.tensor([len(p) for p in pages], dtype=torch.int32).cumsum(0)
        indices = torch.tensor([b for p in pages for b in p], dtype=torch.int32)
        self.wrapper.plan(qo_indptr, kv_indptr, indices, torch.tensor(kv_lens, dtype=torch.int32), s.heads,
                          s.latent, s.rope, s.block_size, causal, s.scale, s.dtype, s.cache_dtype)
        return self

    def run(self, q_latent: torch.Tensor, q_pe: torch.Tensor, cache: Any, layer: int) -> torch.Tensor:
        """[tokens, heads, latent] attention output, in the latent space."""
        ckv, kpe = cache.pages(layer)
        return self.wrapper.run(q_latent.contiguous(), q_pe.contiguous(), ckv, kpe)


class MLAShape:
    def __init__(self, heads: int, latent: int, rope: int, block_size: int, scale: float, dtype: torch.dtype,
                 cache_dtype: torch.dtype):
        self.heads, self.latent, self.rope, self.block_size = heads, latent, rope, block_size
        self.scale, self.dtype, self.cache_dtype = scale, dtype, cache_dtype


class FlashInferMLA:
    """Wrappers for one model: an eager one per device and one per CUDA-graph batch bucket, sharing a float
    workspace per device."""

    def __init__(self, shape: MLAShape):
        self.shape = shape
        self._workspaces: dict[torch.device, torch.Tensor] = {}
        self._eager: dict[torch.device, PagedMLA] = {}

    def _workspace(self, device: torch.device) -> torch.Tensor:
        if device not in self._workspaces:
            self._workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspaces[device]

    def eager(self, device: torch.device) -> PagedMLA:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        if device not in self._eager:
            self._eager[device] = PagedMLA(BatchMLAPagedAttentionWrapper(self._workspace(device)), self.shape)
        return self._eager[device]

    def for_graph(self, device: torch.device, batch: int, max_pages: int) -> PagedMLA:
        """A wrapper for decode steps of exactly `batch` rows (padded), each over at most `max_pages` pages."""
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        def buffer(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        wrapper = BatchMLAPagedAttentionWrapper(self._workspace(device), use_cuda_graph=True,
                                                qo_indptr=buffer(batch + 1), kv_indptr=buffer(batch + 1),
                                                kv_indices=buffer(batch * max_pages), kv_len_arr=buffer(batch))
        return PagedMLA(wrapper, self.shape, capacity=batch)

    def plan_spans(self, device: torch.device, spans: list[Any]) -> PagedMLA:
        """Plan the eager wrapper of `device` for a step's spans (rows [row, row + n) attend causally over
        positions [0, start + n) of pages `span.blocks`)."""
        return self.eager(device).plan([s.n for s in spans], [s.start + s.n for s in spans],
                                       [s.blocks for s in spans], causal=True)


def attention_for(requested: str, attention: Any, devices: list[torch.device], cache: Any) -> FlashInferMLA | None:
    """The FlashInfer attention for a model whose first MLA layer is `attention`, or None for torch; logs
    which one runs and why."""
    backend, why = choose_backend(requested, devices, cache.latent_dim, cache.rope_dim)
    if backend == "torch":
        log.info("MLA attention: torch (%s)", why)
        return None
    dtype = cache.layers[0].dtype
    flash = FlashInferMLA(MLAShape(attention.num_heads, cache.latent_dim, cache.rope_dim, cache.block_size,
                                   attention.scaling, dtype, dtype))
    started = time.perf_counter()
    try:  # compile (or load from the JIT cache) now rather than in the first request
        for device in sorted(set(devices), key=str):
            q = torch.zeros(1, attention.num_heads, cache.latent_dim, dtype=dtype, device=device)
            pe = torch.zeros(1, attention.num_heads, cache.rope_dim, dtype=dtype, device=device)
            layer = devices.index(device)
            flash.eager(device).plan([1], [1], [[0]], causal=False).run(q, pe, cache, layer)
            torch.cuda.synchronize(device)
    except Exception as exc:  # no nvcc, an unsupported GPU build, ...
        if requested == "flashinfer":
            raise ValueError(f"attention_backend: flashinfer failed to build or run its kernel: {exc}") from exc
        log.warning("MLA attention: torch (FlashInfer failed to build or run its kernel: %s)", exc)
        return None
    log.info("MLA attention: flashinfer (%s; kernels ready in %.1fs)", why, time.perf_counter() - started)
    return flash
