"""What an engine must provide to run on the shared runtime: a ModelRunner.

The runtime's generation thread does the rest (scheduling, sampling, detokenizing, stop strings,
delivering deltas). A runner owns the model and the KV cache and computes logits for a batch of chunks."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engines.base import SamplingParams
from engines.runtime.batch_invariance import wants_invariance
from engines.runtime.sequence import Sequence


@dataclass(slots=True)
class ScheduledChunk:
    """Feed positions [start, end) of `seq.token_ids` this step (start == seq.num_computed)."""

    seq: Sequence
    start: int
    end: int
    all_logits: bool = False  # return logits for every fed position (prompt logprobs), not only the last
    # proposed tokens fed after position end - 1 at positions end, end + 1, ... to be verified (speculative.py)
    draft: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """This chunk reaches the end of the sequence, so the step yields a new token for it."""
        return self.end == len(self.seq.token_ids)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class ModelRunner(ABC):
    """Runs the model for the engine thread. Called only from that thread."""

    max_model_len: int
    chunked_prefill: bool = True  # False: the scheduler feeds a whole prompt in one step
    lora: object | None = None  # engines.lora.install.LoraModules when the runner serves LoRA adapters
    drafts: bool = False  # propose() works: the model has a draft head (speculative decoding)
    draft_unavailable: str | None = None  # why not, when drafting was asked for (logged by the runtime)
    # the most decoding sequences a step drafts for (more: the draft head sits the step out); None: the options'
    draft_max_batch: int | None = None
    # which requests this runner computes in batch-invariant steps (runtime/batch_invariance.py: POLICIES); "off"
    # for runners that do not (the huggingface runner computes each request alone anyway)
    batch_invariance: str = "off"

    def invariant_for(self, sampling: SamplingParams) -> bool:
        """Whether a request sampled with `sampling` runs in batch-invariant steps (`Sequence.batch_invariant`)."""
        return wants_invariance(self.batch_invariance, sampling)

    @abstractmethod
    def execute(self, chunks: list[ScheduledChunk]) -> list[torch.Tensor | None]:
        """Run one step. For each chunk, return float32 logits: shape [end - start, vocab] when `all_logits`,
        [1, vocab] (the last position) when it `samples`, else None; on the CPU or on the device that computed
        them (the sampler takes either, and a mix). A chunk with a `draft` also feeds the draft tokens after its
        last position and gets [1 + len(draft), vocab]: the last position's logits and each draft token's.
        Advance nothing: the caller updates `seq.num_computed`.

        A step that raises may be run again, whole or in parts (the engine looks for the request that made
        it fail): running the same chunks again must give what a first run would, so whatever a failed run
        left behind (KV rows written, a cache grown, work still pending) is overwritten, dropped or waited for."""

    @abstractmethod
    def release(self, seq: Sequence) -> None:
        """Free whatever the sequence holds (KV cache). Idempotent. Also how a sequence is preempted: it is
        later admitted again with all its tokens and recomputes them."""

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[list[int]]:
        """After a step (for runners that `drafts`): take in what the step computed for each of `seqs` — its
        positions below `seq.num_computed` now hold accepted tokens; positions past them held rejected draft
        tokens — and propose up to `depths[i]` tokens to follow `seqs[i].token_ids` (0: none)."""
        raise NotImplementedError(f"{type(self).__name__} has no draft head")

    def final_hidden_states(self, prompts: list[list[int]], adapter: str | None) -> list[torch.Tensor]:
        """Per prompt, [len(prompt), hidden] float32 on the CPU: the final (normed) hidden state at every
        position, with `adapter` applied, computed together in one forward where the runner can (reward
        scores, embeddings). Called on the engine thread, between steps."""
        raise NotImplementedError(f"{type(self).__name__} cannot return hidden states")

    def last_hidden_states(self, prompts: list[list[int]], adapter: str | None) -> torch.Tensor:
        """[len(prompts), hidden] float32: the final hidden state at each prompt's last token."""
        return torch.stack([states[-1] for states in self.final_hidden_states(prompts, adapter)])

    def gpu_bytes(self) -> int:
        """Bytes of the model's parameters and buffers in GPU memory."""
        model = getattr(self, "model", None)
        if model is None:
            return 0
        tensors = list(model.parameters()) + list(model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cuda")

    def admit(self, seq: Sequence) -> int | None:
        """Give `seq` KV room for the positions its tokens fill now (the prompt; after a preemption, the prompt
        and what it generated), if a small margin stays free for the running sequences to grow; else None
        (the request waits). Nothing is reserved for the tokens it may generate: it grows by `grow`.
        Returns how many leading positions of `seq` are already in the cache (prefix caching), so need
        no computing; always fewer than its length."""
        return 0

    def grow(self, seq: Sequence, num_positions: int) -> bool:
        """Make room for positions [0, num_positions) of an admitted `seq` before a step computes them;
        False, with nothing taken, when the cache is full (the scheduler then preempts a sequence). A runner
        whose cache is unbounded always has room."""
        return True

    def prefill_end(self, seq: Sequence, end: int) -> int:
        """Where a prompt chunk of `seq` from `seq.num_computed` that the scheduler would end at `end` ends: `end`,
        or a position before it (past `seq.num_computed`) where the runner keeps the cache's state for its prefix
        cache (DeepSeek-V4's, whose states are whole caches at one position). The next chunk starts there."""
        return end

    def prefix_in_flight(self, seq: Sequence, prefilling: list[Sequence]) -> bool:
        """Whether one of `prefilling` (admitted, its prompt not all computed) is computing leading pages of
        `seq`'s prompt that the prefix cache does not hold yet; `seq` then waits for them instead of computing
        them a second time (n > 1 choices, a batch of prompts sharing a preamble). False without a prefix
        cache."""
        return False

    def kv_usage(self) -> tuple[int, int]:
        """(used, total) KV cache positions; total 0 when unbounded."""
        return 0, 0

    def step_times(self) -> dict[str, float]:
        """Cumulative seconds of model steps by where they went, for runners that measure it (KT engine):
        `expert_wait` (the step stalled on CPU experts), `expert` (CPU experts submitted -> results ready),
        `gpu` (GPU stream time of steps, less the expert waits). Absent keys read as 0."""
        return {}

    def streamed_experts(self) -> tuple[int, int]:
        """(expert calls that streamed experts to a GPU, bytes they copied), for runners that stream (KT engine
        with kt_gpu_prefill_tokens); cumulative."""
        return 0, 0

    def close(self) -> None:
        """Release the model."""
