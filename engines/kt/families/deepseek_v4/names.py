"""DeepSeek-V4's released tensor names -> the module paths of transformers' `DeepseekV4ForCausalLM`
(the renames transformers' conversion_mapping.py lists for `deepseek_v4`, applied one name at a time).

Released names have no `model.` prefix: `embed.weight`, `layers.N.attn.wq_a.weight`, `layers.N.ffn.gate.tid2eid`,
`head.weight`, `hc_head_fn`; routed experts `layers.N.ffn.experts.E.w1.weight` (+ `.scale`) are matched by
`EXPERT`; FP8 weights carry a `.scale` beside `.weight`; `mtp.0.*` is the multi-token-prediction layer: a
decoder block under the layers' names plus its own parts (`enorm`, `hnorm`, `e_proj`, `h_proj`, `norm`,
`hc_head_fn` / `_base` / `_scale`), loaded as one more layer when drafting (`draft_layer_name`)."""
from __future__ import annotations

import re

EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down"}

_HEAD = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
# applied in order to a layer's name (with `model.` in front): mid-name renames first, then the leaves
_RENAMES = (
    (".attn.", ".self_attn."),
    (".ffn.", ".mlp."),
    (".indexer.compressor.", ".compressor.indexer."),
    (".indexer.weights_proj.", ".compressor.indexer.scorer.weights_proj."),
    (".indexer.wq_b.", ".compressor.indexer.q_b_proj."),
    (".attn_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".attn_sink", ".sinks"),
    (".q_norm.", ".q_a_norm."),
    (".norm.", ".kv_norm."),
    (".wq_a.", ".q_a_proj."),
    (".wq_b.", ".q_b_proj."),
    (".wkv.", ".kv_proj."),
    (".wgate.", ".gate_proj."),
    (".wo_a.", ".o_a_proj."),
    (".wo_b.", ".o_b_proj."),
    (".shared_experts.w1.", ".shared_experts.gate_proj."),
    (".shared_experts.w2.", ".shared_experts.down_proj."),
    (".shared_experts.w3.", ".shared_experts.up_proj."),
    (".gate.bias", ".gate.e_score_correction_bias"),
    (".ape", ".position_bias"),
    (".hc_attn_fn", ".attn_hc.fn"), (".hc_attn_base", ".attn_hc.base"), (".hc_attn_scale", ".attn_hc.scale"),
    (".hc_ffn_fn", ".ffn_hc.fn"), (".hc_ffn_base", ".ffn_hc.base"), (".hc_ffn_scale", ".ffn_hc.scale"),
)
# the MTP layer's own parts, under the layer it loads as (engines/kt/families/deepseek_v4/mtp.py: DraftBlock)
_DRAFT_PARTS = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
}
# tensors of the MTP layer serving does not read: copies of the embedding and LM head (the model's own serve), and
# compressor / indexer weights (the layer attends over its sliding window only, as DeepSeek's config and SGLang run
# it)
_DRAFT_UNUSED = re.compile(r"^(emb|embed|head|lm_head)\.|^attn\.(compressor|indexer)\.")


def module_name(name: str) -> str | None:
    """A released non-expert tensor name -> its parameter path in transformers' model; None for the MTP layer's
    tensors (serving does not use them) and for names V4 does not have."""
    if name in _HEAD:
        return _HEAD[name]
    if not name.startswith("layers."):
        return None
    _, index, rest = name.split(".", 2)
    if rest in _DRAFT_PARTS:
        return f"model.layers.{index}.{_DRAFT_PARTS[rest]}"
    name = "model." + name
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name


def is_draft(name: str) -> bool:
    """A tensor of the multi-token-prediction layer (the draft head of speculative decoding)."""
    return name.startswith("mtp.")


def draft_layer_name(name: str, layer: int) -> str | None:
    """A tensor of the first MTP layer (`mtp.0.<rest>`) under the released name of the decoder layer it loads as
    (`layers.<layer>.<rest>`), so experts, FP8 pairs and renames treat it as any layer's; None for tensors serving
    does not read (other MTP layers, the shared copies, compressor weights)."""
    prefix = "mtp.0."
    if not name.startswith(prefix) or _DRAFT_UNUSED.search(name[len(prefix):]):
        return None
    return f"layers.{layer}.{name[len(prefix):]}"
