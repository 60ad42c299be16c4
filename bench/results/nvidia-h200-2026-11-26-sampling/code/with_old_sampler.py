"""Run a module (`python bench/results/nvidia-h200-2026-11-26-sampling/code/with_old_sampler.py bench.sampling ...`, from
the repository root) with e39ef4b's Sampler and GrammarProcessor in place of today's."""
import importlib.util
import runpy
import sys
from pathlib import Path


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


old, old_structured = _load("old_sampler"), _load("old_structured")
import engines.runtime.llm_engine as engine  # noqa: E402
import engines.runtime.sampler as now  # noqa: E402
import engines.runtime.structured as structured  # noqa: E402

now.Sampler = engine.Sampler = old.Sampler
structured.GrammarProcessor = old_structured.GrammarProcessor
module, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_module(module, run_name="__main__")
