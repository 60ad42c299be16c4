"""The tiny DeepSeek-V3.2 these tests serve, and transformers' reference on it."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def v32_dir(tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3.2 in its released layout, written as a user writes it: `ktserve make-demo-model DIR
    --arch deepseek_v32`."""
    from server.cli import main

    out = tmp_path_factory.mktemp("v32")
    assert main(["make-demo-model", str(out), "--arch", "deepseek_v32"]) == 0
    return out


@pytest.fixture(scope="session")
def v32_reference(v32_dir, tmp_path_factory):
    """transformers' DeepseekV32ForCausalLM in float32 on the dequantized weights (the MTP layer left out)."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from engines.checkpoints.source import SafetensorsSource

    out = tmp_path_factory.mktemp("v32-dequantized")
    config = json.loads((v32_dir / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    weights = SafetensorsSource(v32_dir, config["num_hidden_layers"]).state_dict(torch.float32)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(v32_dir / name, out / name)
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def v32_tokenizer(v32_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(v32_dir)
