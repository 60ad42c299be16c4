"""The model-family interface: everything the KT engine needs to know about one DeepSeek generation.

A family is one folder under engines/kt/families/ (or one module) and one line in the registry
(`engines/kt/families/__init__.py`: model_type -> "module:Class", imported lazily). What differs between
generations lives there and nowhere else; the engine, the runtime's scheduler and sampler, the LoRA manager
and the server only ever see what this interface returns (a `ModelRunner`, a tokenizer, `details`).

What a family provides:

* **`model_types` / `architectures`**: the config.json `model_type`s it serves, and the architecture names
  it reports.
* **`read_config(model_path)`**: the transformers config of a checkpoint the registry found this family for by
  its architecture (engines/kt/families/__init__.py: ARCHITECTURES), e.g. Kimi-K2's kimi_k2 read as DeepSeek-V3's.
* **`default_rule_file(config, gpus)`**: the placement rules used when the user names none (a file name in
  kt_optimize_rules/), e.g. `DeepSeek-V4-Flash.yaml` with a GPU and `DeepSeek-V4-CPU.yaml` without.
* **`build_model(config)`**: the model on the meta device (no memory), as the placement rules expect to see it.
* **`checkpoint_name(name)`**: a *released* tensor name -> the module path it loads into, or None for
  tensors serving does not use (the MTP layer; see `draft_names`). The released layout is read as
  shipped: V4's `layers.N.attn.wq_a.weight` is the family's business, not the loader's.
* **`expert_layout`** (`ExpertLayout`): how the checkpoint stores routed experts: which tensor names, which
  projection is gate / up / down, the stored format ("bf16", "fp8_blocks", "mxfp4") and the kt-kernel
  method that reads that format in place ("" when none does and experts are quantized on load).
* **the load's hooks**: every family loads through engines/kt/build.py's one pipeline (`load_model`), which
  hands each hook the `Build` so far: `draft_layer(context)` (the MTP layer speculative decoding drafts with, or
  why there is none), `checkpoint_source(context, draft_layer)`, `converted_experts(context)` (kt-kernel's
  pre-converted experts, where the family reads them), `add_draft_layer(model, config)`, `load_weights(build)`
  (the checkpoint into the placed model; returns what `/version` says of its storage), `finish_model(build)` (what
  is fused or installed once the weights are in), `take_draft_head(build)`, `make_runner(build)` (the runner over
  the family's caches, and the context they hold) and `finish_runner(build, runner)` (CUDA graphs, the runner's
  extras). The
  runner implements `engines.runtime.model_runner.ModelRunner`: the shared scheduler hands it chunks of
  sequences and takes logits back; it keeps each sequence's cache in `seq.runner_state` and frees it in
  `release`. A hook adds what the engine details say of its part to `build.details`.
* **`chat_encoder(model_path, allow_checkpoint_code)`**: a `ChatEncoder` when the family's conversation
  format is not a jinja chat template (V3.2 and V4 ship Python, `encoding/encoding_dsv32.py`,
  `encoding_dsv4.py`; engines/kt/families/dsml_chat.py), else None (the
  tokenizer's template serves). `allow_checkpoint_code` is the user's explicit opt-in to run code from the
  model folder (as transformers' trust_remote_code).

Seams kept for later work (speculative decoding, adapters): `draft_names(name)` maps the checkpoint's MTP
tensors to the draft module's names, and a runner may expose `hidden_states` for a draft head.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch import nn


DEFAULT_KV_BUDGET_TOKENS = 65536


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """How a checkpoint stores one MoE layer's routed experts."""

    # a per-expert tensor name -> (the layer's experts prefix, expert index, projection, suffix) as groups 1-4
    pattern: re.Pattern
    projections: dict[str, str]  # the checkpoint's projection names -> "gate" / "up" / "down"
    format: str  # "bf16" | "fp8_blocks" | "mxfp4"
    native_method: str = ""  # the kt-kernel method reading `format` as stored; "": quantized on load


@dataclass(slots=True)
class LoadContext:
    """What the engine hands a family's `load`: everything is decided except what is family-specific."""

    model_path: Path
    config: Any  # the transformers config
    rule_file: Path
    rules: list  # parsed placement rules (engines/kt/placement/rules.py: load_rules)
    max_model_len: int
    max_concurrent: int
    chunk_size: int | None  # prefill tokens per step; None: the family's default (experts/notes.py: streamed_prefill)
    dtype_setting: str | None  # EngineConfig.dtype
    options: Any  # engines.kt.options.KTOptions
    fold: dict[str, str] = field(default_factory=dict)  # rule devices this machine lacks -> where they run
    speculative: Any = None  # engines.runtime.speculative.SpeculativeOptions: whether to draft, and how much
    source: Any = None  # the checkpoint (engines/checkpoints/formats.py: open_source), for families that read it so

    def kv_cache_tokens(self) -> int:
        """The positions the KV caches hold in all: kv_cache_tokens as configured, else room for a few
        full-length requests within a fixed budget (64k positions: 2 GB for V2-Lite's 27 layers x 576 bf16
        values), never less than one request."""
        if self.options.kv_cache_tokens:
            return self.options.kv_cache_tokens
        max_len = self.max_model_len
        return max(max_len, min(max_len * min(self.max_concurrent, 4), DEFAULT_KV_BUDGET_TOKENS))

    def decode_rows(self, drafting: bool) -> int:
        """The most rows a decode step feeds: one per sequence, and a drafted sequence's draft tokens."""
        rows = self.max_concurrent
        if drafting:
            spec = self.speculative
            rows = max(rows, min(rows, spec.speculative_max_batch) * (1 + spec.num_speculative_tokens))
        return rows


@dataclass(slots=True)
class LoadedModel:
    runner: Any  # engines.runtime.model_runner.ModelRunner
    details: dict[str, str] = field(default_factory=dict)  # facts for ModelInfo.details (/version)
    torch_threads: int | None = None  # torch's intra-op threads beside kt-kernel's workers; None: unchanged
    checkpoint: Any = None  # engines.base.CheckpointStorage: the format and each part's storage (/version)
    max_model_len: int | None = None  # the context served, where the family's cache holds less than asked
    chunk_size: int | None = None  # the prefill chunk it runs with, where chunk_size was left to its default


class ChatEncoder(Protocol):
    """A conversation format written in code rather than a jinja template.

    `encode(messages, tools, thinking, reasoning_effort)` -> the prompt text (generation prompt included);
    `reasoning_parser` / `tool_parser`: the names of the output parsers the server uses for this format."""

    reasoning_parser: str
    tool_parser: str

    def encode(self, messages: list[dict], tools: list[dict] | None = None, thinking: bool = False,
               reasoning_effort: str | None = None) -> str: ...


class ModelFamily(ABC):
    """One DeepSeek generation, as the KT engine serves it (module docstring: what each member means)."""

    name: str = ""
    model_types: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    expert_layout: ExpertLayout

    def read_config(self, model_path: Path) -> Any:
        import transformers  # heavy, and only a load needs it

        return transformers.AutoConfig.from_pretrained(model_path)

    @abstractmethod
    def default_rule_file(self, config: Any, gpus: int) -> str: ...

    @abstractmethod
    def build_model(self, config: Any) -> nn.Module: ...

    @abstractmethod
    def checkpoint_name(self, name: str) -> str | None: ...

    def draft_layer(self, context: LoadContext) -> tuple[int | None, str | None]:
        """The index the MTP layer loads at when speculative decoding asks for it, else None and, when it asked,
        why there is none (the runtime logs it and serves without drafting)."""
        spec = context.speculative
        if spec is None or spec.speculative != "mtp":
            return None, None
        return None, f"the {self.name} family has no multi-token-prediction draft head"

    def checkpoint_source(self, context: LoadContext, draft_layer: int | None) -> Any:
        """The checkpoint as this family reads it (the engine's `context.source` by default)."""
        return context.source

    def converted_experts(self, context: LoadContext) -> tuple[Any, str | None]:
        """kt-kernel's pre-converted experts (kt_weight_path) where the family reads them, and the experts method
        every layer must then run; by default none, and kt_method."""
        return None, context.options.kt_method

    def add_draft_layer(self, model: nn.Module, config: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} names a draft layer but cannot add it")

    @abstractmethod
    def load_weights(self, build: Any) -> Any:
        """Read the checkpoint into `build.model` as placed (`build.placement`, `build.dtype`); returns the
        engines.base.CheckpointStorage `/version` reports."""

    def finish_model(self, build: Any) -> None:
        """What the family fuses or installs once the weights are in (the model is in eval mode)."""

    def take_draft_head(self, build: Any) -> Any:
        """Take the draft layer out of `build.model` as the runner's draft head."""
        raise NotImplementedError(f"{type(self).__name__} names a draft layer but has no draft head")

    @abstractmethod
    def make_runner(self, build: Any) -> tuple[Any, int]:
        """The runner over the family's caches (sized by `build.context`: kv_cache_tokens, max_concurrent), and the
        context it serves: max_model_len, or less where the caches hold less."""

    def finish_runner(self, build: Any, runner: Any) -> None:
        """What needs the runner: CUDA graphs and the runner's extras (logged, and said in `build.details`)."""

    def chat_encoder(self, model_path: Path, allow_checkpoint_code: bool = False) -> ChatEncoder | None:
        return None

    def install_chat_encoder(self, tokenizer: Any, encoder: ChatEncoder) -> None:
        """Make `encoder` the tokenizer's chat format (`apply_chat_template`, `tool_call_format`): the server
        renders every chat through the tokenizer and never learns the family."""
        raise NotImplementedError(f"{type(self).__name__} returns a chat encoder but cannot install it")

    def draft_names(self, name: str) -> str | None:
        """A checkpoint tensor of the multi-token-prediction layer -> its name in a draft module (None: not one)."""
        return None
