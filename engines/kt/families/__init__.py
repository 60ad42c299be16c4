"""Model families the KT engine serves, found by name: "module:Class", imported only when chosen.

engines/kt/families/base.py says what a family provides. A family listed here loads and runs the model, and
the engine, runtime and server stay unaware of its internals: the engine imports no family module, only this
registry. A checkpoint's family is the one its config.json `model_type` names in FAMILIES, else the one serving
its architecture (ARCHITECTURES: the V2 / V3 (MLA) generation, whatever the model type, e.g. Kimi-K2's kimi_k2
is a DeepseekV3ForCausalLM; a GGUF file's `deepseek2` checkpoints too). Every family loads through the core's one
pipeline (engines/kt/build.py) by its hooks; V3.2's are deepseek_mla/'s with V3.2's own attention and cache. What two families share sits beside them: dsml_chat.py
(V3.2's and V4's chat format); the start-up notes on the GPU's share of the routed experts, which every family
calls, are the core's (engines/kt/experts/notes.py).
"""
from __future__ import annotations

import importlib
from typing import Any

from engines.kt.families.base import ModelFamily

MLA = "engines.kt.families.deepseek_mla.family:MLAFamily"
# config.json model_type -> the family that loads it with its own config (transformers' AutoConfig)
FAMILIES: dict[str, str] = {
    "deepseek_v32": "engines.kt.families.deepseek_v32.family:DeepseekV32Family",
    "deepseek_v4": "engines.kt.families.deepseek_v4.family:DeepseekV4Family",
}
# architectures served under any other model_type -> the family serving them (`ModelFamily.read_config`)
ARCHITECTURES: dict[str, str] = {"DeepseekV2ForCausalLM": MLA, "DeepseekV3ForCausalLM": MLA}


def _family_class(target: str) -> type[ModelFamily]:
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def family_for(config: Any, architecture: str | None = None) -> ModelFamily | None:
    """The family serving `config.model_type`, else the one serving `architecture` (by default the config's
    first) under any model type; None when no family serves either."""
    target = FAMILIES.get(getattr(config, "model_type", ""))
    if target is not None:
        return _family_class(target)()
    if architecture is None:
        architecture = (getattr(config, "architectures", None) or ["?"])[0]
    return family_for_architecture(architecture)


def family_for_architecture(architecture: str) -> ModelFamily | None:
    """The family serving `architecture` under any model type (ARCHITECTURES), reporting that architecture; None
    when none does."""
    target = ARCHITECTURES.get(architecture)
    return None if target is None else _family_class(target)(architecture)


def family_architectures() -> tuple[str, ...]:
    """Architecture names the families serve (for the engine's 'what do you serve' message): ARCHITECTURES', then
    those of the families listed by model type."""
    return (*ARCHITECTURES, *(name for target in FAMILIES.values() for name in _family_class(target).architectures))
