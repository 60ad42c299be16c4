"""The V4 model runner: transformers' `DeepseekV4Model` (compressed sparse / heavily compressed attention,
the lightning indexer, hyper-connections, hash and sqrtsoftplus routing) with the routed experts swapped for
kt-kernel by the placement rules, and one V4 cache per sequence.

Each sequence keeps its own `DynamicCache` of V4's cache layers (sliding-window keys, compressor buffers and
compressed entries) in `seq.runner_state`; a step runs one forward per sequence in the step (a prompt chunk
or one decode token) and the shared scheduler batches requests continuously around it. That is the simple
correct form: the CPU experts see one sequence's tokens per call, and nothing is captured in CUDA graphs.
Caches are not paged or bounded by a budget: a sliding window of `sliding_window` positions plus one
compressed entry per 4 (CSA) or 128 (HCA) positions per layer, freed when the request ends.

LoRA adapters (PEFT, KT-SFT's fused expert LoRA and manifest) go through the shared `LoraModules`: a forward
is one sequence's, so its rows all use that request's adapter (`AdapterRows.uniform`), and requests with
different adapters or none share a step.

With `speculative: mtp` the checkpoint's MTP layer drafts (drafting.py): a drafted chunk feeds the sequence's last
token and its draft, and gets logits at each."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from engines.lora.install import LoraModules
from engines.lora.modules import AdapterRows
from engines.runtime.model_runner import ModelRunner, ScheduledChunk
from engines.runtime.sequence import Sequence


class V4ModelRunner(ModelRunner):
    chunked_prefill = True

    def __init__(self, model: nn.Module, max_model_len: int, checkpoint: Path | None = None, drafting: Any = None,
                 draft_unavailable: str | None = None):
        from transformers.cache_utils import DynamicCache

        self.model = model
        self.config = model.config
        self.max_model_len = max_model_len
        self.device = model.model.embed_tokens.weight.device
        self.head_device = model.lm_head.weight.device
        self._new_cache = lambda: DynamicCache(config=self.config)
        self._live = 0  # sequences holding a cache
        self.lora = LoraModules(model, self.config.hidden_size, checkpoint)
        self.drafting = drafting  # engines/kt/families/deepseek_v4/drafting.py: V4Drafting, or None
        self.drafts, self.draft_unavailable = drafting is not None, draft_unavailable
        if drafting is not None:
            drafting.bind(lambda adapter: self.lora.context.step(AdapterRows.uniform(adapter)))

    def _cache(self, seq: Sequence) -> Any:
        if seq.runner_state is None:
            seq.runner_state = self._new_cache()
            self._live += 1
        return seq.runner_state

    @torch.inference_mode()
    def _hidden(self, cache: Any, token_ids: list[int], start: int, end: int, adapter: str | None) -> torch.Tensor:
        """Final (hc-collapsed, normed) hidden states of positions [start, end) with `adapter` applied,
        extending `cache`."""
        ids = torch.tensor([token_ids[start:end]], device=self.device)
        positions = torch.arange(start, end, device=self.device)[None]
        with self.lora.context.step(AdapterRows.uniform(adapter)):
            out = self.model.model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> list[torch.Tensor | None]:
        logits: list[torch.Tensor | None] = []
        for chunk in chunks:
            seq, cache = chunk.seq, self._cache(chunk.seq)
            tokens = self.drafting.feed(chunk, cache) if self.drafting is not None else seq.token_ids
            hidden = self._hidden(cache, tokens, chunk.start, chunk.end + len(chunk.draft), seq.request.adapter)
            if self.drafting is not None:
                self.drafting.fed(chunk, cache)
            if chunk.all_logits:
                rows = hidden
            elif chunk.samples:  # the last position, and each draft token's
                rows = hidden[-1 - len(chunk.draft):]
            else:
                logits.append(None)
                continue
            logits.append(self.model.lm_head(rows.to(self.head_device)).float())
        return logits

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[list[int]]:
        if self.drafting is None:
            return super().propose(seqs, depths)
        return self.drafting.propose(seqs, depths)

    def release(self, seq: Sequence) -> None:
        if self.drafting is not None:
            self.drafting.forget(seq)
        if seq.runner_state is not None:
            seq.runner_state = None
            self._live -= 1

    def kv_usage(self) -> tuple[int, int]:
        return 0, 0  # not a paged pool: no fixed capacity to report

    def final_hidden_states(self, prompts: list[list[int]], adapter: str | None) -> list[torch.Tensor]:
        return [self._hidden(self._new_cache(), p, 0, len(p), adapter).float().cpu() for p in prompts]

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
