"""The engine contract: what the HTTP layer may ask of an engine, and the plain dataclasses that cross.

Everything below `server/` speaks in these types; pydantic never crosses this line and torch never crosses
it upwards.  An engine

* is built from an `EngineConfig`, loads its model in `start()` and releases it in `stop()`;
* accepts `GenerationRequest`s through `submit()`, returning a `RequestHandle` — an async iterator of
  `GenerationOutput` deltas that ends after the delta carrying a `finish_reason`; `handle.cancel()` (a
  client disconnect) makes the engine drop the request at its next step and free its KV cache;
* exposes `info` (model id, context length, architecture), `tokenizer` (a transformers tokenizer, used by
  the serving layer for chat templates and prompt lengths), `stats()` for health and metrics, `score()` for
  reward scores, `embed()` for embeddings, and adapter management (`list_adapters`, `load_adapter`, `unload_adapter`).

Errors a user can cause are raised as the typed exceptions below; the HTTP edge maps each to one status.
"""
from __future__ import annotations

import asyncio
import itertools
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
import json
from typing import (
    Any, AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Literal, Mapping, Sequence, TypeVar,
)


# ---------------------------------------------------------------------------------------------- errors
class EngineError(Exception):
    """Base of the errors engines raise on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request cannot be served as asked (HTTP 400). `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class NotFoundError(EngineError, LookupError):
    """An adapter / model name that is not loaded (HTTP 404)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class QueueFullError(EngineError):
    """The waiting queue is at its bound (HTTP 429)."""


class EngineUnavailableError(EngineError):
    """The engine is not running: loading, stopping or stopped (HTTP 503)."""


class UnsupportedError(EngineError):
    """The engine or model cannot do this (HTTP 400), e.g. scoring without a value head."""


# ------------------------------------------------------------------------------------------- requests
@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated by the serving layer before it gets here."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's logprob plus the top k
    prompt_logprobs: int | None = None  # same, for every prompt position after the first
    skip_special_tokens: bool = True
    grammar: "Grammar | None" = None  # structured output: what the text must match (the engine compiles it)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


# Compact JSON with the separators DeepSeek models write: no runs of whitespace a model could loop in.
JSON_WHITESPACE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class Grammar:
    """What the output must match, as data: a JSON schema (OpenAI's `response_format`) or a Lark grammar (a
    forced tool call). Engines compile and cache it (engines/runtime/structured.py). `param` names the request
    field it came from, for error messages; with `start_after` (a token id, e.g. `</think>`) the output is free
    until that token and constrained from the next one on."""

    kind: Literal["json_schema", "lark"]
    source: str  # the JSON schema as JSON text, or Lark grammar text
    param: str = "response_format"
    start_after: int | None = None


def json_schema_grammar(schema: dict[str, Any], param: str = "response_format") -> Grammar:
    """A grammar for JSON matching `schema`, written compactly."""
    return Grammar("json_schema", json.dumps({**schema, "x-guidance": JSON_WHITESPACE}), param)


def lark_json(schema: dict[str, Any]) -> str:
    """A JSON schema embedded in a Lark grammar rule (`args: %json {...}`), written compactly."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_WHITESPACE})


_request_counter = itertools.count()
INTERACTIVE, BACKGROUND = 0, 1  # GenerationRequest.priority of clients' requests and of background work


@dataclass(slots=True)
class GenerationRequest:
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None  # None: the base model
    request_id: str = field(default_factory=lambda: f"req-{next(_request_counter)}")
    # Admission order: waiting requests of a lower number are admitted first, equal ones in arrival order.
    # Interactive requests are INTERACTIVE; background work (the Batch API's lines) is BACKGROUND.
    priority: int = 0  # INTERACTIVE


# -------------------------------------------------------------------------------------------- outputs
@dataclass(slots=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float
    bytes: list[int] | None = None


@dataclass(slots=True)
class TokenLogprob(TopLogprob):
    """The logprob of one chosen (or prompt) token, with the most likely alternatives at that position."""

    top: list[TopLogprob] = field(default_factory=list)


@dataclass(slots=True)
class GenerationOutput:
    """One step's delta for one request. The last one has `finish_reason` set."""

    request_id: str
    text: str = ""  # new text since the previous delta
    token_ids: list[int] = field(default_factory=list)  # new tokens since the previous delta
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first delta only, when asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    prompt_tokens: int = 0
    completion_tokens: int = 0  # cumulative
    error: str | None = None  # set with finish_reason "error"
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache rather than computed
    # Ended because the server is shutting down (with finish_reason "abort" or "error"): readers test this,
    # never the error's text, to answer as a shutdown rather than a failure.
    server_shutdown: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _put_all(items: list[tuple[asyncio.Queue, GenerationOutput]]) -> None:
    for queue, output in items:
        queue.put_nowait(output)


class RequestHandle:
    """The caller's end of a submitted request: iterate for deltas, `cancel()` to abandon it.

    The engine thread delivers through `deliver()`, which hops onto the caller's event loop with
    `call_soon_threadsafe`; the queue therefore only ever sees the loop's own thread."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, on_cancel: Callable[[str], None]):
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[GenerationOutput] = asyncio.Queue()
        self._on_cancel = on_cancel
        self._done = False

    def deliver(self, output: GenerationOutput) -> None:
        """Thread-safe: called by the engine thread."""
        RequestHandle.deliver_all([(self, output)])

    @staticmethod
    def deliver_all(outputs: Iterable[tuple["RequestHandle", GenerationOutput]]) -> None:
        """Thread-safe: hand each output to its handle, waking each caller's loop once for all of them (a
        decode step delivers to every running request: one wake-up, not one per request, each of which
        would let the loop's thread take the GIL from the engine thread mid-step)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for handle, output in outputs:
            by_loop.setdefault(handle._loop, []).append((handle._queue, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's loop has closed; nobody is listening
                pass

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._on_cancel(self.request_id)

    @property
    def done(self) -> bool:
        return self._done

    def __aiter__(self) -> AsyncIterator[GenerationOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[GenerationOutput]:
        while True:
            output = await self._queue.get()
            yield output
            if output.finished:
                self._done = True
                return

    async def result(self) -> GenerationOutput:
        """Collect the whole generation into one output (non-streaming)."""
        return await whole_output(self.request_id, self)


async def whole_output(request_id: str, deltas: AsyncIterable[GenerationOutput]) -> GenerationOutput:
    """One request's deltas joined into one output: all text, tokens and logprobs, the last delta's ending."""
    text, ids, logprobs, prompt_lp = [], [], None, None
    last: GenerationOutput | None = None
    async for out in deltas:
        text.append(out.text)
        ids.extend(out.token_ids)
        if out.logprobs is not None:
            logprobs = (logprobs or []) + out.logprobs
        if out.prompt_logprobs is not None:
            prompt_lp = out.prompt_logprobs
        last = out
    assert last is not None
    return GenerationOutput(
        request_id=request_id, text="".join(text), token_ids=ids, logprobs=logprobs,
        prompt_logprobs=prompt_lp, finish_reason=last.finish_reason, stop_reason=last.stop_reason,
        prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens, error=last.error,
        cached_tokens=last.cached_tokens, server_shutdown=last.server_shutdown,
    )


def marker_prefix_tail(text: str, markers: "tuple[str, ...] | list[str]") -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers` (0 if none): the text a
    stream must hold back, because the next tokens may complete the marker (a stop string, `</think>`, the
    start of a tool call)."""
    longest = max((len(m) for m in markers), default=0)
    for k in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


# ------------------------------------------------------------------------------------ config and info
DEFAULT_CHUNK_SIZE = 2048  # prefill tokens per step unless the settings or the engine's load choose another


@dataclass(slots=True)
class EngineConfig:
    """What an engine is built from: the settings every engine understands, and in `settings` the user's
    engine-specific ones (`kt_*`, `vllm_*`, ...) by key, passed through untouched. Each engine reads the keys it
    owns into its own options (`engine_options` below; engines/kt/options.py, engines/vllm/settings.py) and
    ignores the rest."""

    model_path: str
    model_name: str | None = None  # the id clients use; default: the directory name
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" | "bfloat16" | "float16" | "float32"
    max_concurrent: int = 16  # requests generating at once; the rest wait
    max_queue: int = 1024  # waiting requests beyond which submit() raises QueueFullError
    max_model_len: int | None = None  # default: the model's own
    chunk_size: int | None = None  # prefill tokens per step (chunked prefill); None: the engine's default
    trust_remote_code: bool = False
    template: str | None = None  # built-in chat template name, overriding the model's
    adapters: dict[str, str] = field(default_factory=dict)  # name -> path, loaded at start
    settings: Mapping[str, Any] = field(default_factory=dict)  # engine-specific settings, by key


Options = TypeVar("Options")


def engine_options(cls: type[Options], settings: Mapping[str, Any]) -> Options:
    """An engine's options dataclass filled from the settings named as its fields; the others keep their
    defaults."""
    return cls(**{f.name: settings[f.name] for f in fields(cls) if f.name in settings})


@dataclass(frozen=True, slots=True)
class CheckpointStorage:
    """What the checkpoint is and how each part of the loaded model holds it, e.g. format "safetensors, FP8 e4m3
    in 128x128 blocks" with parts (("experts", "FP8 in place"), ("attention", "bf16 from FP8")): the start-up
    log and /version show it."""

    format: str
    parts: tuple[tuple[str, str], ...] = ()

    def summary(self) -> str:
        return "; ".join(f"{part} {storage}" for part, storage in self.parts)

    def as_dict(self) -> dict[str, Any]:
        return {"format": self.format, "storage": dict(self.parts), "summary": self.summary()}


@dataclass(slots=True)
class ModelInfo:
    id: str
    max_model_len: int
    architecture: str
    engine: str
    created: int
    eos_token_ids: tuple[int, ...] = ()
    has_value_head: bool = False
    size_bytes: int = 0  # the weights as stored in the model directory
    parameter_count: int = 0  # their elements (safetensors checkpoints; 0 when not known)
    gpu_bytes: int = 0  # of it, what the engine holds in GPU memory
    vocab_size: int = 0  # rows of the model's token embedding: valid token ids are [0, vocab_size); 0: unknown
    details: dict[str, str] = field(default_factory=dict)  # engine facts worth showing (/version)
    checkpoint: CheckpointStorage | None = None  # the checkpoint's format and each part's storage (/version)


@dataclass(slots=True)
class StepTimes:
    """Seconds the engine thread spent in model steps and where they went (engines/kt/step_timing.py says
    how each is measured)."""
    step: float = 0.0  # whole steps: forward, sampling, detokenizing, delivery
    forward: float = 0.0  # the runner's forward
    expert_wait: float = 0.0  # stalled on the CPU experts
    expert: float = 0.0  # CPU experts from submit to results ready (overlaps the rest)
    gpu: float = 0.0  # GPU stream time less those stalls


@dataclass(slots=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_used_tokens: int = 0
    kv_total_tokens: int = 0
    steps: int = 0
    times: StepTimes = field(default_factory=StepTimes)
    # prompt tokens of requests that started, and how many of them the prefix cache already held
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    # expert calls of prompt chunks that streamed experts to a GPU, and the bytes they copied there
    # (ktransformers engine with kt_gpu_prefill_tokens)
    streamed_expert_calls: int = 0
    streamed_expert_bytes: int = 0
    # running requests whose KV was freed to make room when the cache filled (they recompute it later)
    preemptions: int = 0
    # speculative decoding: draft tokens the model verified, and how many of them it kept
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # whether drafting is paused because it cost more than it saved, and the decode steps it sat out (paused, or
    # timing plain steps to compare against; engines/runtime/draft_gate.py)
    draft_paused: bool = False
    draft_paused_steps: int = 0


@dataclass(slots=True)
class AdapterInfo:
    name: str
    path: str
    created: int
    size_bytes: int = 0  # the adapter's tensors in memory
    expert_lora: str | None = None  # where its routed-expert LoRA runs (a kt-kernel SFT kernel, or torch); None: none


def check_token_ids(ids: list[int], vocab_size: int, param: str, what: str | None = None) -> None:
    """InvalidRequestError naming `param` unless every id is in [0, vocab_size): an id outside the model's
    embedding would fail the model step of every request batched with it. `what` names the list in the
    message (default: `param`; e.g. "input 2")."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        at, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        shown = str(bad) if len(str(bad)) <= 24 else f"{str(bad)[:20]}..."
        raise InvalidRequestError(f"{what or param}: token id {shown} at position {at} is outside this model's "
                                  f"vocabulary (ids 0 to {vocab_size - 1})", param=param)


# ---------------------------------------------------------------------------------------- the engine
class Engine(ABC):
    """Base of every engine. See the module docstring for the contract."""

    name: str = "base"

    def __init__(self, config: EngineConfig):
        self.config = config

    @abstractmethod
    def start(self) -> None:
        """Load the model and start the generation thread. Blocking; may take minutes."""

    @abstractmethod
    def stop(self) -> None:
        """Finish every request with `abort`, stop the thread, release the model."""

    @property
    @abstractmethod
    def ready(self) -> bool: ...

    _info: ModelInfo | None = None  # set by the engine once its model is loaded
    _tokenizer: Any = None

    @property
    def info(self) -> ModelInfo:
        if self._info is None:
            raise EngineUnavailableError("the model is still loading")
        return self._info

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def check_token_ids(self, ids: list[int], param: str, what: str | None = None) -> None:
        """`check_token_ids` against this model (its embedding's rows, else the tokenizer's size): the one
        check every path that takes token ids from a client goes through before the ids reach a batch."""
        check_token_ids(ids, self.info.vocab_size or len(self._tokenizer), param, what)

    @abstractmethod
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request. Raises InvalidRequestError, NotFoundError (adapter), QueueFullError,
        EngineUnavailableError. Must be called from a running event loop."""

    @abstractmethod
    def stats(self) -> EngineStats: ...

    def check_grammar(self, grammar: Grammar) -> None:
        """Compile `grammar` (SamplingParams.grammar) ahead of a request: InvalidRequestError naming its field
        when it is invalid. Blocking (the first call may index the vocabulary): call it off the event loop."""
        raise UnsupportedError(f"engine {self.name!r} cannot constrain output to a grammar ({grammar.param})")

    async def score(self, prompts: list[list[int]], adapter: str | None = None) -> list[float]:
        """Reward-model scores (value head on the last token) for each prompt."""
        raise UnsupportedError(f"engine {self.name!r} cannot compute reward scores")

    async def embed(self, prompts: list[list[int]], adapter: str | None = None) -> list[list[float]]:
        """One embedding per prompt: the final (normed) hidden states averaged over the prompt's tokens and
        scaled to unit length, with `adapter` applied. Concurrent calls may be computed together."""
        raise UnsupportedError(f"engine {self.name!r} cannot compute embeddings")

    # Adapters: an engine that serves LoRA sets `_adapters` (engines/lora/manager.py: AdapterManager).
    _adapters: Any = None

    def list_adapters(self) -> list[AdapterInfo]:
        return [] if self._adapters is None else self._adapters.list()

    def load_adapter(self, name: str, path: str, roots: Sequence[str] = ()) -> AdapterInfo:
        """Read and install the adapter at `path`. With `roots` (runtime loading), every file it opens must
        resolve inside one of them. Blocking: call it off the event loop."""
        if self._adapters is None:
            raise UnsupportedError(self._no_adapters_reason())
        return self._adapters.load(name, path, roots)

    def unload_adapter(self, name: str) -> None:
        if self._adapters is None:
            raise NotFoundError(f"adapter {name!r} is not loaded", param="lora_name")
        self._adapters.unload(name)

    def _no_adapters_reason(self) -> str:
        return f"engine {self.name!r} does not serve LoRA adapters"

    def _acquire_adapter(self, name: str | None) -> None:
        """Count a request that uses adapter `name` (NotFoundError when it is not loaded) until
        `_release_adapter`: an adapter unloaded meanwhile goes only when its last request has ended."""
        if name is None:
            return
        if self._adapters is None:
            raise NotFoundError(f"adapter {name!r} is not loaded", param="model")
        self._adapters.acquire(name)

    def _release_adapter(self, name: str | None) -> None:
        if name is not None and self._adapters is not None:
            self._adapters.release(name)

    @contextmanager
    def _adapter_in_use(self, name: str | None) -> Iterator[None]:
        """`_acquire_adapter` for the length of a block."""
        self._acquire_adapter(name)
        try:
            yield
        finally:
            self._release_adapter(name)
