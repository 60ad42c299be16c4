"""How the MLA generations (V2, V3, V3.2) load: `load_mla` builds the model on the meta device, places it by the
rules, streams the checkpoint in and returns the KT runner over the latent KV cache; an `MLAVariant` says what a
later generation changes (V3.2: its cache and attention)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from engines.kt import mtp
from engines.kt.attention.flashinfer_mla import attention_for
from engines.kt.attention.kv_cache import PAGE_TOKENS, LatentKVCache
from engines.kt.build import expert_methods_for, torch_thread_count
from engines.kt.experts.cpu import RoutedExpertsCPU
from engines.kt.experts.decode_calls import DecodeKernelPolicy
from engines.kt.experts.methods import default_method, normalize_method, unavailable_reason
from engines.kt.experts.notes import decode_reads, streamed_prefill, streaming_details
from engines.kt.families.base import LoadContext, LoadedModel, ModelFamily
from engines.kt.loader import load_checkpoint, missing_tensors
from engines.kt.options import KTOptions
from engines.kt.placement.operators import OperatorOptions, fuse_rms_norms
from engines.kt.placement.rules import apply_placement, plan_placement
from engines.kt.runner import KTModelRunner, device_scope, layer_devices, uses_cpu_experts
from engines.model_files import resolve_dtype

log = logging.getLogger("ktserve.engine.kt")

@dataclass(frozen=True, slots=True)
class MLAVariant:
    """What a generation of the MLA architecture changes in how load_mla loads it (V2 / V3: nothing): the cache
    it attends over (`make_cache(config, **LatentKVCache's arguments)`), and whether FlashInfer's dense paged MLA
    may attend."""

    make_cache: Callable = lambda config, **kwargs: LatentKVCache(**kwargs)
    flashinfer: bool = True


def load_mla(family: ModelFamily, context: LoadContext, variant: MLAVariant = MLAVariant()) -> LoadedModel:
    """Build `family`'s model on the meta device, place it by the rules, stream the checkpoint in (the engine's
    `context.source`: BF16 or FP8 safetensors, or GGUF) and return the KT runner over it, with the MTP layer as a
    draft head when speculative decoding asks for it: the load path of every MLA generation (V2, V3, V3.2)."""
    kt, config, rule_file, model_path = context.options, context.config, context.rule_file, context.model_path
    draft_layer, no_draft = _draft_layer(context)
    # the MTP layer is read only to draft with; then its copies of the embedding and LM head are not
    source = context.source.for_layers(config.num_hidden_layers + (draft_layer is not None),
                                       skip=mtp.SHARED_COPIES if draft_layer is not None else None)
    converted, explicit = _converted_experts(kt, config)
    model = family.build_model(config)
    if draft_layer is not None:
        with torch.device("meta"):
            mtp.add_layer(model, config)  # placed and loaded as one more decoder layer, then taken out
    placement = plan_placement(model, context.rules, default_device="cpu", fold=context.fold)
    default = default_method(source.experts_form)
    choices = expert_methods_for(placement, explicit, rule_file, config, default, source)
    gpu = placement.uses_gpu
    prefill = streamed_prefill(kt, model, config, {c.method for c in choices.values()}, gpu, context.chunk_size)
    options = OperatorOptions(max_tokens=prefill.chunk_size + context.max_concurrent, cpu_threads=kt.cpu_infer,
                              methods={m: c.method for m, c in choices.items()}, checkpoint=str(source.path),
                              default_method=default, gpu_prefill_tokens=prefill.tokens,
                              gpu_prefill_experts=prefill.experts, expert_pad_from=kt.kt_expert_pad_from,
                              # kt-kernel holds every expert of a pre-converted layer: none is the GPU's own
                              gpu_read_experts=0 if converted else kt.kt_gpu_read_experts,
                              gpu_resident_experts=0 if converted else kt.kt_gpu_resident_experts,
                              decode_kernel=DecodeKernelPolicy(kt.kt_decode_kernel))
    apply_placement(model, placement, config, options)
    dtype = resolve_dtype(context.dtype_setting, torch.device("cuda" if gpu else "cpu"))
    storage = load_checkpoint(model, source, placement.device_of_param, dtype,
                              getattr(config, "n_routed_experts", None) or config.num_experts,
                              weight_cache=_weight_cache_dir(kt, source.path), converted=converted)
    _finish_model(model, config, placement)
    fused = fuse_rms_norms(model)
    if fused:
        log.info("%d RMSNorms on the GPU run as one fused kernel each", fused)
    model.eval()
    head = mtp.MTPHead.take(model, device_scope) if draft_layer is not None else None
    devices = layer_devices(model)
    max_len = context.max_model_len
    kv_tokens = context.kv_cache_tokens()
    if kv_tokens < max_len:  # a request longer than the cache could never finish
        log.info("serving a context of %d tokens: the KV cache (kv_cache_tokens) holds no more", kv_tokens)
        max_len = kv_tokens
    cache_devices = devices + ([head.device] if head is not None else [])  # the draft head's own KV layer
    # one page more than asked for: the runner's scratch page, which no request uses
    cache = variant.make_cache(config, layer_devices=cache_devices, num_tokens=kv_tokens + PAGE_TOKENS,
                               latent_dim=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim, dtype=dtype,
                               prefix_cache=kt.prefix_cache)
    backend = kt.attention_backend if variant.flashinfer else _dense_only(kt.attention_backend, family)
    flash = attention_for(backend, model.model.layers[0].self_attn, cache_devices, cache)
    runner = KTModelRunner(model, devices, cache, max_len, flash=flash, draft_head=head,
                           draft_unavailable=no_draft)
    loaded = LoadedModel(runner, checkpoint=storage, max_model_len=max_len, chunk_size=prefill.chunk_size)
    cpu_experts, all_on_gpus = uses_cpu_experts(model), all(d.type == "cuda" for d in devices)
    if cpu_experts:  # set here, before the warm-up and graph capture below, and recorded by the engine
        loaded.torch_threads = torch_thread_count(kt.cpu_infer, all_on_gpus)
        torch.set_num_threads(loaded.torch_threads)
    reads = decode_reads(model, kt, options)  # before the capture below, which replays the read kernels
    if kt.kt_use_cuda_graph:
        if gpu:
            runner.capture_decode_graphs(context.decode_rows(head is not None))
        else:
            log.info("kt_use_cuda_graph: no GPU in the placement; decode runs without CUDA graphs")
    streamed = streaming_details(options, prefill)
    if cpu_experts and all_on_gpus:
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
                 len(runner.deferring), rule_file.name)
    log.info("%s: %s, experts on the CPU: %s", model_path.name, dtype, cpu_experts)
    details = loaded.details
    details["attention_backend"] = "torch" if flash is None else "flashinfer"
    details.update(streamed)
    details.update(reads)
    details.update(options.decode_kernel.finish())
    if runner.isolation.spare:
        details["server_thread_cores"] = ",".join(map(str, sorted(runner.isolation.spare)))
    if padded:
        details["expert_pad_from"] = str(min(a for a, _ in padded))
    if runner.deferring:
        details["experts_deferred"] = str(max(layer.deferred for layer in runner.deferring))
    if head is not None:
        details["speculative"] = f"mtp (model.layers.{draft_layer})"
    for choice in choices.values():
        details.update(choice.describe())
    return loaded


def _dense_only(requested: str, family: ModelFamily) -> str:
    """The attention backend for a family whose attention FlashInfer's dense paged MLA cannot compute."""
    if requested == "flashinfer":
        raise ValueError(f"attention_backend: flashinfer computes dense MLA; {family.name} attends sparsely "
                         "(use auto or torch)")
    log.info("MLA attention of %s: torch (FlashInfer's paged MLA attends densely)", family.name)
    return "torch"


def _draft_layer(context: LoadContext) -> tuple[int | None, str | None]:
    """The MTP layer to draft with when speculative decoding asks for it, else None and, when it asked, why
    there is none (the runtime logs it and serves without drafting)."""
    if context.speculative is None or context.speculative.speculative != "mtp":
        return None, None
    if context.source.experts_form == "ggml":
        return None, (f"{context.source.path.name} is a GGUF checkpoint, whose multi-token-prediction layer ktserve "
                      "does not read")
    config = context.config
    index = mtp.mtp_layer_index(context.model_path, config)
    if index is None:
        return None, (f"{context.model_path.name} has no multi-token-prediction layer (model.layers."
                      f"{config.num_hidden_layers}.eh_proj.weight is not in the checkpoint)")
    return index, None


def _converted_experts(kt: KTOptions, config: Any) -> tuple[Any, str | None]:
    """kt-kernel's pre-converted experts (kt_weight_path) when given, and the experts method every layer must
    then run (theirs; kt_method otherwise)."""
    from engines.kt.experts.cache import ConvertedExperts

    if not kt.kt_weight_path:
        return None, kt.kt_method
    converted = ConvertedExperts.open(kt.kt_weight_path, config.hidden_size, config.moe_intermediate_size)
    if kt.kt_method and normalize_method(kt.kt_method, "kt_method") != converted.method:
        raise ValueError(f"kt_method {kt.kt_method} disagrees with kt_weight_path {kt.kt_weight_path}, which holds "
                         f"{converted.method} experts (unset kt_method, or kt_weight_path to convert at load)")
    reason = unavailable_reason(converted.method)
    if reason is not None:
        raise ValueError(f"kt_weight_path {kt.kt_weight_path} holds {converted.method} experts, but {reason} "
                         f"(unset kt_weight_path to convert the checkpoint's experts at load)")
    log.info("kt_weight_path: %s experts of %d layers from %s", converted.method, len(converted.layers),
             converted.root)
    return converted, converted.method


def _weight_cache_dir(kt: KTOptions, model_path: Path) -> Path | None:
    """Pre-quantized experts live under the cache root, one folder per model and expert method."""
    if not kt.kt_weight_cache:
        return None
    method = (kt.kt_method or "rules").upper()
    return Path(kt.kt_weight_cache) / f"{model_path.resolve().name}-{method}"


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

