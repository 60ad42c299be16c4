"""The engine registry resolves names lazily and says what exists when a name is unknown."""
from __future__ import annotations

import pytest

from engines.registry import available_engines, engine_class


def test_builtin_engines_are_registered():
    assert {"huggingface", "ktransformers"} <= set(available_engines())


def test_huggingface_resolves_to_the_hf_engine():
    from engines.hf.engine import HFEngine
    assert engine_class("huggingface") is HFEngine


def test_unknown_engine_lists_known_ones():
    with pytest.raises(ValueError, match="known engines: huggingface, ktransformers"):
        engine_class("nope")


def test_entry_point_engines_are_discovered(monkeypatch):
    from importlib import metadata

    class FakeEntryPoint:
        name, value = "plugged", "engines.hf.engine:HFEngine"

    monkeypatch.setattr("engines.registry.entry_points", lambda group: [FakeEntryPoint()])
    assert available_engines()["plugged"] == "engines.hf.engine:HFEngine"
    assert engine_class("plugged").__name__ == "HFEngine"
