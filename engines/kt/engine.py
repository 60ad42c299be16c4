"""The "ktransformers" engine: DeepSeek V2/V2-Lite/V3/R1 with the routed experts on the CPU (kt-kernel)
and everything else where the placement rules put it, usually one GPU.

Choosing a rule file: `kt_optimize_rule` when given (a path, or a file name in kt_optimize_rules/);
otherwise the CPU-only file on a machine without CUDA, and the single-GPU file for the architecture when
there is one."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from engines.base import ModelInfo
from engines.kt.flashinfer_mla import attention_for
from engines.kt.kv_cache import LatentKVCache
from engines.kt.loader import load_checkpoint, missing_tensors
from engines.kt.runner import KTModelRunner, layer_devices, uses_cpu_experts
from engines.model_files import context_length, eos_token_ids, load_tokenizer, model_id, resolve_dtype
from engines.runtime.llm_engine import LLMEngine
from engines.runtime.model_runner import ModelRunner

log = logging.getLogger("ktserve.engine.kt")

RULES_DIR = Path(__file__).resolve().parents[2] / "kt_optimize_rules"
SUPPORTED_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
CPU_RULES = "DeepSeek-CPU.yaml"
DEFAULT_KV_BUDGET_TOKENS = 65536
# Without kt_maxlen / max_model_len, serve at most this context: DeepSeek configs declare 128k-160k positions,
# which would make every default-length request reserve a cache that large.
DEFAULT_MAX_MODEL_LEN = 16384


def default_rule_file(config: Any) -> str:
    if not torch.cuda.is_available():
        return CPU_RULES
    if config.model_type == "deepseek_v3":
        return "DeepSeek-V3.yaml"
    small = getattr(config, "n_routed_experts", 0) <= 64 and config.hidden_size <= 2048
    return "DeepSeek-V2-Lite.yaml" if small else "DeepSeek-V2.yaml"


def resolve_rule_file(name: str | None, config: Any) -> Path:
    name = name or default_rule_file(config)
    path = Path(name)
    if not path.is_file():
        path = RULES_DIR / name
    if not path.is_file():
        shipped = ", ".join(sorted(p.name for p in RULES_DIR.glob("*.yaml")))
        raise ValueError(f"kt_optimize_rule: {name!r} is neither a file nor one of the shipped rules ({shipped})")
    return path


def _check_devices(placement: Any, rule_file: Path) -> None:
    wanted = {d for d in placement.devices.values() if d.startswith("cuda")}
    if wanted and not torch.cuda.is_available():
        raise ValueError(f"kt_optimize_rule {rule_file.name} places modules on {', '.join(sorted(wanted))}, but "
                         f"this machine has no CUDA GPU; use {CPU_RULES} (the default without a GPU)")
    for device in wanted:
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"kt_optimize_rule {rule_file.name} uses {device}, but only "
                             f"{torch.cuda.device_count()} GPU(s) are visible")


def _cores_left_by_experts(cpu_infer: int | None) -> int:
    """torch's own CPU thread pool spins (OpenMP keeps idle threads busy ~200 ms) on the cores kt-kernel's
    workers are pinned to: small torch ops took 10 ms instead of 0.15 ms on the CPU box, and decode steps on
    the H200 box took a flat 216 ms instead of 34 ms. torch gets the cores kt-kernel leaves."""
    from engines.kt.cpuinfer import physical_cores, resolve_thread_count

    return max(1, physical_cores() - resolve_thread_count(cpu_infer))


class KTEngine(LLMEngine):
    name = "ktransformers"

    def _load(self) -> tuple[ModelRunner, Any, ModelInfo]:
        from transformers import AutoConfig, AutoModelForCausalLM

        from engines.kt.rules import apply_placement, load_rules, plan_placement

        cfg = self.config
        started = time.perf_counter()
        model_path = Path(cfg.model_path)
        config = AutoConfig.from_pretrained(model_path)
        arch = (config.architectures or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model: the ktransformers engine serves {', '.join(SUPPORTED_ARCHITECTURES)}; "
                             f"{model_path} is {arch} (use the huggingface engine)")
        tokenizer = load_tokenizer(str(model_path), cfg.template)
        max_len = context_length(config, tokenizer, cfg.max_model_len)
        if cfg.max_model_len is None and max_len > DEFAULT_MAX_MODEL_LEN:
            log.info("serving a context of %d tokens (the model allows %d; raise it with kt_maxlen)",
                     DEFAULT_MAX_MODEL_LEN, max_len)
            max_len = DEFAULT_MAX_MODEL_LEN
        # runtime knobs the operators read when the rules build them
        config.kt_max_tokens = cfg.chunk_size + cfg.max_concurrent
        config.kt_cpu_threads = cfg.cpu_infer
        config.kt_method_override = cfg.kt_method
        rule_file = resolve_rule_file(cfg.kt_optimize_rule, config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        placement = plan_placement(model, load_rules(rule_file), default_device="cpu")
        _check_devices(placement, rule_file)
        apply_placement(model, placement, config)
        gpu = any(d.startswith("cuda") for d in placement.devices.values())
        dtype = resolve_dtype(cfg.dtype, torch.device("cuda" if gpu else "cpu"))
        load_checkpoint(model, model_path, placement.device_of_param, dtype, config.num_hidden_layers,
                        getattr(config, "n_routed_experts", None) or config.num_experts,
                        weight_cache=self._weight_cache_dir(model_path))
        self._finish_model(model, config, placement)
        model.eval()
        devices = layer_devices(model)
        cache = LatentKVCache(layer_devices=devices, num_tokens=self._kv_tokens(max_len),
                              latent_dim=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim, dtype=dtype,
                              prefix_cache=cfg.prefix_cache)
        flash = attention_for(cfg.attention_backend, model.model.layers[0].self_attn, devices, cache)
        runner = KTModelRunner(model, devices, cache, max_len, flash=flash)
        if uses_cpu_experts(model):
            self.torch_threads = _cores_left_by_experts(cfg.cpu_infer)
            torch.set_num_threads(self.torch_threads)
        if cfg.kt_use_cuda_graph:
            if gpu:
                runner.capture_decode_graphs(cfg.max_concurrent)
            else:
                log.info("kt_use_cuda_graph: no GPU in the placement; decode runs without CUDA graphs")
        log.info("loaded %s with %s (%s, experts on the CPU: %s) in %.1fs", model_path.name, rule_file.name, dtype,
                 uses_cpu_experts(model), time.perf_counter() - started)
        info = ModelInfo(id=model_id(cfg), max_model_len=max_len, architecture=arch, engine=self.name,
                         created=int(time.time()), eos_token_ids=eos_token_ids(config, tokenizer, model_path))
        return runner, tokenizer, info

    def _kv_tokens(self, max_len: int) -> int:
        """KV capacity: as configured, else room for a few full-length requests within a fixed budget
        (64k positions: 2 GB for V2-Lite's 27 layers x 576 bf16 values), never less than one request."""
        if self.config.kv_cache_tokens:
            return self.config.kv_cache_tokens
        return max(max_len, min(max_len * min(self.config.max_concurrent, 4), DEFAULT_KV_BUDGET_TOKENS))

    def _weight_cache_dir(self, model_path: Path) -> Path | None:
        """Pre-quantized experts live under the cache root, one folder per model and expert method."""
        if not self.config.kt_weight_cache:
            return None
        method = (self.config.kt_method or "rules").upper()
        return Path(self.config.kt_weight_cache) / f"{model_path.resolve().name}-{method}"

    @staticmethod
    def _finish_model(model: Any, config: Any, placement: Any) -> None:
        """What the checkpoint does not carry: the rotary tables (computed) and a tied LM head."""
        rotary = model.model.rotary_emb
        device = placement.device_of_param("model.rotary_emb.inv_freq")
        with torch.device(device):
            model.model.rotary_emb = type(rotary)(config=config)
        if getattr(config, "tie_word_embeddings", False) and model.lm_head.weight.is_meta:
            model.lm_head.weight = model.model.embed_tokens.weight
        missing = missing_tensors(model)
        if missing:
            raise ValueError(f"model: the checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:5])}")
