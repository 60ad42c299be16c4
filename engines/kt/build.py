"""What every family's load shares (engines/kt/families/base.py: `ModelFamily.load`): the experts method each rule's
layers run, and torch's own threads beside kt-kernel's workers. The families' load paths (deepseek_mla/load.py,
deepseek_v4/family.py) still run the rest of their steps each in its own order."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from engines.kt.experts.cpuinfer import physical_cores, resolve_thread_count
from engines.kt.experts.methods import (DEFAULT_METHOD, ExpertShape, choose_gguf_method, choose_method, cpu_variant,
                                       normalize_method)
from engines.kt.placement.aliases import EXPERT_OPERATORS

log = logging.getLogger("ktserve.engine.kt")


def expert_methods_for(placement: Any, explicit: str | None, rule_file: Path, config: Any,
                       default: str = DEFAULT_METHOD, source: Any = None) -> dict[str, Any]:
    """For each experts method the rules ask for (`default` where a rule names none): the MethodChoice that
    serves it (logged once each). A GGUF checkpoint's experts (`source`) run as its blocks allow, whatever the
    rules ask (`choose_gguf_method`)."""
    layers = [kwargs for rule, kwargs in placement.replacements.values() if rule.replace in EXPERT_OPERATORS]
    asked = {normalize_method(kwargs.get("method") or default, "method") for kwargs in layers}
    experts = getattr(config, "n_routed_experts", None) or config.num_experts
    shape = ExpertShape(config.hidden_size, config.moe_intermediate_size,
                        len(layers) * experts * 3 * config.hidden_size * config.moe_intermediate_size)
    if source is not None and source.experts_form == "ggml":
        choice = choose_gguf_method(set(source.expert_types()), explicit=explicit, shape=shape)
        choices = dict.fromkeys(sorted(asked), choice)
    else:
        choices = {m: choose_method(m, explicit=explicit, source=f"rule file {rule_file.name}", shape=shape)
                   for m in sorted(asked)}
    for choice in dict.fromkeys(choices.values()):  # each once (a GGUF's serves every rule)
        if choice.reason:
            log.warning("experts: %s (kt-kernel build %s)", choice.reason, cpu_variant())
        else:
            log.info("experts: %s on kt-kernel's %s build", choice.method, cpu_variant())
    return choices


def torch_thread_count(cpu_infer: int | None, gpu: bool) -> int:
    """torch's own CPU thread pool spins (OpenMP keeps idle threads busy ~200 ms) on the cores kt-kernel's
    workers run on: small torch ops took 10 ms instead of 0.15 ms on the CPU box, and decode steps on the
    H200 box took a flat 216 ms instead of 34 ms. Without a GPU, torch gets the cores kt-kernel leaves.
    With every decoder layer on a GPU, the generation thread's CPU work is only sampling, and the cores
    kt-kernel leaves are taken by that thread and the CUDA thread that runs kt-kernel's stream callbacks;
    a second torch thread, spinning after every sampling op, would make one busy thread more than there are
    cores: torch gets 1."""
    return 1 if gpu else max(1, physical_cores() - resolve_thread_count(cpu_infer))
