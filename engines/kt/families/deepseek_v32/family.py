"""DeepSeek-V3.2 / V3.2-Exp (`model_type: deepseek_v32`) in the KT engine: V3 plus DeepSeek Sparse Attention.

Everything V3.2 adds to V3's load path (engines/kt/engine.py: load_mla) is here and in this folder:
- the checkpoint as released: FP8 blocks with `weight_scale_inv`, dequantized while streaming
  (checkpoint.py); the routed experts then reach kt-kernel as bf16 and become the rules' method there;
- the attention: MLA plus the lightning indexer's top-k selection (attention.py: IndexedMLAAttention, which
  the rule files name as engines.kt.operators.IndexedMLAAttention);
- the cache: the latent cache plus the indexer's keys in the same slots (cache.py);
- FlashInfer's paged MLA computes dense attention, so V3.2 attends in torch;
- the demo checkpoint writer (demo_model.py).
The MTP layer (`model.layers.<num_hidden_layers>.*`) is skipped by the loader; `draft_names` is the seam for
a drafting head."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from engines.kt.engine import MLAFamily, MLAVariant, load_mla
from engines.kt.families.base import LoadContext, LoadedModel
from engines.kt.families.deepseek_v32.cache import IndexedLatentKVCache
from engines.kt.families.deepseek_v32.checkpoint import block_shape, dequantized
from engines.kt.loader import iter_tensors


class DeepseekV32Family(MLAFamily):
    name = "deepseek_v32"
    model_types = ("deepseek_v32",)
    architectures = ("DeepseekV32ForCausalLM",)
    expert_layout = replace(MLAFamily.expert_layout, format="fp8_blocks")

    def default_rule_file(self, config: Any, gpus: int) -> str:
        return "DeepSeek-V3.2.yaml" if gpus else "DeepSeek-V3.2-CPU.yaml"

    def load(self, context: LoadContext) -> LoadedModel:
        block = block_shape(context.config)
        variant = MLAVariant(
            read_tensors=lambda files, progress: dequantized(iter_tensors(files, progress), block),
            make_cache=lambda config, **kwargs: IndexedLatentKVCache(index_dim=config.index_head_dim, **kwargs),
            flashinfer=False)
        loaded = load_mla(self, context, variant)
        loaded.details["index_topk"] = str(context.config.index_topk)
        return loaded
