"""Model families the KT engine serves: config.json `model_type` -> "module:Class", imported only when chosen.

engines/kt/families/base.py says what a family provides. A family listed here loads and runs the model, and
the engine, runtime and server stay unaware of its internals. The V2/V3 (MLA) generation, every `model_type`
not listed, is deepseek_mla/'s MLAFamily, whose load path (`load_mla`) V3.2 reuses with its own attention and
cache. What two families share sits beside them: dsml_chat.py (V3.2's and V4's chat format); the start-up notes on
the GPU's share of the routed experts, which every family calls, are the core's (engines/kt/experts/notes.py).
"""
from __future__ import annotations

import importlib
from typing import Any

from engines.kt.families.base import ModelFamily

FAMILIES: dict[str, str] = {
    "deepseek_v32": "engines.kt.families.deepseek_v32.family:DeepseekV32Family",
    "deepseek_v4": "engines.kt.families.deepseek_v4.family:DeepseekV4Family",
}


def family_for(config: Any) -> ModelFamily | None:
    """The family serving `config.model_type`, or None when deepseek_mla's MLAFamily (V2 / V3) serves it."""
    target = FAMILIES.get(getattr(config, "model_type", ""))
    if target is None:
        return None
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)()


def family_architectures() -> tuple[str, ...]:
    """Architecture names the listed families serve (for the engine's 'what do you serve' message)."""
    return tuple(name for target in FAMILIES.values()
                 for name in getattr(importlib.import_module(target.partition(":")[0]),
                                     target.partition(":")[2]).architectures)
