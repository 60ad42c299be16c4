"""The "huggingface" engine: a plain transformers model, the correctness reference.

Each request keeps its own transformers KV cache and runs as its own forward pass; nothing is batched
across requests, so this engine is simple rather than fast. It loads any causal LM directory transformers
can load (CPU here, CUDA when present)."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from engines.base import CheckpointStorage, ModelInfo
from engines.checkpoints.gguf.files import is_gguf
from engines.checkpoints.source import SafetensorsSource, describe, dtype_name, quantization_block
from engines.lora.install import LoraModules
from engines.lora.modules import AdapterRows
from engines.runtime.llm_engine import LLMEngine
from engines.runtime.model_runner import ModelRunner, ScheduledChunk
from engines.runtime.sequence import Sequence
from engines.model_files import load_tokenizer, model_id, resolve_device, resolve_dtype, eos_token_ids, context_length

log = logging.getLogger("ktserve.engine.hf")


class HFModelRunner(ModelRunner):
    def __init__(self, model: Any, device: torch.device, max_model_len: int):
        self.model = model
        self.device = device
        self.max_model_len = max_model_len
        self.lora = LoraModules(model, model.config.hidden_size)

    def execute(self, chunks: list[ScheduledChunk]) -> list[torch.Tensor | None]:
        return [self._run_one(chunk) for chunk in chunks]

    def _run_one(self, chunk: ScheduledChunk) -> torch.Tensor | None:
        from transformers import DynamicCache

        seq = chunk.seq
        if seq.runner_state is None:
            seq.runner_state = DynamicCache(config=self.model.config)
        else:  # a retried step: drop what its first run added, in every layer it reached
            for layer in seq.runner_state.layers:
                extra = layer.get_seq_length() - chunk.start
                if extra > 0:
                    layer.crop(-extra)
        ids = torch.tensor([seq.token_ids[chunk.start:chunk.end]], dtype=torch.long, device=self.device)
        keep = ids.shape[1] if chunk.all_logits else 1
        with self.lora.context.step(AdapterRows.uniform(seq.request.adapter)):
            out = self.model(input_ids=ids, past_key_values=seq.runner_state, use_cache=True, logits_to_keep=keep)
        if not (chunk.all_logits or chunk.samples):
            return None
        return out.logits[0].float().cpu()

    def release(self, seq: Sequence) -> None:
        seq.runner_state = None

    def final_hidden_states(self, prompts: list[list[int]], adapter: str | None) -> list[torch.Tensor]:
        """All prompts in one forward, right-padded: the causal mask keeps the padding out of every real
        position."""
        longest = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), longest, dtype=torch.long)
        mask = torch.zeros(len(prompts), longest, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, :len(prompt)] = torch.tensor(prompt)
            mask[i, :len(prompt)] = 1
        with self.lora.context.step(AdapterRows.uniform(adapter)):
            hidden = self.model.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      use_cache=False).last_hidden_state.float().cpu()
        return [hidden[i, :len(prompt)] for i, prompt in enumerate(prompts)]


def checkpoint_storage(model_path: Path, dtype: torch.dtype) -> tuple[CheckpointStorage, dict[str, Any]]:
    """The checkpoint's format and storage, and its weights when from_pretrained cannot read them itself (as a
    state dict with the config, else {}): an FP8 release comes as its
    weights dequantized to `dtype` (engines/checkpoints: DeepSeek's 128x128 blocks, a partial last block included,
    which transformers' own CPU dequantization spreads differently), its MTP layer left out."""
    from transformers import AutoConfig

    config_path = model_path / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    block = quantization_block(config, config_path)
    checkpoint_format, stored = describe(config, block)
    held = dtype_name(dtype)
    storage = CheckpointStorage(checkpoint_format, (("weights", held if held == stored else f"{held} from {stored}"),))
    if block is None:
        return storage, {}
    hf_config = AutoConfig.from_pretrained(model_path)
    del hf_config.quantization_config
    state = SafetensorsSource(model_path, hf_config.num_hidden_layers).state_dict(dtype)
    return storage, {"config": hf_config, "state_dict": state}


class HFEngine(LLMEngine):
    name = "huggingface"

    def _load(self) -> tuple[ModelRunner, Any, ModelInfo]:
        from transformers import AutoModelForCausalLM

        cfg = self.config
        if is_gguf(cfg.model_path):
            raise ValueError(f"model: {cfg.model_path} is a GGUF checkpoint, which the huggingface engine does not "
                             "read (transformers has no deepseek2 GGUF support); serve it with engine ktransformers")
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        started = time.perf_counter()
        tokenizer = load_tokenizer(cfg.model_path, cfg.template, cfg.trust_remote_code)
        storage, weights = checkpoint_storage(Path(cfg.model_path), dtype)
        if weights:  # the checkpoint's weights as a state dict: the model class is read off the config
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

            model = MODEL_FOR_CAUSAL_LM_MAPPING[type(weights["config"])].from_pretrained(None, dtype=dtype, **weights)
        else:
            model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=dtype,
                                                         trust_remote_code=cfg.trust_remote_code)
        model = model.to(device).eval()
        max_len = context_length(model.config, tokenizer, cfg.max_model_len)
        log.info("loaded %s on %s (%s) in %.1fs; checkpoint: %s; %s", cfg.model_path, device, dtype,
                 time.perf_counter() - started, storage.format, storage.summary())
        info = ModelInfo(id=model_id(cfg), max_model_len=max_len,
                         architecture=(model.config.architectures or [type(model).__name__])[0],
                         engine=self.name, created=int(time.time()),
                         eos_token_ids=eos_token_ids(model.config, tokenizer, Path(cfg.model_path)),
                         vocab_size=model.get_input_embeddings().num_embeddings, checkpoint=storage)
        return HFModelRunner(model, device, max_len), tokenizer, info
