"""DeepSeek V2 / V2-Lite / V3 / R1 / V3.1 (MLA attention, `model_type` deepseek_v2 / deepseek_v3, and checkpoints
of those architectures under a model type of their own, e.g. Kimi-K2's kimi_k2): the family the KT engine serves
every `model_type` the registry does not list with, and the base of V3.2's."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engines.checkpoints.source import PER_EXPERT
from engines.kt.families.base import ExpertLayout, LoadContext, LoadedModel, ModelFamily
from engines.kt.families.deepseek_mla.load import load_mla

# the architectures served, and the transformers config class each loads with
SUPPORTED_ARCHITECTURES = {"DeepseekV2ForCausalLM": "DeepseekV2Config", "DeepseekV3ForCausalLM": "DeepseekV3Config"}
CPU_RULES = "DeepSeek-CPU.yaml"


class MLAFamily(ModelFamily):
    """DeepSeek V2 / V2-Lite / V3 / R1 (and checkpoints of those architectures under their own model_type, e.g.
    Kimi-K2) behind engines/kt/families/base.py's interface, loaded by load_mla; the base of the MLA generations
    that add to it (V3.2)."""

    name = "deepseek_mla"
    model_types = ("deepseek_v2", "deepseek_v3")
    architectures = tuple(SUPPORTED_ARCHITECTURES)
    expert_layout = ExpertLayout(pattern=PER_EXPERT, projections={"gate_proj": "gate", "up_proj": "up",
                                                                  "down_proj": "down"}, format="bf16")

    def __init__(self, architecture: str | None = None):
        if architecture is not None:  # the one this checkpoint names, for the model info
            self.architectures = (architecture,)

    def read_config(self, model_path: Path) -> Any:
        """The config class of the architecture, not of the `model_type`: checkpoints of this architecture under a
        model type of their own (Kimi-K2's kimi_k2) load without their remote code."""
        import transformers  # heavy, and only a load needs it

        return getattr(transformers, SUPPORTED_ARCHITECTURES[self.architectures[0]]).from_pretrained(model_path)

    def default_rule_file(self, config: Any, gpus: int) -> str:
        if not gpus:
            return CPU_RULES
        if config.model_type == "deepseek_v3":
            return "DeepSeek-V3.yaml"
        small = getattr(config, "n_routed_experts", 0) <= 64 and config.hidden_size <= 2048
        return "DeepSeek-V2-Lite.yaml" if small else "DeepSeek-V2.yaml"

    def build_model(self, config: Any) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)

    def checkpoint_name(self, name: str) -> str | None:
        return name

    def load(self, context: LoadContext) -> LoadedModel:
        return load_mla(self, context)
