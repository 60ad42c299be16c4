"""Run a module (`python bench/results/nvidia-h200-2026-11-26-sampling/code/with_old_sampler.py bench.sampling ...`, from the repository root) with e39ef4b's Sampler in place of today's."""
import importlib.util
from pathlib import Path
import runpy
import sys

spec = importlib.util.spec_from_file_location("old_sampler", Path(__file__).with_name("old_sampler.py"))
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
import engines.runtime.sampler as now  # noqa: E402
import engines.runtime.llm_engine as engine  # noqa: E402

now.Sampler = engine.Sampler = old.Sampler
module, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_module(module, run_name="__main__")
