"""Every demo model by its config.json `model_type`, found by name and imported only when written: what
`ktserve make-demo-model` writes, what the server serves when no model is given (`ensure_demo_model`: the tiny V3),
and the V3 demo as a GGUF file. Each writer lives in its family's folder (engines/kt/families/<family>/demo_model.py);
a new family's demo is one line in DEMO_WRITERS. The shared half, writing a model directory as releases ship them,
is engines/checkpoints/model_dir.py."""
from __future__ import annotations

import importlib
import tempfile
from pathlib import Path
from typing import Any, Callable

DEMO_SEED = 0  # every demo model's default seed: the same seed gives the same bytes

# config.json model_type -> "module:function" writing a tiny random model of it: (out_dir, seed=..., **overrides)
DEMO_WRITERS = {
    "deepseek_v3": "engines.kt.families.deepseek_mla.demo_model:make_demo_model",
    "deepseek_v32": "engines.kt.families.deepseek_v32.demo_model:make_demo_model_v32",
    "deepseek_v4": "engines.kt.families.deepseek_v4.demo_model:make_demo_model_v4",
}
DEMO_ARCHS = tuple(DEMO_WRITERS)
# the built-in demo model, kept in the cache folder and written once
BUILT_IN = "engines.kt.families.deepseek_mla.demo_model:ensure_demo_model"


def _resolve(target: str) -> Any:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def demo_writer(arch: str) -> Callable[..., Path]:
    """The function writing a tiny random model of `arch` (a config.json model_type): (out_dir, seed) -> Path."""
    if arch not in DEMO_WRITERS:
        raise ValueError(f"arch: no demo model for {arch!r} ({', '.join(DEMO_ARCHS)})")
    return _resolve(DEMO_WRITERS[arch])


def ensure_demo_model(mtp: str | None = None) -> Path:
    """The built-in demo model's folder (with an MTP layer of kind `mtp`), written first if it is not there yet."""
    return _resolve(BUILT_IN)(mtp)


def write_demo_gguf(out_dir: str | Path, types: dict[str, str] | None = None, *, split: bool = False,
                    seed: int = DEMO_SEED, kv_b: str = "split") -> list[Path]:
    """The built-in demo model as `<out_dir>/demo-model-<experts type>.gguf` (two files with `split`); the files
    written (engines/checkpoints/gguf/writer.py: write_gguf)."""
    from engines.checkpoints.gguf.writer import write_gguf  # gguf and torch: only this writer needs them

    name = f"demo-model-{(types or {}).get('experts', 'Q8_0')}.gguf"
    if seed == DEMO_SEED:
        return write_gguf(ensure_demo_model(), Path(out_dir) / name, types, split=split, kv_b=kv_b)
    with tempfile.TemporaryDirectory() as tmp:
        return write_gguf(demo_writer("deepseek_v3")(tmp, seed=seed), Path(out_dir) / name, types, split=split,
                          kv_b=kv_b)
