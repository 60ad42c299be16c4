"""DeepSeek V2 / V2-Lite / V3 / R1 / V3.1 (MLA attention, `model_type` deepseek_v2 / deepseek_v3, and checkpoints
of those architectures under a model type of their own, e.g. Kimi-K2's kimi_k2): the family the KT engine serves
every `model_type` the registry does not list with, and the base of V3.2's."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from engines.checkpoints.source import PER_EXPERT
from engines.kt.families.deepseek_mla import mtp
from engines.kt.families.deepseek_mla.flashinfer import attention_for
from engines.kt.families.deepseek_mla.kv_cache import PAGE_TOKENS, LatentKVCache
from engines.kt.experts.cpu import RoutedExpertsCPU
from engines.kt.families.base import ExpertLayout, LoadContext, ModelFamily
from engines.kt.families.deepseek_mla import load
from engines.kt.loader import load_checkpoint
from engines.kt.placement.operators import fuse_rms_norms, uses_cpu_experts
from engines.kt.families.deepseek_mla.runner import KTModelRunner
from engines.kt.layers import device_scope, layer_devices

log = logging.getLogger("ktserve.engine.kt")

# the architectures served, and the transformers config class each loads with
SUPPORTED_ARCHITECTURES = {"DeepseekV2ForCausalLM": "DeepseekV2Config", "DeepseekV3ForCausalLM": "DeepseekV3Config"}
CPU_RULES = "DeepSeek-CPU.yaml"


class MLAFamily(ModelFamily):
    """DeepSeek V2 / V2-Lite / V3 / R1 (and checkpoints of those architectures under their own model_type, e.g.
    Kimi-K2) behind engines/kt/families/base.py's interface (the load's hooks: engines/kt/build.py); the base of the MLA generations
    that add to it (V3.2)."""

    name = "deepseek_mla"
    model_types = ("deepseek_v2", "deepseek_v3")
    architectures = tuple(SUPPORTED_ARCHITECTURES)
    expert_layout = ExpertLayout(pattern=PER_EXPERT, projections={"gate_proj": "gate", "up_proj": "up",
                                                                  "down_proj": "down"}, format="bf16")

    def __init__(self, architecture: str | None = None):
        if architecture is not None:  # the one this checkpoint names, for the model info
            self.architectures = (architecture,)

    def read_config(self, model_path: Path) -> Any:
        """The config class of the architecture, not of the `model_type`: checkpoints of this architecture under a
        model type of their own (Kimi-K2's kimi_k2) load without their remote code."""
        import transformers  # heavy, and only a load needs it

        return getattr(transformers, SUPPORTED_ARCHITECTURES[self.architectures[0]]).from_pretrained(model_path)

    def default_rule_file(self, config: Any, gpus: int) -> str:
        if not gpus:
            return CPU_RULES
        if config.model_type == "deepseek_v3":
            return "DeepSeek-V3.yaml"
        small = getattr(config, "n_routed_experts", 0) <= 64 and config.hidden_size <= 2048
        return "DeepSeek-V2-Lite.yaml" if small else "DeepSeek-V2.yaml"

    def build_model(self, config: Any) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)

    def checkpoint_name(self, name: str) -> str | None:
        return name

    # what a later generation changes (V3.2): whether FlashInfer's dense paged MLA may attend, and the cache
    dense_attention = True

    def make_cache(self, config: Any, **kwargs: Any) -> LatentKVCache:
        """The cache the layers attend over, from LatentKVCache's arguments."""
        return LatentKVCache(**kwargs)

    def draft_layer(self, context: LoadContext) -> tuple[int | None, str | None]:
        return load.draft_layer(context)

    def checkpoint_source(self, context: LoadContext, draft_layer: int | None) -> Any:
        """The layers read: the MTP layer only to draft with, and then not its copies of the embedding and LM
        head."""
        drafting = draft_layer is not None
        return context.source.for_layers(context.config.num_hidden_layers + drafting,
                                         skip=mtp.SHARED_COPIES if drafting else None)

    def converted_experts(self, context: LoadContext) -> tuple[Any, str | None]:
        return load.converted_experts(context.options, context.config)

    def add_draft_layer(self, model: torch.nn.Module, config: Any) -> None:
        mtp.add_layer(model, config)

    def load_weights(self, build: Any) -> Any:
        config, source = build.config, build.source
        storage = load_checkpoint(build.model, source, build.placement.device_of_param, build.dtype,
                                  getattr(config, "n_routed_experts", None) or config.num_experts,
                                  weight_cache=load.weight_cache_dir(build.kt, source.path),
                                  converted=build.converted)
        load.finish_model(build.model, config, build.placement)
        return storage

    def finish_model(self, build: Any) -> None:
        fused = fuse_rms_norms(build.model)
        if fused:
            log.info("%d RMSNorms on the GPU run as one fused kernel each", fused)

    def take_draft_head(self, build: Any) -> Any:
        return mtp.MTPHead.take(build.model, device_scope)

    def make_runner(self, build: Any) -> tuple[KTModelRunner, int]:
        """The KT runner over the paged latent KV cache (one page more than asked: the runner's scratch page, which
        no request uses), FlashInfer's paged MLA where it may attend."""
        context, config, kt, head = build.context, build.config, build.kt, build.draft_head
        devices = layer_devices(build.model)
        max_len, kv_tokens = context.max_model_len, context.kv_cache_tokens()
        if kv_tokens < max_len:  # a request longer than the cache could never finish
            log.info("serving a context of %d tokens: the KV cache (kv_cache_tokens) holds no more", kv_tokens)
            max_len = kv_tokens
        cache_devices = devices + ([head.device] if head is not None else [])  # the draft head's own KV layer
        cache = self.make_cache(config, layer_devices=cache_devices, num_tokens=kv_tokens + PAGE_TOKENS,
                                latent_dim=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim, dtype=build.dtype,
                                prefix_cache=kt.prefix_cache)
        backend = kt.attention_backend if self.dense_attention else load.dense_only(kt.attention_backend, self)
        flash = attention_for(backend, build.model.model.layers[0].self_attn, cache_devices, cache)
        build.details["attention_backend"] = "torch" if flash is None else "flashinfer"
        return KTModelRunner(build.model, devices, cache, max_len, flash=flash, draft_head=head,
                             draft_unavailable=build.no_draft), max_len

    def finish_runner(self, build: Any, runner: KTModelRunner) -> None:
        """Decode graphs; kt-kernel's workers on cores of their own; what pads and defers expert calls."""
        kt, model, details, head = build.kt, build.model, build.details, build.draft_head
        if kt.kt_use_cuda_graph:
            if build.gpu:
                runner.capture_decode_graphs(build.context.decode_rows(head is not None))
            else:
                log.info("kt_use_cuda_graph: no GPU in the placement; decode runs without CUDA graphs")
        cpu_experts = uses_cpu_experts(model)
        if cpu_experts and all(d.type == "cuda" for d in layer_devices(model)):
            # every thread but kt-kernel's workers is GPU-side work (launching, sampling, the stream callbacks)
            if kt.kt_isolate_workers:
                log.info("kt_isolate_workers: %s", runner.isolation.apply())
            else:
                log.info("kt_isolate_workers off: other threads may run on kt-kernel's worker cores")
        padded = sorted({(r.start, r.stop) for m in model.modules() if isinstance(m, RoutedExpertsCPU)
                         for r in [m.padded_tokens()] if r})
        if padded:
            log.info("expert calls of %s tokens go padded to %s rows, where kt-kernel's matrix kernels take them "
                     "(kt_expert_pad_from)", "/".join(f"{a}-{b - 1}" for a, b in padded),
                     "/".join(str(b) for _, b in padded))
        if runner.deferring:
            counts = sorted({layer.deferred for layer in runner.deferring})
            log.info("expert deferral: in decode steps of up to %d sequences, %s of each token's %d experts in %d "
                     "layers run one layer late, overlapping the next layer (n_deferred_experts in %s)",
                     runner.defer_max_batch, "/".join(map(str, counts)), runner.deferring[0].top_k,
                     len(runner.deferring), build.context.rule_file.name)
        log.info("%s: %s, experts on the CPU: %s", build.context.model_path.name, build.dtype, cpu_experts)
        if runner.isolation.spare:
            details["server_thread_cores"] = ",".join(map(str, sorted(runner.isolation.spare)))
        if padded:
            details["expert_pad_from"] = str(min(a for a, _ in padded))
        if runner.deferring:
            details["experts_deferred"] = str(max(layer.deferred for layer in runner.deferring))
        if head is not None:
            details["speculative"] = f"mtp (model.layers.{build.draft_layer})"
