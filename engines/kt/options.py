"""The ktransformers engine's own settings. The server passes them through untouched
(`EngineConfig.settings`, keyed by their settings names); `KTEngine` reads them with `engine_options`."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KTOptions:
    kt_optimize_rule: str | None = None  # rule file (engine.py: resolve_rule_file); None: this machine's default
    cpu_infer: int | None = None  # kt-kernel worker threads; None: engines/kt/experts/cpuinfer.py's default
    kt_method: str | None = None  # override of the rules' experts method (engines/kt/experts/methods.py)
    kt_strict_placement: bool = False  # a rule device this machine lacks is an error, not folded
    kt_weight_cache: str | None = None  # root folder of pre-quantized experts
    kt_weight_path: str | None = None  # kt-kernel's pre-converted experts (expert_cache.ConvertedExperts), read-only
    kt_use_cuda_graph: bool = True  # capture decode steps in CUDA graphs (one-GPU placements, no hot experts; V4: piecewise)
    kt_fused_hyper_connections: bool = True  # V4: the GPU's hyper-connections in one Triton kernel each (hyper.py)
    kv_cache_tokens: int | None = None  # KV capacity in tokens; default from max_model_len x max_concurrent
    prefix_cache: bool = True  # share full KV pages between requests with the same token prefix
    attention_backend: str = "auto"  # "auto" | "flashinfer" | "torch" (MLA attention on CUDA)
    # GPU placements: other threads leave kt-kernel's worker cores (experts/cpuinfer.py)
    kt_isolate_workers: bool = True
    # expert calls this large (chunks, decode batches) stream part to the GPU; 0: off; None: where the host holds the
    # copies (engines/kt/experts/notes.py: streamed_prefill)
    kt_gpu_prefill_tokens: int | None = None
    kt_gpu_prefill_memory: float | None = None  # GB of host memory the streamed copies may take; None: every expert
    kt_gpu_read_experts: int | None = None  # experts the GPU reads from host memory (experts/mapped.py); None: auto
    kt_gpu_resident_experts: int = 0  # experts of each MoE layer kept in GPU memory (experts/mapped.py); 0: none
    gguf_path: str | None = None  # a GGUF checkpoint; model_path then holds config and tokenizer (engines/checkpoints/formats.py: open_source)
    # which requests run in batch-invariant steps (engines/runtime/batch_invariance.py: POLICIES)
    batch_invariant: str = "scores"
    kt_expert_pad_from: int | None = None  # expert calls this large go padded to kt-kernel's matrix path; 0: never
    # decode-sized expert calls on our own CPU kernel: auto | on | off (engines/kt/experts/decode_calls.py)
    kt_decode_kernel: str = "auto"
