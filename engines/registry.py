"""Engine names -> engine classes, imported only when chosen (torch-heavy modules load lazily).

Built in: "huggingface", "ktransformers" and "vllm" (LLaMA-Factory's `infer_backend` values; vllm needs the
optional `vllm` extra and says so at start when it is missing). Other packages add
engines through the entry-point group `ktserve.engines`, e.g. in their pyproject.toml:

    [project.entry-points."ktserve.engines"]
    myengine = "my_package.engine:MyEngine"
"""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from engines.base import Engine, EngineConfig

ENTRY_POINT_GROUP = "ktserve.engines"

BUILTIN_ENGINES: dict[str, str] = {
    "huggingface": "engines.hf.engine:HFEngine",
    "ktransformers": "engines.kt.engine:KTEngine",
    "vllm": "engines.vllm.engine:VLLMEngine",
}


def available_engines() -> dict[str, str]:
    """Name -> "module:Class" for the built-in engines and every installed plug-in."""
    engines = dict(BUILTIN_ENGINES)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        engines.setdefault(ep.name, ep.value)
    return engines


def engine_class(name: str) -> type[Engine]:
    engines = available_engines()
    if name not in engines:
        raise ValueError(f"engine: unknown engine {name!r}; known engines: {', '.join(sorted(engines))}")
    module_name, _, class_name = engines[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise ValueError(f"engine: {engines[name]!r} (for {name!r}) is not a ktserve Engine subclass")
    return cls


def create_engine(name: str, config: EngineConfig) -> Engine:
    return engine_class(name)(config)
