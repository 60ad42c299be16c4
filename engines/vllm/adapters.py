"""LoRA adapters on vLLM: the `modules` side of the shared `AdapterManager` (which keeps names, use counts
and deferred unloads), installing each adapter into vLLM as a `LoRARequest` that requests then name.

Adapters are read with our own reader first, so what vLLM cannot apply is refused with a 400 that says
why, instead of being loaded and silently ignored: GGUF adapters and value heads alone (vLLM reads PEFT
directories), LoRA on the routed experts (vLLM's MoE LoRA kernels are Triton-only, and KTransformers'
fused-expert file is not a format vLLM reads), and LoRA on `kv_b_proj` (vLLM folds that projection into
MLA's absorbed weights when it loads the model, where a LoRA update cannot follow it). Modules vLLM has
no LoRA layer for are refused by vLLM itself when it loads the adapter, and that message is passed on."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

from engines.base import InvalidRequestError, UnsupportedError
from engines.lora.adapter import AdapterFormatError, LoraAdapter
from engines.vllm.requests import lora_request

# Modules (our transformers names) whose LoRA vLLM would load but not apply as trained: MLA's kv_b_proj is
# folded into the absorbed attention weights when vLLM loads the model, and the router is not a LoRA layer.
UNSUPPORTED_SUFFIXES = ("kv_b_proj", "mlp.gate")


@dataclass(slots=True)
class PreparedAdapter:
    path: str
    nbytes: int
    expert_lora: str | None = None  # vLLM serves no routed-expert LoRA (refused in `prepare`)


class VLLMAdapters:
    """`llm()` is the engine's running AsyncLLM; `call(coro)` runs a coroutine on the engine loop and returns its
    result."""

    def __init__(self, llm: Callable[[], Any], call: Callable[[Any], Any], max_rank: int):
        self._llm = llm
        self._call = call
        self._max_rank = max_rank
        self._requests: dict[str, Any] = {}
        self._ids = itertools.count(1)

    def prepare(self, adapter: LoraAdapter) -> PreparedAdapter:
        if adapter.format != "peft":
            raise UnsupportedError(f"the vllm engine serves PEFT LoRA directories only; {adapter.path} is a "
                                   f"{adapter.format} adapter")
        if adapter.has_expert_lora or adapter.pending:
            raise UnsupportedError(f"{adapter.path} has LoRA on the routed experts, which the vllm engine cannot "
                                   f"apply; serve it with the ktransformers engine")
        for module in adapter.linears:
            if module.endswith(UNSUPPORTED_SUFFIXES) or ".mlp.experts." in module:
                raise UnsupportedError(f"{adapter.path} has LoRA on {module}, which the vllm engine cannot apply; "
                                       f"serve it with the huggingface or ktransformers engine")
        rank = max((w.a.shape[0] for w in adapter.linears.values()), default=0)
        if rank > self._max_rank:
            raise InvalidRequestError(f"{adapter.path} has LoRA rank {rank}, above this server's "
                                      f"vllm_max_lora_rank of {self._max_rank}", param="lora_path")
        return PreparedAdapter(adapter.path, adapter.nbytes())

    def install(self, name: str, prepared: PreparedAdapter) -> None:
        request = lora_request(name, next(self._ids), prepared.path)
        try:
            self._call(self._llm().add_lora(request))
        except Exception as exc:
            raise AdapterFormatError(f"vLLM cannot load the adapter at {prepared.path}: {exc}") from None
        self._requests[name] = request

    def remove(self, name: str) -> None:
        request = self._requests.pop(name)
        self._call(self._llm().remove_lora(request.lora_int_id))

    def request_for(self, name: str) -> Any:
        return self._requests[name]
