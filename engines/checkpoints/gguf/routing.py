"""How a deepseek2 GGUF routes tokens to experts, where its metadata does not say.

Converters write the routing keys differently, and a missing one changes which experts serve a token with no
error anywhere: ik_llama.cpp's convert_hf_to_gguf.py (which made most of the hybrid-inference community's R1 /
V3 / V3.1 quants) writes no `expert_group_count` / `expert_group_used_count`, nor did llama.cpp's before late
2025; llama.cpp's writes `expert_weights_norm` only when it is true and `expert_weights_scale` only when the
config has one; V2 GGUFs from before 2025 have no `expert_gating_func` (llama.cpp then read softmax) and no
`expert_weights_norm`. A key the file has is taken as it is; a missing one comes from the release the file's
shape identifies (DeepSeek's own models, whose routing their config.json fixes), else from what llama.cpp reads
for a missing key. Only the group keys have no safe reading: without them a grouped model is routed without its
group limit, so their absence in a file of no known shape is reported as a routing that may differ."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

# GGUF key (without the "deepseek2." prefix) -> config.json key
ROUTING_KEYS = {
    "expert_group_count": "n_group",
    "expert_group_used_count": "topk_group",
    "expert_weights_scale": "routed_scaling_factor",
    "expert_weights_norm": "norm_topk_prob",
    "expert_gating_func": "scoring_func",
}
GROUP_KEYS = ("expert_group_count", "expert_group_used_count")
GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE values
# what llama.cpp reads where a key is missing (scoring_func: softmax, or sigmoid beside V3's router bias)
ABSENT = {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False}


@dataclass(frozen=True)
class Release:
    """A model whose shape identifies it and whose released config.json fixes its routing."""

    name: str
    shape: dict[str, int]  # GGUF keys -> values, all of which the file must have
    sigmoid: bool  # routed by sigmoid scores with V3's score-correction bias (else softmax, no bias)
    routing: dict[str, Any]  # config.json's routing keys
    source: str = "released config.json"

    def matches(self, value: Callable[[str, Any], Any], sigmoid: bool) -> bool:
        return sigmoid == self.sigmoid and all(value(key, None) == want for key, want in self.shape.items())

    def describe(self) -> str:
        return f"{self.name}'s {self.source} (identified by " + \
            ", ".join(f"{key} {want}" for key, want in self.shape.items()) + ")"


def _shape(layers: int, hidden: int, experts: int, used: int, heads: int, dense: int) -> dict[str, int]:
    return {"block_count": layers, "embedding_length": hidden, "expert_count": experts, "expert_used_count": used,
            "attention.head_count": heads, "leading_dense_block_count": dense}


def _routing(groups: int, used_groups: int, scale: float, norm: bool, scoring: str) -> dict[str, Any]:
    return {"n_group": groups, "topk_group": used_groups, "routed_scaling_factor": scale, "norm_topk_prob": norm,
            "scoring_func": scoring}


# The values of the released config.json files on the Hugging Face hub. V3, R1, V3-0324, R1-0528, V3.1 and
# V3.1-Terminus share one shape and one routing, as do V2, V2-Chat, V2.5 and Coder-V2, V2-Lite and Coder-V2-Lite,
# and Kimi-K2 and K2.5's text model (DeepSeek-V3's architecture with 384 experts in no groups). Moonlight
# (V2-Lite's shape, sigmoid-routed) matches none of them.
RELEASES = (
    Release("DeepSeek-V3 / R1 / V3.1", _shape(61, 7168, 256, 8, 128, 3), True, _routing(8, 4, 2.5, True, "sigmoid")),
    Release("DeepSeek-V2 / V2.5 / Coder-V2", _shape(60, 5120, 160, 6, 128, 1), False,
            _routing(8, 3, 16.0, False, "softmax")),
    Release("DeepSeek-V2-Lite / Coder-V2-Lite", _shape(27, 2048, 64, 6, 16, 1), False,
            _routing(1, 1, 1.0, False, "softmax")),
    Release("Kimi-K2", _shape(61, 7168, 384, 8, 64, 1), True, _routing(1, 1, 2.827, True, "sigmoid")),
    # engines/demo_model.py's (which users convert with llama.cpp's tools too;
    # tests/engines/checkpoints/test_gguf_routing.py checks this against its config, which cannot be imported here: it
    # reaches the ktransformers engine's families)
    Release("ktserve's demo model", _shape(4, 256, 16, 4, 4, 1), True, _routing(4, 2, 2.5, True, "sigmoid"),
            "config (engines/demo_model.py)"),
)


@dataclass(frozen=True)
class Routing:
    """A GGUF's routing as config.json keys, and what the file left out."""

    fields: dict[str, Any]
    inferred: dict[str, Any] = field(default_factory=dict)  # config keys the file lacked, filled from `release`
    release: Release | None = None
    doubtful: tuple[str, ...] = ()  # GGUF keys the file lacks that nothing fills: the routing may differ

    def note(self, source: str) -> str | None:
        """One line for the start-up log and /version; None when the file said everything."""
        if self.doubtful:
            return (f"{source} has no {' / '.join('deepseek2.' + k for k in self.doubtful)} and its shape is no "
                    "known release's: experts are routed without a group limit, as llama.cpp does, which differs "
                    "from the original model's routing if it has groups; give model_path (the original "
                    "config.json) beside gguf_path to route as the original does")
        if self.inferred:
            values = ", ".join(f"{key} {value}" for key, value in self.inferred.items())
            return f"{values} (absent from {source}) taken from {self.release.describe()}"
        return None


def resolve(value: Callable[[str, Any], Any], has_router_bias: bool, source: str) -> Routing:
    """The routing of `source`, whose metadata `value(key, default)` reads (keys without the prefix)."""
    gating = value("expert_gating_func", None)
    if gating is not None and int(gating) not in GATING:
        raise ValueError(f"model: {source} has deepseek2.expert_gating_func {gating}; ktserve routes with "
                         "DeepSeek's softmax (1) and sigmoid (2) gating")
    sigmoid = GATING.get(int(gating or 0)) == "sigmoid" or has_router_bias
    missing = [key for key in ROUTING_KEYS if value(key, None) is None]
    release = next((r for r in RELEASES if r.matches(value, sigmoid)), None)
    fields: dict[str, Any] = {"scoring_func": "sigmoid" if sigmoid else "softmax"}
    inferred: dict[str, Any] = {}
    for key, config in ROUTING_KEYS.items():
        if config == "scoring_func":
            continue
        if key in GROUP_KEYS and key not in missing:
            fields[config] = int(value(key, None)) or 1  # 0 is llama.cpp's "no groups"
        elif key not in missing:
            fields[config] = type(ABSENT[config])(value(key, None))
        elif release is not None:
            fields[config] = release.routing[config]
            if fields[config] != ABSENT[config]:  # else the file's silence already meant this value
                inferred[config] = fields[config]
        else:
            fields[config] = ABSENT[config]
    _check_groups(fields, value("expert_count", None), source)
    doubtful = () if release is not None else tuple(k for k in GROUP_KEYS if k in missing)
    return Routing(fields, inferred, release if inferred else None, doubtful)


def _check_groups(fields: dict[str, Any], experts: Any, source: str) -> None:
    groups, used = fields["n_group"], fields["topk_group"]
    if groups < 1 or (experts is not None and int(experts) % groups):
        raise ValueError(f"model: {source} has deepseek2.expert_group_count {groups}; it must be at least 1 and "
                         f"divide deepseek2.expert_count ({experts})")
    if not 1 <= used <= groups:
        raise ValueError(f"model: {source} has deepseek2.expert_group_used_count {used}; it must be between 1 "
                         f"and deepseek2.expert_group_count ({groups})")
