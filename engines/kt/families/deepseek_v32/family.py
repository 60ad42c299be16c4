"""DeepSeek-V3.2 / V3.2-Exp (`model_type: deepseek_v32`) in the KT engine: V3 plus DeepSeek Sparse Attention.

V3.2 loads through V3's hooks (engines/kt/families/deepseek_mla/family.py: MLAFamily), so the checkpoint is read as any DeepSeek FP8
release is (engines/checkpoints/source.py: FP8 blocks with `weight_scale_inv`, the indexer's `wq_b` and `wk`
among them, dequantized on their device; the routed experts kept as FP8 blocks where the experts method reads
them, else converted; the MTP layer skipped unless it drafts). What V3.2 adds is here and in this folder:
- the attention: MLA plus the lightning indexer's top-k selection (attention/mla.py: IndexedMLAAttention, which
  the rule files name as engines.kt.placement.operators.IndexedMLAAttention);
- the cache: the latent cache plus the indexer's keys in the same slots (cache.py);
- FlashInfer's paged MLA computes dense attention, so V3.2 attends in torch;
- its MTP layer drafts as V3's does (`speculative: mtp`, engines/kt/families/deepseek_mla/mtp.py): a V3.2 decoder layer with its own
  indexer, placed and loaded as one more layer, attending over its own layer of the indexed cache;
- the conversation format, encoded in Python as the release does (chat.py; engines/kt/families/dsml_chat.py:
  what it shares with V4's);
- the demo checkpoint writer (demo_model.py)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from engines.kt.families.deepseek_mla.family import MLAFamily
from engines.kt.families.base import ChatEncoder
from engines.kt.families.deepseek_v32.cache import IndexedLatentKVCache
from engines.kt.families.deepseek_v32.chat import ENCODER_FILE, V32ChatFormat
from engines.kt.families.dsml_chat import choose_encoder, install
from engines.model_files import ships_chat_template

class DeepseekV32Family(MLAFamily):
    name = "deepseek_v32"
    model_types = ("deepseek_v32",)
    architectures = ("DeepseekV32ForCausalLM",)
    expert_layout = replace(MLAFamily.expert_layout, format="fp8_blocks")

    def default_rule_file(self, config: Any, gpus: int) -> str:
        return "DeepSeek-V3.2.yaml" if gpus else "DeepSeek-V3.2-CPU.yaml"

    dense_attention = False  # FlashInfer's paged MLA attends densely

    def make_cache(self, config: Any, **kwargs: Any) -> IndexedLatentKVCache:
        return IndexedLatentKVCache(index_dim=config.index_head_dim, **kwargs)

    def make_runner(self, build: Any) -> tuple[Any, int]:
        build.details["index_topk"] = str(build.config.index_topk)
        return super().make_runner(build)

    def chat_encoder(self, model_path: Path, allow_checkpoint_code: bool = False) -> ChatEncoder | None:
        """V3.2's format, which the final release encodes in Python: its `encoding/encoding_dsv32.py` when the user
        allows running the model folder's code (trust_remote_code), else our implementation (chat.py). A folder
        with a jinja chat template and no encoder (V3.2-Exp) is served with its template."""
        if not (model_path / "encoding" / ENCODER_FILE).is_file() and ships_chat_template(model_path):
            return None
        return choose_encoder(model_path, allow_checkpoint_code, V32ChatFormat(), ENCODER_FILE, takes_effort=False)

    def install_chat_encoder(self, tokenizer: Any, encoder: ChatEncoder) -> None:
        install(tokenizer, encoder)
