"""Fitting an adapter to a base model: every update must name a module the model has, with its shape.

Errors name the tensor and both shapes; updates that match no module are listed (never skipped)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from engines.lora.adapter import EXPERT_PROJECTIONS, AdapterFormatError, LoraAdapter
from engines.lora.cpu_experts import CPUExperts

_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts$")
_ROUTER = re.compile(r"^model\.layers\.\d+\.mlp\.gate$")
# rows of these do not line up with a step's rows (the LM head sees only the sampled positions)
UNSUPPORTED_MODULES = ("lm_head", "model.embed_tokens")


@dataclass
class ModelTargets:
    """What a model offers to LoRA: linear weights (routers included) and routed-expert stacks."""

    hidden_size: int
    linears: dict[str, tuple[int, int]] = field(default_factory=dict)  # module -> weight [out, in]
    experts: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # layer -> (E, I, H)


def expert_sizes(module: nn.Module) -> tuple[int, int, int] | None:
    """(experts, intermediate, hidden) of a routed-experts module: kt-kernel's or transformers' fused one."""
    if isinstance(module, CPUExperts):
        return int(module.num_experts), int(module.intermediate_size), int(module.hidden_size)
    gate_up = getattr(module, "gate_up_proj", None)
    if gate_up is not None and gate_up.dim() == 3:
        return gate_up.shape[0], gate_up.shape[1] // 2, gate_up.shape[2]
    return None


def _plain_linear(module: nn.Module) -> bool:
    """An nn.Linear applied as `x @ W.T` on the last dimension, which a LoRA update can follow; DeepSeek-V4's
    grouped `o_a_proj` (an nn.Linear with `n_groups`, block-diagonal over head groups) is not one."""
    return isinstance(module, nn.Linear) and not hasattr(module, "n_groups")


def describe(model: nn.Module, hidden_size: int) -> ModelTargets:
    targets = ModelTargets(hidden_size)
    for name, module in model.named_modules():
        base = getattr(module, "lora_base", module)  # a module we already wrapped
        if (match := _EXPERTS.match(name)) and (sizes := expert_sizes(base)) is not None:
            targets.experts[int(match.group(1))] = sizes
        elif name.startswith(UNSUPPORTED_MODULES):
            continue
        elif _plain_linear(base) or (_ROUTER.match(name) and getattr(base, "weight", None) is not None):
            targets.linears[name] = tuple(base.weight.shape)
    return targets


def bind(adapter: LoraAdapter, targets: ModelTargets) -> None:
    """Lay out the pending expert updates and check every update against `targets` (AdapterFormatError)."""
    for item in adapter.pending:
        sizes = targets.experts.get(item.layer)
        if sizes is None:
            raise AdapterFormatError(f"{adapter.path}: {_source(item)} targets routed experts of layer {item.layer}, "
                                     f"which the base model does not have")
        for proj, update in item.resolve(*sizes).items():
            if proj in adapter.experts.get(item.layer, {}):
                raise AdapterFormatError(f"{adapter.path}: layer {item.layer} {proj}_proj experts get two LoRA "
                                         f"updates ({adapter.experts[item.layer][proj].source}, {update.source})")
            adapter.experts.setdefault(item.layer, {})[proj] = update
    adapter.pending = []
    _check_linears(adapter, targets)
    _check_experts(adapter, targets)
    head = adapter.value_head
    if head is not None and head.weight.shape[1] != targets.hidden_size:
        raise AdapterFormatError(f"{adapter.path}: value head v_head.summary.weight is {list(head.weight.shape)}; "
                                 f"the base model needs [1, {targets.hidden_size}]")


def _source(item) -> str:
    return getattr(item, "source", "") or next(iter(item.weights.values())).source


def _check_linears(adapter: LoraAdapter, targets: ModelTargets) -> None:
    unsupported = [w.source for name, w in adapter.linears.items() if name.startswith(UNSUPPORTED_MODULES)]
    if unsupported:
        raise AdapterFormatError(f"{adapter.path}: LoRA on the embeddings or the LM head is not supported "
                                 f"({', '.join(unsupported[:3])})")
    unknown = [w.source for name, w in adapter.linears.items() if name not in targets.linears]
    if unknown:
        raise AdapterFormatError(f"{adapter.path}: {len(unknown)} LoRA tensors match no module of the base model, "
                                 f"e.g. {', '.join(unknown[:5])}")
    for name, w in adapter.linears.items():
        if w.shape != targets.linears[name]:
            raise AdapterFormatError(f"{adapter.path}: {w.source} gives a {list(w.shape)} update, but the base "
                                     f"model's {name}.weight is {list(targets.linears[name])} (base model mismatch?)")


def _check_experts(adapter: LoraAdapter, targets: ModelTargets) -> None:
    for layer, projections in adapter.experts.items():
        if layer not in targets.experts:
            source = next(iter(projections.values())).source
            raise AdapterFormatError(f"{adapter.path}: {source} targets routed experts of layer {layer}, which the "
                                     f"base model does not have")
        experts, inter, hidden = targets.experts[layer]
        for proj, update in projections.items():
            if proj not in EXPERT_PROJECTIONS:
                raise AdapterFormatError(f"{adapter.path}: unknown expert projection {proj!r}")
            expected = (experts, hidden, inter) if proj == "down" else (experts, inter, hidden)
            if tuple(update.shape) != expected:
                raise AdapterFormatError(
                    f"{adapter.path}: {update.source} gives a {list(update.shape)} update of layer {layer} experts' "
                    f"{proj}_proj, but the base model's is {list(expected)} (base model mismatch?)")
