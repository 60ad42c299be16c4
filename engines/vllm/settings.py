"""Our engine settings -> vLLM's `AsyncEngineArgs`, and the checks that turn vLLM's deep start-up failures
into a message naming the setting or the model property at fault.

LLaMA-Factory's vLLM keys are honoured: `vllm_maxlen` (our `max_model_len`), `vllm_gpu_util`,
`vllm_enforce_eager`, `vllm_max_lora_rank` and `vllm_config` (a mapping of any further `AsyncEngineArgs`
field, e.g. `{kv_cache_memory_bytes: 2000000000}`): `VLLMOptions`, read from `EngineConfig.settings`."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from engines.base import EngineConfig

# vLLM's CPU MLA kernel is compiled for DeepSeek-V2/V3's latent width only (vllm/v1/attention/backends/mla/cpu_mla.py)
CPU_MLA_HEAD_SIZE = 576
# On a CPU with AMX, vLLM picks its AMX MLA backend, which packs the weights for bfloat16 only and fails to load
# a float32 (or float16) model; its reference CPU MLA backend computes in any dtype.
AMX_MLA_DTYPE = "bfloat16"
# What our API can ask for: chat `top_logprobs` goes up to 20.
MAX_LOGPROBS = 20
# With LoRA on, vLLM runs every MoE layer through its Triton kernels (vllm/model_executor/layers/fused_moe/
# oracle/unquantized.py), which have no CPU backend: the first request would kill the engine.
CPU_MOE_LORA = ("vLLM's CPU build cannot serve LoRA adapters on a mixture-of-experts model (with LoRA on, it runs "
                "the MoE layers through Triton kernels, which have no CPU backend); serve adapters on this model "
                "with the huggingface or ktransformers engine, or with vLLM on a CUDA machine")


@dataclass(frozen=True, slots=True)
class VLLMOptions:
    vllm_gpu_util: float = 0.9  # share of GPU memory vLLM may take (CUDA only)
    vllm_enforce_eager: bool | None = None  # None: eager on the CPU, CUDA graphs on a GPU
    vllm_max_lora_rank: int = 32
    vllm_config: Mapping[str, Any] = field(default_factory=dict)  # further AsyncEngineArgs fields


def on_cuda() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


def model_config(model_path: str) -> dict[str, Any]:
    config_file = Path(model_path) / "config.json"
    return json.loads(config_file.read_text()) if config_file.is_file() else {}


def is_moe(config: dict[str, Any]) -> bool:
    return any(config.get(key) for key in ("n_routed_experts", "num_experts", "num_local_experts"))


def cpu_lora_refusal(model_path: str) -> str | None:
    """Why this machine's vLLM cannot serve LoRA adapters on the model, or None when it can."""
    return CPU_MOE_LORA if not on_cuda() and is_moe(model_config(model_path)) else None


def check_model(model_path: str, lora: bool) -> None:
    """Refuse, with the reason, a model (or LoRA on it) that vLLM's CPU backend would fail on only at its
    first request, taking the engine down."""
    if on_cuda():
        return
    config = model_config(model_path)
    if lora and is_moe(config):
        raise ValueError(f"adapters: {CPU_MOE_LORA}")
    kv_rank = config.get("kv_lora_rank")
    if kv_rank is None:  # not MLA
        return
    head = kv_rank + config.get("qk_rope_head_dim", 0)
    if head != CPU_MLA_HEAD_SIZE:
        raise ValueError(
            f"model: vLLM's CPU backend runs MLA attention only with kv_lora_rank + qk_rope_head_dim = "
            f"{CPU_MLA_HEAD_SIZE} (DeepSeek-V2/V3's 512 + 64); {model_path} has {kv_rank} + "
            f"{config.get('qk_rope_head_dim', 0)} = {head}. Serve it with the huggingface or ktransformers engine, "
            f"or on a CUDA machine")


def engine_args(cfg: EngineConfig, options: VLLMOptions) -> Any:
    """The `AsyncEngineArgs` for `cfg`; ValueError naming the key for a `vllm_config` entry vLLM lacks."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    cuda = on_cuda()
    eager = not cuda if options.vllm_enforce_eager is None else options.vllm_enforce_eager
    args: dict[str, Any] = dict(
        model=cfg.model_path, tokenizer=cfg.model_path, served_model_name=[cfg.model_name or cfg.model_path],
        trust_remote_code=cfg.trust_remote_code, dtype=_dtype(cfg.dtype, cuda), max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_concurrent, max_logprobs=MAX_LOGPROBS, seed=0,
        enforce_eager=eager, disable_log_stats=True,
        structured_outputs_config={"backend": "guidance"},
    )
    if cuda:
        args["gpu_memory_utilization"] = options.vllm_gpu_util
    else:  # vLLM's CPU default takes a large share of RAM; 1 GiB holds ~16k tokens of DeepSeek-V2-Lite's cache
        args["kv_cache_memory_bytes"] = 1 << 30
        if "kv_lora_rank" in model_config(cfg.model_path) and args["dtype"] != AMX_MLA_DTYPE:
            args["attention_backend"] = "CPU_MLA"
    overrides = dict(options.vllm_config)
    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    for key in overrides:
        if key not in known:
            raise ValueError(f"vllm_config.{key}: not a vLLM engine argument (see vLLM's AsyncEngineArgs)")
    if cfg.adapters or overrides.get("enable_lora"):
        args.update(enable_lora=True, max_lora_rank=options.vllm_max_lora_rank,
                    max_loras=max(len(cfg.adapters), 4))
    if "attention_config" in overrides:  # vLLM refuses a backend given both ways
        args.pop("attention_backend", None)
    args.update(overrides)
    return AsyncEngineArgs(**args)


def _dtype(name: str, cuda: bool) -> str:
    """"auto" is bfloat16 on a GPU and float32 on the CPU, as for the other engines (vLLM's own "auto" would
    take the checkpoint's bfloat16 on the CPU too)."""
    if name == "auto":
        return "bfloat16" if cuda else "float32"
    return name
