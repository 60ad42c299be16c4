"""What the MLA generations (V2, V3, V3.2) do in the load's steps (engines/kt/build.py; the hooks are
MLAFamily's, deepseek_mla/family.py): the MTP draft layer, kt-kernel's pre-converted experts, the expert weight cache
folder, the tensors a checkpoint does not carry, and the attention backend a sparse generation may use."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from engines.kt.families.deepseek_mla import mtp
from engines.kt.families.base import LoadContext, ModelFamily
from engines.kt.experts.methods import normalize_method, unavailable_reason
from engines.kt.loader import missing_tensors
from engines.kt.options import KTOptions

log = logging.getLogger("ktserve.engine.kt")


def dense_only(requested: str, family: ModelFamily) -> str:
    """The attention backend for a family whose attention FlashInfer's dense paged MLA cannot compute."""
    if requested == "flashinfer":
        raise ValueError(f"attention_backend: flashinfer computes dense MLA; {family.name} attends sparsely "
                         "(use auto or torch)")
    log.info("MLA attention of %s: torch (FlashInfer's paged MLA attends densely)", family.name)
    return "torch"


def draft_layer(context: LoadContext) -> tuple[int | None, str | None]:
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


def converted_experts(kt: KTOptions, config: Any) -> tuple[Any, str | None]:
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


def weight_cache_dir(kt: KTOptions, model_path: Path) -> Path | None:
    """Pre-quantized experts live under the cache root, one folder per model and expert method."""
    if not kt.kt_weight_cache:
        return None
    method = (kt.kt_method or "rules").upper()
    return Path(kt.kt_weight_cache) / f"{model_path.resolve().name}-{method}"


def finish_model(model: Any, config: Any, placement: Any) -> None:
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

