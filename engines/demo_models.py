"""Every demo model by its config.json `model_type`, and the V3 demo as a GGUF file: what `ktserve demo-model` writes
(tests and benchmarks call the writers too). The writers live beside their families: engines/demo_model.py (V3,
whose helpers the others reuse), engines/demo_model_v4.py, engines/kt/families/deepseek_v32/demo_model.py."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

from engines.checkpoints.gguf.writer import write_gguf
from engines.demo_model import DEMO_SEED, ensure_demo_model, make_demo_model
from engines.demo_model_v4 import make_demo_model_v4
from engines.kt.families.deepseek_v32.demo_model import make_demo_model_v32

DEMO_WRITERS: dict[str, Callable[..., Path]] = {
    "deepseek_v3": make_demo_model, "deepseek_v32": make_demo_model_v32, "deepseek_v4": make_demo_model_v4}


def demo_writer(arch: str) -> Callable[..., Path]:
    """The function writing a tiny random model of `arch` (a config.json model_type): (out_dir, seed) -> Path."""
    if arch not in DEMO_WRITERS:
        raise ValueError(f"arch: no demo model for {arch!r} (deepseek_v3, deepseek_v32, deepseek_v4)")
    return DEMO_WRITERS[arch]


def write_demo_gguf(out_dir: str | Path, types: dict[str, str] | None = None, *, split: bool = False,
                    seed: int = 0, kv_b: str = "split") -> list[Path]:
    """The demo model (engines/demo_model.py) as `<out_dir>/demo-model-<experts type>.gguf` (two files with
    `split`); the files written (engines/checkpoints/gguf/writer.py: write_gguf)."""
    name = f"demo-model-{(types or {}).get('experts', 'Q8_0')}.gguf"
    if seed == DEMO_SEED:
        return write_gguf(ensure_demo_model(), Path(out_dir) / name, types, split=split, kv_b=kv_b)
    with tempfile.TemporaryDirectory() as tmp:
        return write_gguf(make_demo_model(tmp, seed=seed), Path(out_dir) / name, types, split=split, kv_b=kv_b)
