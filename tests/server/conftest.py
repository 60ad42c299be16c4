"""Fixtures of the server room alone: the probe server."""
from __future__ import annotations

from typing import Iterator

import pytest

from tests.conftest import RunningServer, start_server

# The probe server: an API key, an adapter root holding one good PEFT adapter, a 64-token context and a
# small engine (tests/server/test_probe_findings.py, tests/server/test_second_probe_findings.py).
PROBE_KEY = "sk-probe-3c9d1e"
PROBE_MAX_CONCURRENT, PROBE_MAX_QUEUE = 2, 4


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory, reference_model):
    from tests.lora_helpers import make_peft_adapter

    root = tmp_path_factory.mktemp("probe-adapters")
    make_peft_adapter(reference_model, "attn", root / "good")
    return root


@pytest.fixture(scope="session")
def probe(demo_model_dir, adapter_root) -> Iterator[RunningServer]:
    running = start_server(demo_model_dir, api_key=PROBE_KEY, adapter_roots=[str(adapter_root)], max_model_len=64,
                           max_concurrent=PROBE_MAX_CONCURRENT, max_queue=PROBE_MAX_QUEUE)
    yield running
    running.stop()
