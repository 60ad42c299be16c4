"""The engine half every engine shares: one generation thread that owns the model runner.

Each step: take cancellations, ask the scheduler for a batch, run the model once, then for each sequence
that reached its end sample a token, detokenize, check the stop conditions and push a delta to its handle.

One request must never fail another. Token ids are checked against the model before a request joins a batch
(`Engine.check_token_ids`), and an exception inside a model step fails only the request that caused it: the
step's chunks run again in halves until the ones that fail alone are found (`_execute`); the rest go on."""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from abc import abstractmethod
from dataclasses import replace
from typing import Any

import torch

from engines.base import (
    DEFAULT_CHUNK_SIZE, Engine, EngineConfig, EngineStats, EngineUnavailableError, GenerationOutput,
    GenerationRequest, Grammar, InvalidRequestError, ModelInfo, RequestHandle, UnsupportedError, engine_options,
)
from engines.lora import value_head
from engines.lora.manager import AdapterManager
from engines.model_files import parameter_count, weights_size
from engines.runtime.batch_invariance import solo_groups
from engines.runtime.detokenizer import IncrementalDetokenizer
from engines.runtime.embeddings import EmbeddingQueue
from engines.runtime.model_runner import ModelRunner, ScheduledChunk
from engines.runtime.sampler import Sampler
from engines.runtime.scheduler import Scheduler
from engines.runtime.sequence import Sequence
from engines.runtime.speculative import SpeculativeOptions, Speculator
from engines.runtime.structured import compiler_for

log = logging.getLogger("ktserve.engine")


def check_length(request: GenerationRequest, limit: int) -> None:
    """InvalidRequestError for an empty prompt, or one that leaves no room for max_tokens within `limit`."""
    n_prompt = len(request.prompt_token_ids)
    if n_prompt == 0:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if n_prompt + request.sampling.max_tokens > limit:
        raise InvalidRequestError(
            f"this model's maximum context length is {limit} tokens; the prompt has {n_prompt} tokens and "
            f"max_tokens asks for {request.sampling.max_tokens} more", param="max_tokens")


class LLMEngine(Engine):
    """Subclasses implement `_load()`; everything else is shared."""

    torch_threads: int | None = None  # the generation thread's torch CPU threads; None: torch's default

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self._runner: ModelRunner | None = None
        self._tokenizer: Any = None
        self._info: ModelInfo | None = None
        self._scheduler: Scheduler | None = None
        self._sampler: Sampler | None = None
        self._speculator: Speculator | None = None  # drafting (speculative decoding), when asked for and possible
        self._sequences: dict[str, Sequence] = {}
        self._cancelled: set[str] = set()
        self._cancel_lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats = EngineStats()
        # work other threads hand to the generation thread (adapter swaps, scoring), run between steps
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._adapters: Any = None  # engines.lora.manager.AdapterManager, when the runner supports LoRA
        self._value_head: Any = None  # the model directory's reward head, if it has one
        self._embeddings: EmbeddingQueue | None = None
        # outputs made during a step, delivered together when it ends (RequestHandle.deliver_all)
        self._outbox: collections.deque = collections.deque()

    # ------------------------------------------------------------------------------ subclass hook
    @abstractmethod
    def _load(self) -> tuple[ModelRunner, Any, ModelInfo]:
        """Build the model runner, the tokenizer and the model info."""

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._runner, self._tokenizer, self._info = self._load()
        if self.config.chunk_size is None:  # an engine whose load did not choose one
            self.config.chunk_size = DEFAULT_CHUNK_SIZE
        self._info.size_bytes = weights_size(self.config.model_path)
        self._info.parameter_count = parameter_count(self.config.model_path)
        self._info.gpu_bytes = self._runner.gpu_bytes()
        self._sampler = Sampler(self._tokenizer, self._info.eos_token_ids)
        self._scheduler = Scheduler(self._runner, max_running=self.config.max_concurrent,
                                    max_queue=self.config.max_queue, chunk_size=self.config.chunk_size)
        self._speculator = Speculator.create(self._runner, engine_options(SpeculativeOptions, self.config.settings),
                                             self.name)
        self._start_adapters()
        self._embeddings = EmbeddingQueue(self._runner, self._command, token_budget=self.config.chunk_size)
        self._thread = threading.Thread(target=self._loop, name=f"{self.name}-generation", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        while not self._commands.empty():
            _, future = self._commands.get_nowait()
            future.set_exception(EngineUnavailableError("the engine is shutting down"))
        for seq in list(self._sequences.values()):
            self._finish(seq, "abort", error="the server is shutting down", server_shutdown=True)
        self._send_outbox()
        if self._runner is not None:
            self._runner.close()

    @property
    def ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def stats(self) -> EngineStats:
        s = self._stats
        if self._scheduler is not None:
            s.running, s.waiting = self._scheduler.counts()
            s.prompt_tokens = self._scheduler.prompt_tokens
            s.cached_prompt_tokens = self._scheduler.cached_prompt_tokens
            s.preemptions = self._scheduler.preemptions
        if self._runner is not None:
            s.kv_used_tokens, s.kv_total_tokens = self._runner.kv_usage()
            times = self._runner.step_times()
            s.times.expert_wait = times.get("expert_wait", 0.0)
            s.times.expert = times.get("expert", 0.0)
            s.times.gpu = times.get("gpu", 0.0)
            s.streamed_expert_calls, s.streamed_expert_bytes = self._runner.streamed_experts()
        if self._speculator is not None:
            s.draft_tokens, s.accepted_draft_tokens = self._speculator.drafted, self._speculator.accepted
            gate = self._speculator.gate
            if gate is not None:
                s.draft_paused, s.draft_paused_steps = gate.paused, gate.paused_steps
        return replace(s, times=replace(s.times))

    # ------------------------------------------------------------------------------ requests
    def submit(self, request: GenerationRequest) -> RequestHandle:
        if not self.ready or self._scheduler is None:
            raise EngineUnavailableError("the engine is not serving (loading or shutting down)")
        check_length(request, self.info.max_model_len)
        self.check_token_ids(request.prompt_token_ids, "prompt")
        self._acquire_adapter(request.adapter)  # released when the sequence finishes (_finish)
        try:
            return self._enqueue(request)
        except Exception:
            self._release_adapter(request.adapter)
            raise

    def _enqueue(self, request: GenerationRequest) -> RequestHandle:
        assert self._scheduler is not None
        loop = asyncio.get_running_loop()
        handle = RequestHandle(request.request_id, loop, self._cancel)
        p = request.sampling
        detok = IncrementalDetokenizer(self._tokenizer, skip_special_tokens=p.skip_special_tokens, stop=p.stop,
                                       include_stop_str_in_output=p.include_stop_str_in_output)
        processor = compiler_for(self._tokenizer).processor(p.grammar) if p.grammar is not None else None
        seq = Sequence.create(request, handle, detok, processor)
        seq.batch_invariant = self._runner.invariant_for(p)
        self._sequences[seq.id] = seq  # before the scheduler can hand it to the thread
        try:
            self._scheduler.add(seq)
        except Exception:
            self._sequences.pop(seq.id, None)
            raise
        self._wakeup.set()
        return handle

    def check_grammar(self, grammar: Grammar) -> None:
        compiler_for(self._tokenizer).compile(grammar)

    # ------------------------------------------------------------------------------ adapters and scores
    def _start_adapters(self) -> None:
        assert self._runner is not None and self._info is not None
        self._value_head = value_head.read(self.config.model_path)
        self._info.has_value_head = self._value_head is not None
        modules = getattr(self._runner, "lora", None)
        if modules is not None:
            self._adapters = AdapterManager(modules, self.run_on_engine_thread, self._info.id)
        for name, path in self.config.adapters.items():  # before the thread starts: installed inline
            info = self.load_adapter(name, path)
            log.info("adapter %s loaded from %s%s", info.name, info.path,
                     f" (routed-expert LoRA: {info.expert_lora})" if info.expert_lora else "")

    async def score(self, prompts: list[list[int]], adapter: str | None = None) -> list[float]:
        """The value head (the adapter's, else the model directory's) on each prompt's last final hidden state."""
        if not self.ready:
            raise EngineUnavailableError("the engine is not serving (loading or shutting down)")
        head = self._value_head
        for i, prompt in enumerate(prompts):
            self.check_token_ids(prompt, "input", f"input {i}")
        with self._adapter_in_use(adapter):
            if adapter is not None:
                head = self._adapters.value_head(adapter) or head
            if head is None:
                raise UnsupportedError("this model has no value head (value_head.safetensors in the model directory "
                                       "or in a reward adapter's), so it cannot compute reward scores")
            runner = self._runner
            hidden = await asyncio.wrap_future(self._command(lambda: runner.last_hidden_states(prompts, adapter)))
            return [float(v) for v in head(hidden).nan_to_num()]

    async def embed(self, prompts: list[list[int]], adapter: str | None = None) -> list[list[float]]:
        """Mean-pooled, unit-length final hidden states (engines/runtime/embeddings.py), batched with the
        other embedding requests waiting for the engine thread."""
        if not self.ready or self._embeddings is None:
            raise EngineUnavailableError("the engine is not serving (loading or shutting down)")
        limit = self.info.max_model_len
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise InvalidRequestError(f"input {i} is empty", param="input")
            if len(prompt) > limit:
                raise InvalidRequestError(f"input {i} has {len(prompt)} tokens; this model's maximum context "
                                          f"length is {limit}", param="input")
            self.check_token_ids(prompt, "input", f"input {i}")
        with self._adapter_in_use(adapter):
            return await asyncio.wrap_future(self._embeddings.submit(prompts, adapter))

    def run_on_engine_thread(self, fn):
        """Run `fn` on the generation thread between two steps and return its result (blocking). Before
        the thread runs, and on the thread itself, `fn` runs at once."""
        if self._thread is None or threading.current_thread() is self._thread:
            return fn()
        return self._command(fn).result()

    def _command(self, fn) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._thread is None or not self._thread.is_alive():
            future.set_exception(EngineUnavailableError("the engine is not running"))
            return future
        self._commands.put((fn, future))
        self._wakeup.set()
        return future

    def _run_commands(self) -> None:
        while not self._commands.empty():
            fn, future = self._commands.get_nowait()
            try:
                with torch.inference_mode():
                    future.set_result(fn())
            except BaseException as exc:  # handed to the waiting caller
                future.set_exception(exc)

    def _cancel(self, request_id: str) -> None:
        with self._cancel_lock:
            self._cancelled.add(request_id)
        self._wakeup.set()

    # ------------------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        assert self._scheduler is not None and self._runner is not None
        if self.torch_threads is not None:
            # torch's intra-op thread count is per thread: set it where the step's CPU work (sampling,
            # CPU-side tensors) runs, not where the model was loaded
            torch.set_num_threads(self.torch_threads)
        while not self._stopping.is_set():
            self._run_commands()
            self._take_cancellations()
            chunks = self._scheduler.schedule()
            if not chunks:
                self._send_outbox()
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            if self._speculator is not None:
                self._speculator.attach(chunks)
            started = time.perf_counter()
            with torch.inference_mode():
                computed = self._execute(chunks)
            self._stats.times.forward += time.perf_counter() - started
            try:
                sampling = [(chunk, rows) for chunk, rows in computed if self._advance(chunk, rows)]
                for seq, picked in self._pick(sampling):
                    for token, logprob in picked:
                        if seq.id in self._sequences:  # not finished by the token before
                            self._emit(seq, token, logprob)
                if self._speculator is not None:
                    self._speculator.propose([chunk.seq for chunk, _ in computed if chunk.seq.id in self._sequences])
            except Exception as exc:  # one bad step must not take the server down
                log.exception("sampling failed; failing the %d requests of the step", len(computed))
                for chunk, _ in computed:
                    if chunk.seq.id in self._sequences:
                        self._finish(chunk.seq, "error", error=f"internal error in the model step: {exc}")
            # the step is counted before its tokens go out: a caller woken by a token then reads stats that hold
            # the step which made it (bench's step breakdown snapshots them at the first token; delivered first, a
            # prompt's step sometimes landed in the decode steps' figures)
            self._stats.steps += 1
            elapsed = time.perf_counter() - started
            self._stats.times.step += elapsed
            self._send_outbox()
            if self._speculator is not None:
                self._speculator.timed(elapsed)

    def _execute(self, chunks: list[ScheduledChunk]) -> list[tuple[ScheduledChunk, torch.Tensor | None]]:
        """Run a step: the chunks of batch-invariant sequences each alone, the others together
        (runtime/batch_invariance.py); (chunk, logits) for each chunk that computed."""
        computed: list[tuple[ScheduledChunk, torch.Tensor | None]] = []
        for group in solo_groups(chunks, [c.seq.batch_invariant for c in chunks]):
            computed += self._execute_together(group)
        return computed

    def _execute_together(self, chunks: list[ScheduledChunk]) -> list[tuple[ScheduledChunk, torch.Tensor | None]]:
        """Run chunks as one step; (chunk, logits) for each chunk that computed. When the step raises, its chunks
        run again in halves (ModelRunner.execute advances nothing, so a retry is safe) until the chunks that fail
        alone are found: those requests fail, the others go on with the logits they get as a smaller batch."""
        try:
            return list(zip(chunks, self._runner.execute(chunks)))
        except Exception as exc:
            if len(chunks) == 1:
                self._fail_alone(chunks[0], exc)
                return []
            log.warning("a model step of %d requests failed (%s: %s); running them in parts to find the request "
                        "that caused it", len(chunks), type(exc).__name__, exc)
        return self._isolate(chunks)

    def _isolate(self, chunks: list[ScheduledChunk]) -> list[tuple[ScheduledChunk, torch.Tensor | None]]:
        computed: list[tuple[ScheduledChunk, torch.Tensor | None]] = []
        half = len(chunks) // 2
        for part in (chunks[:half], chunks[half:]):
            try:
                computed += zip(part, self._runner.execute(part))
            except Exception as exc:
                if len(part) == 1:
                    self._fail_alone(part[0], exc)
                else:
                    computed += self._isolate(part)
        return computed

    def _fail_alone(self, chunk: ScheduledChunk, exc: Exception) -> None:
        seq = chunk.seq
        log.error("request %s failed in the model step (positions %d-%d of %d): %s: %s", seq.id, chunk.start,
                  chunk.end, len(seq), type(exc).__name__, exc, exc_info=exc)
        if seq.id in self._sequences:
            self._finish(seq, "error", error=f"internal error in the model step: {exc}")

    def _pick(self, sampling: list[tuple[ScheduledChunk, torch.Tensor]]) -> list[tuple[Sequence, list]]:
        """The tokens (and logprob entries) each sampled sequence takes this step: one, or with drafting the
        draft tokens verification kept and one more (engines/runtime/speculative.py)."""
        assert self._sampler is not None
        if self._speculator is not None:
            return self._speculator.pick(self._sampler, sampling)
        tokens = self._sampler.sample_batch([rows[-1] for _, rows in sampling], [chunk.seq for chunk, _ in sampling])
        return [(chunk.seq, [token]) for (chunk, _), token in zip(sampling, tokens)]

    def _send_outbox(self) -> None:
        outputs = []
        while self._outbox:
            outputs.append(self._outbox.popleft())
        if outputs:
            RequestHandle.deliver_all(outputs)

    def _take_cancellations(self) -> None:
        with self._cancel_lock:
            cancelled, self._cancelled = self._cancelled, set()
        for request_id in cancelled:
            seq = self._sequences.get(request_id)
            if seq is not None:
                self._finish(seq, "abort")

    def _advance(self, chunk: ScheduledChunk, rows: torch.Tensor | None) -> bool:
        """Account for the computed chunk; True when its sequence now takes a sampled token."""
        seq = chunk.seq
        if seq.id not in self._sequences:
            return False
        if chunk.all_logits and rows is not None:
            self._record_prompt_logprobs(chunk, rows)
        seq.num_computed = chunk.end
        if not chunk.samples:
            return False
        if seq.sampling.max_tokens == 0:  # scoring only: the prompt's logprobs were the point
            self._finish(seq, "length")
            return False
        assert self._sampler is not None and rows is not None
        return True

    def _emit(self, seq: Sequence, token: int, logprob) -> None:
        """Append the sampled token, detokenize, and finish the sequence or deliver the new text."""
        seq.token_ids.append(token)
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
        seq.detokenizer.add_token(token)
        reason, stop_reason = self._finish_reason(seq, token)
        if reason is not None:
            self._finish(seq, reason, stop_reason=stop_reason, new_tokens=[token],
                         logprobs=[logprob] if logprob else None)
        else:
            self._deliver(seq, seq.detokenizer.take_delta(), [token], [logprob] if logprob else None)

    def _finish_reason(self, seq: Sequence, token: int) -> tuple[str | None, str | int | None]:
        p = seq.sampling
        if seq.detokenizer.stopped_by is not None:
            return "stop", seq.detokenizer.stopped_by
        if seq.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                return "stop", token
            if not p.ignore_eos and token in self.info.eos_token_ids:
                return "stop", None
        if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.info.max_model_len:
            return "length", None
        return None, None

    def _record_prompt_logprobs(self, chunk: ScheduledChunk, rows: torch.Tensor) -> None:
        seq = chunk.seq
        assert self._sampler is not None and seq.prompt_logprobs is not None
        # row r predicts position start + r + 1; rows whose position has its entry (computed before a
        # preemption) are skipped
        skip = max(0, len(seq.prompt_logprobs) - 1 - chunk.start)
        targets = seq.token_ids[chunk.start + 1 + skip:min(chunk.end + 1, seq.num_prompt_tokens)]
        seq.prompt_logprobs += self._sampler.prompt_entries(rows[skip:skip + len(targets)], targets,
                                                            seq.sampling.prompt_logprobs or 0)

    # ------------------------------------------------------------------------------ delivery
    def _deliver(self, seq: Sequence, text: str, tokens: list[int], logprobs, finish_reason=None,
                 stop_reason=None, error=None, server_shutdown=False) -> None:
        prompt_logprobs = None
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        if not (text or tokens or finish_reason or prompt_logprobs):
            return
        self._outbox.append((seq.handle, GenerationOutput(
            request_id=seq.id, text=text, token_ids=tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            finish_reason=finish_reason, stop_reason=stop_reason, prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens, error=error, cached_tokens=seq.num_cached_tokens,
            server_shutdown=server_shutdown)))

    def _finish(self, seq: Sequence, reason: str, *, stop_reason=None, error=None, new_tokens=(),
                logprobs=None, server_shutdown=False) -> None:
        if self._sequences.pop(seq.id, None) is not None:
            self._release_adapter(seq.request.adapter)
        assert self._scheduler is not None and self._runner is not None
        self._scheduler.remove(seq)
        self._runner.release(seq)
        seq.detokenizer.flush()
        self._deliver(seq, seq.detokenizer.take_delta(final=True), list(new_tokens), logprobs,
                      finish_reason=reason, stop_reason=stop_reason, error=error, server_shutdown=server_shutdown)
