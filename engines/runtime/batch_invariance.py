"""Batch-invariant requests: their tokens and logprobs do not depend on what else is batched with them.

A row computed among other rows does not get the bits it gets alone, however carefully each kernel is chosen.
Measured on the CPU with torch 2.13 (MKL, AVX-512): float32 `F.linear` of one row differs in the last bits alone
and as the first of 2, 4, 16 or 40 rows at every shape tried; products over fixed blocks of 16 rows cure that,
but then elementwise functions do not hold still either: DeepSeek-V4's hyper-connection computes
`2 * sigmoid(post_w * scale + b)` on a strided slice, and the first 15 rows of a 55-row call come out in other bits
than the same 15 rows alone (torch takes its vectorized or its scalar sigmoid by where an element falls in the
loop). Every kernel of a model would have to be written for it. So a batch-invariant request is computed in steps
of its own instead:
- **each step, its chunk runs alone** (`solo_groups`): the engine runs the step's other chunks together and each
  batch-invariant chunk by itself, so its arithmetic is exactly that of the same request served alone, on every
  path a runner takes (CUDA graphs, FlashInfer, experts handed to the GPU by call size, deferral by batch size);
- **its prompt is cut every chunk size from where its computing starts** (engines/runtime/scheduler.py), not where
  its neighbours left the token budget, so its chunks are the same whoever shares the step;
- **prefix-cache pages** are the one thing that still moves its numbers: the positions after borrowed pages are
  computed over a cache instead of in one chunk with them, and the pages themselves hold whatever bits the step
  that computed them gave. A request that borrows is computed as the same request served alone with the same
  pages cached: its numbers follow the cache's history, not its batch. Prompt logprobs (echo, scoring, lm-eval's
  loglikelihood) never borrow, so they are the same bits every time; `prefix_cache: false` makes every request so.
  DeepSeek-V4's prefix cache keeps whole cache states, for a batch-invariant request where a step ended
  (engines/kt/families/deepseek_v4/prefixes.py): the same request again, started from the state its first run
  kept, computes its tail in the chunk and over the cache its first run did, so it gets the same bits (where the
  chunk size is a multiple of its 128-position pages).
kt-kernel's CPU kernels compute a row alike at every call size (tests/engines/runtime/test_batch_invariance.py
measures it per method), so the experts would not need the split; the rest of the model does.

The cost is the batching those requests give up: their decode steps read the weights once per request. Which
requests pay it is the `batch_invariant` setting (`POLICIES`): by default those whose numbers are compared
(logprobs, prompt logprobs, scores, embeddings). `python -m bench.batch_invariance` prints what it costs."""
from __future__ import annotations

from typing import TypeVar

from engines.base import SamplingParams

# "scores": requests that return logprobs or prompt logprobs, and every score and embedding; "all": every request;
# "off": none (the fastest steps)
POLICIES = ("scores", "all", "off")

Chunk = TypeVar("Chunk")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"batch_invariant must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


def wants_invariance(policy: str, sampling: SamplingParams) -> bool:
    """Whether a generation request with `sampling` is batch-invariant under `policy`."""
    if policy == "all":
        return True
    if policy == "scores":
        return sampling.logprobs is not None or sampling.prompt_logprobs is not None
    return False


def scores_are_invariant(policy: str) -> bool:
    """Whether scores and embeddings (computed apart from generation) are batch-invariant under `policy`."""
    return policy != "off"


def solo_groups(chunks: list[Chunk], invariant: list[bool]) -> list[list[Chunk]]:
    """The step's chunks as the runner computes them: those not `invariant` together (first), each invariant one
    alone."""
    together = [c for c, solo in zip(chunks, invariant) if not solo]
    return ([together] if together else []) + [[c] for c, solo in zip(chunks, invariant) if solo]
