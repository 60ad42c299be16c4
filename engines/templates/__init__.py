"""Built-in chat templates, named as LLaMA-Factory names them (its `template` setting).

deepseek   DeepSeek-V2 / V2-Lite chat
deepseek3  DeepSeek-V3
deepseekr1 DeepSeek-R1 (V3's format; earlier turns lose their <think> reasoning, the reply opens one)
"""
from __future__ import annotations

from pathlib import Path

BUILTIN_TEMPLATES = ("deepseek", "deepseek3", "deepseekr1")

_TEMPLATE_DIR = Path(__file__).parent


def builtin_template(name: str) -> str:
    """The Jinja source of the built-in chat template `name`; ValueError names the known ones."""
    if name not in BUILTIN_TEMPLATES:
        raise ValueError(f"template: {name!r} is not a built-in chat template; known: {', '.join(BUILTIN_TEMPLATES)}")
    return (_TEMPLATE_DIR / f"{name}.jinja").read_text(encoding="utf-8")
