"""One request's whole state inside the engine, owned by the generation thread."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engines.base import GenerationRequest, RequestHandle, SamplingParams, TokenLogprob
from engines.runtime.detokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    request: GenerationRequest
    handle: RequestHandle
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)  # prompt, then generated tokens
    num_prompt_tokens: int = 0
    num_computed: int = 0  # positions whose KV is in the cache
    num_cached_tokens: int = 0  # leading prompt positions found in the prefix cache at admission
    preemptions: int = 0  # times its KV was freed to make room (it then recomputes its tokens)
    status: Status = Status.WAITING
    generator: torch.Generator | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    # runner-private state (KV block table, HF cache object, ...), keyed by the runner
    runner_state: object | None = None
    logits_processor: Any = None  # the compiled SamplingParams.grammar (engines/runtime/structured.py)
    draft: tuple[int, ...] = ()  # tokens the draft head proposed to follow token_ids (speculative.py)
    # computed in steps of its own, its prompt cut every chunk size from where its computing starts
    # (runtime/batch_invariance.py); that start: the positions the prefix cache held when it was admitted
    batch_invariant: bool = False
    prefill_origin: int = 0

    @classmethod
    def create(cls, request: GenerationRequest, handle: RequestHandle, detokenizer: IncrementalDetokenizer,
               logits_processor: Any = None):
        seq = cls(request=request, handle=handle, detokenizer=detokenizer,
                  token_ids=list(request.prompt_token_ids), num_prompt_tokens=len(request.prompt_token_ids),
                  logits_processor=logits_processor)
        if request.sampling.seed is not None:
            seq.generator = torch.Generator().manual_seed(request.sampling.seed)
        if request.sampling.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first prompt token has no context to be scored in
        return seq

    @property
    def id(self) -> str:
        return self.request.request_id

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.token_ids) - 1 or self.num_output_tokens == 0

    def __len__(self) -> int:
        return len(self.token_ids)
