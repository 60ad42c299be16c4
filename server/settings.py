"""One settings object, filled from (lowest to highest) defaults, a YAML file, environment variables and
command-line flags. LLaMA-Factory's key names and environment variables are accepted as they are, so its
users bring their configs unchanged. A bad value stops start-up with a message naming the key."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engines.base import EngineConfig
from engines.registry import available_engines
from server.reasoning import check_reasoning_parser

log = logging.getLogger("ktserve.settings")


class SettingsError(ValueError):
    """A configuration problem; the message names the key and where it came from."""


# LLaMA-Factory (and KTransformers) keys -> ours. Keys absent here and from Settings are warned about.
KEY_ALIASES: dict[str, str] = {
    "model_name_or_path": "model",
    "model_path": "model",  # KTransformers' name for the folder beside gguf_path
    "infer_backend": "engine",
    "kt_maxlen": "max_model_len",
    "cutoff_len": "max_model_len",
    "api_model_name": "served_model_name",
    "infer_dtype": "dtype",
    "vllm_maxlen": "max_model_len",
    "kt_amx_weight_path": "kt_weight_path",  # SGLang's earlier name for KTransformers' --kt-weight-path
}
# LLaMA-Factory keys that mean nothing for serving; accepted silently.
IGNORED_KEYS = frozenset({
    "finetuning_type", "stage", "do_train", "do_predict", "output_dir", "quantization_bit", "flash_attn",
    "export_dir", "dataset", "dataset_dir", "kt_mode",
})
ENV_VARS: dict[str, str] = {
    "API_HOST": "host", "API_PORT": "port", "API_KEY": "api_key", "API_MODEL_NAME": "served_model_name",
    "MAX_CONCURRENT": "max_concurrent",
}


def engine_setting(default: Any, description: str, **constraints: Any) -> Any:
    """A setting only some engine reads: the server passes it through untouched (`EngineConfig.settings`) and
    the engine reads it into its own options (engines/<name>/)."""
    return Field(default, description=description, json_schema_extra={"engine_setting": True}, **constraints)


def repeated(default_factory: Callable[[], Any], description: str, flag: str, metavar: str) -> Any:
    """A list or mapping that the command line gives one `flag` at a time."""
    return Field(default_factory=default_factory, description=description,
                 json_schema_extra={"flag": flag, "metavar": metavar})


class Settings(BaseModel):
    """Every setting, once: the command-line flags (server/cli.py), the config file's keys and the
    `KTSERVE_<NAME>` environment variables are all derived from these fields."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # model
    model: str | None = Field(None, description="model directory, or a GGUF file (the first part of a split set) or "
                                                "folder of them; default: the built-in demo model")
    served_model_name: str | None = Field(None, description="the model id clients use; default: the model "
                                                            "directory's name")
    engine: str = Field("ktransformers", description="huggingface | ktransformers | vllm")
    use_kt: bool | None = Field(None, description="LLaMA-Factory's switch between the ktransformers (true) and "
                                                  "huggingface (false) engines, when no engine is named")
    template: str | None = Field(None, description="built-in chat template: deepseek | deepseek3 | deepseekr1")
    device: str = Field("auto", description="where the huggingface engine runs: auto | cpu | cuda | cuda:N")
    dtype: str = Field("auto", description="auto | bfloat16 | float16 | float32")
    trust_remote_code: bool = Field(False, description="let transformers run Python code from the model directory")
    max_model_len: int | None = Field(None, gt=0, description="context length limit")
    gguf_path: str | None = engine_setting(None, "GGUF checkpoint (a .gguf file, the first part of a split set, or "
                                                 "a folder of them) whose config and tokenizer come from `model` "
                                                 "(KTransformers' gguf_path beside model_path; ktransformers engine)")
    # adapters
    adapter_name_or_path: str | None = Field(None, description="LLaMA-Factory's adapters: comma-separated "
                                                               "directories, each served under its directory name")
    adapters: dict[str, str] = repeated(dict, "LoRA adapter to load at start (repeatable)", "--adapter", "NAME=PATH")
    adapter_roots: list[str] = repeated(list, "directory runtime adapter loads may come from (repeatable)",
                                        "--adapter-root", "DIR")
    # KTransformers (the engine_setting ones: engines/kt/options.py)
    kt_optimize_rule: str | None = engine_setting(None, "placement rule file (ktransformers engine)")
    cpu_infer: int | None = engine_setting(None, "CPU expert threads; default: physical cores - max(2, cores / 8)",
                                           gt=0)
    chunk_size: int | None = Field(None, gt=0, description="prefill chunk size in tokens; default 2048, and 8192 "
                                                           "where prompt chunks stream the routed experts to the "
                                                           "GPU (kt_gpu_prefill_tokens)")
    kt_use_cuda_graph: bool = engine_setting(True, "run decode steps as CUDA graphs (used where the model sits on "
                                                    "one GPU without hot experts; elsewhere decode runs eager; "
                                                    "DeepSeek-V4: the row-wise parts of its steps)")
    kt_fused_hyper_connections: bool = engine_setting(True, "DeepSeek-V4: compute the hyper-connections of the "
                                                             "layers on a GPU in one Triton kernel each (where Triton "
                                                             "is installed) instead of transformers' ~300 small ops")
    kt_force_think: bool = Field(False, description="open every chat reply's thinking: prompts end with <think>")
    kt_method: str | None = engine_setting(None, "experts method for every layer: AMXINT8 | AMXINT4 | BF16 | FP8 | "
                                                 "RAWINT4 | LLAMAFILE; default: the rules' choice, or the closest "
                                                 "this CPU runs")
    kt_strict_placement: bool = engine_setting(False, "refuse rule files naming GPUs this machine lacks instead of "
                                                      "folding them")
    kt_weight_cache: str | None = engine_setting(None, "directory for pre-quantized expert weights")
    kt_weight_path: str | None = engine_setting(
        None, "folder of routed experts pre-converted by kt-kernel (`kt quant` / convert_cpu_weights.py: AMXINT8 or "
              "AMXINT4, merged safetensors or _layer_N folders, one NUMA node), read instead of converting the "
              "checkpoint's experts; the experts method is theirs")
    kt_isolate_workers: bool = engine_setting(True, "with the non-expert model on GPUs, keep the server's other "
                                                    "threads off the cores of kt-kernel's pinned workers")
    kt_gpu_prefill_tokens: int | None = engine_setting(
        None, "prompt chunks of at least this many tokens, and decode steps of at least this many sequences (run "
              "without CUDA graphs), compute part of each layer's routed experts on the GPU, streaming int8 copies "
              "(int4 for 4-bit methods, DeepSeek-V4's MXFP4 as released) of them from pinned host memory (one more "
              "byte, or half a byte, of host memory per expert weight); 0: off; default: 128 where the layers' "
              "output is on a GPU, the experts are 8- or 4-bit (AMXINT8, AMXINT4, FP8, MXFP4: copies as precise "
              "as kt-kernel's form), no experts are handed to the GPU to own (kt_gpu_read_experts=N, "
              "kt_gpu_resident_experts=N) and kt-kernel's experts and their copies take at most 0.6 of the host "
              "memory available at load; else off, and the start-up log says why", ge=0)
    kt_gpu_prefill_memory: float | None = engine_setting(
        None, "GB of host memory the streamed experts' copies may take (kt_gpu_prefill_tokens): each layer keeps "
              "copies of as many of its first experts as fit, and the GPU takes at most those; default: every expert",
        gt=0)
    kt_gpu_read_experts: int | None = engine_setting(
        None, "how many of each MoE layer's experts (the first ones) the GPU computes, reading their copies (int8, "
              "int4 for 4-bit methods, DeepSeek-V4's MXFP4 as released) straight from pinned host memory in calls "
              "of up to 128 tokens (and streaming them for longer prompt chunks), while kt-kernel computes the rest "
              "and no longer holds these: host memory stays one copy of the experts. Needs the layer's output on a "
              "GPU and Triton. Default: the balance of the two readers' measured rates for 8- and 4-bit methods "
              "(32 of V2-Lite's 64 for AMXINT8 and AMXINT4) and for MXFP4 (144 of V4-Flash's 256), none for 16-bit "
              "ones (int8 copies would lose BF16's precision; RAWINT4 and LLAMAFILE are never split); 0: off. With "
              "kt_gpu_prefill_tokens: how many of the streamed copies decode steps read that way", ge=0)
    kt_gpu_resident_experts: int = engine_setting(
        0, "how many of each MoE layer's experts (the first ones) the GPU keeps in its own memory as copies (int8, "
           "int4 for 4-bit methods, DeepSeek-V4's MXFP4 as released) and "
           "computes in every call, before the ones it reads from host memory (kt_gpu_read_experts balances the "
           "rest): GPU memory for decode speed, one expert's copy a layer each (8.7 MB in int8 for V2-Lite, 26 "
           "layers). "
           "Needs the layer's output on a GPU and Triton; kt-kernel keeps at least a token's worth of experts; "
           "0: none", ge=0)
    kt_expert_pad_from: int | None = engine_setting(
        None, "expert calls of at least this many tokens (decode steps of that many sequences) that kt-kernel would "
              "compute on its per-token vector path are padded with empty rows up to its matrix path; 0: never; "
              "default: where that was measured faster for the experts method", ge=0)
    kt_decode_kernel: Literal["auto", "on", "off"] = engine_setting(
        "auto", "expert calls of few rows (decode steps; up to 128 rows of MXFP4, AMXINT8, AMXINT4 and RAWINT4 "
                "layers, 16 of FP8 layers and of GGUF layers of Q8_0 / Q4_0 / Q4_K / Q6_K blocks whose output stays "
                "on the CPU) run on ktserve's own kernel instead of kt-kernel's (INT8 and INT4 quantized its way at "
                "load, per row and per 32); auto: where it is built and its copies of the experts take under 0.3 of "
                "the host memory available at load, and on a GPU placement for MXFP4, INT4 and INT8 layers only (the "
                "default); on: every such layer, whatever the memory; off: kt-kernel computes every call. With it "
                "V4-Flash's shape decoded 1.2-1.7x faster at 1-32 clients on the H200 machine, V2-Lite's at batch 1 "
                "1.2x at 8 bits and 1.26x at 4 bits (against kt-kernel plus the GPU's reads); its integer path rounds "
                "INT4's and the ggml formats' activations to int8 per 32, MXFP4's in two int8 passes "
                "(docs/serving.md). /version's decode_kernel says what was chosen")
    kv_cache_tokens: int | None = engine_setting(None, "KV cache capacity in tokens (ktransformers engine)", gt=0)
    batch_invariant: Literal["scores", "all", "off"] = engine_setting(
        "scores", "which requests get the same tokens and logprobs whatever else is batched with them (ktransformers "
                  "engine; docs/reliability.md): scores (requests with logprobs or prompt logprobs, every score and "
                  "embedding), all, or off (the fastest steps)")
    prefix_cache: bool = engine_setting(True, "reuse the cached KV pages of a prompt prefix seen before; off: "
                                              "compute every prompt whole")
    speculative: Literal["mtp"] | None = engine_setting(
        None, "speculative decoding: mtp drafts with the checkpoint's multi-token-prediction layer (DeepSeek-V3, R1, "
              "V3.1, V4) and verifies the draft in the next step, output unchanged (ktransformers engine); default: off")
    num_speculative_tokens: int = engine_setting(1, "draft tokens per decode step (speculative)", ge=1, le=8)
    speculative_max_batch: int = engine_setting(4, "draft while at most this many sequences decode; larger steps "
                                                   "decode without drafts (speculative)", ge=1)
    speculative_adaptive: bool = engine_setting(
        True, "time decode steps with drafts and without and pause drafting while it gives fewer tokens a second, "
              "trying again every 256 plain steps (speculative); off: always draft")
    attention_backend: Literal["auto", "flashinfer", "torch"] = engine_setting(
        "auto", "MLA attention on CUDA: flashinfer, torch, or auto, which picks flashinfer where it runs")
    # vLLM engine (LLaMA-Factory's keys; engines/vllm/settings.py)
    vllm_gpu_util: float = engine_setting(0.9, "share of GPU memory the vllm engine may take", gt=0, le=1)
    vllm_enforce_eager: bool | None = engine_setting(None, "run vLLM without CUDA graphs; default: on the CPU only")
    vllm_max_lora_rank: int = engine_setting(32, "largest LoRA rank the vllm engine serves", gt=0)
    vllm_config: dict[str, Any] = engine_setting({}, "further vLLM engine arguments, as a JSON object")
    # serving
    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port")
    api_key: str | None = Field(None, description="require this key on /v1 routes")
    max_concurrent: int = Field(16, gt=0, description="requests generating at once")
    max_queue: int = Field(256, ge=0, description="waiting requests beyond which new ones get 429")
    request_timeout: float | None = Field(None, gt=0, description="seconds before a request is ended with an error")
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0, description="largest accepted request body")
    read_timeout: float = Field(30.0, gt=0, description="seconds a client gets to send a whole request before it is "
                                                        "disconnected")  # server/http_protocol.py
    graceful_timeout: float = Field(30.0, ge=0, description="on SIGTERM, seconds in-flight requests get to finish "
                                                            "before they are ended")
    reasoning_parser: str | None = Field(None, description="deepseek_r1: split <think> text into reasoning_content")
    metrics_public: bool = Field(False, description="serve /metrics without the API key")
    cors_origins: list[str] = repeated(list, "allowed CORS origin (repeatable)", "--cors-origin", "ORIGIN")
    # the Batch API (server/batches/, docs/batch-api.md)
    data_dir: str = Field("./ktserve-data", description="where the Batch API keeps its files and its SQLite "
                                                        "database of batches (created at the first upload)")
    batch_max_file_bytes: int = Field(200 * 1024 * 1024, gt=0, description="largest file /v1/files accepts")
    batch_max_lines: int = Field(50_000, gt=0, description="most requests (lines) in one batch")
    batch_max_open: int = Field(100, gt=0, description="most batches not yet finished at once")
    batch_max_storage_bytes: int = Field(10 * 1024 ** 3, gt=0, description="bytes all stored files may take; "
                                                                           "uploads beyond are refused")
    batch_max_in_flight: int | None = Field(None, gt=0, description="batch lines generating at once; default: "
                                                                    "half of max_concurrent, the rest kept for "
                                                                    "interactive requests")
    log_format: Literal["text", "json"] = Field("text", description="log line format")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="least severe level logged")

    @field_validator("api_key")
    @classmethod
    def _empty_key_is_none(cls, v: str | None) -> str | None:
        return v or None

    @field_validator("vllm_config", mode="before")
    @classmethod
    def _vllm_config_json(cls, v: Any) -> Any:
        """LLaMA-Factory also takes vllm_config as a JSON string (from the command line or the environment)."""
        if isinstance(v, str):
            try:
                return json.loads(v)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON object: {exc}") from None
        return v

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, v: str | None) -> str | None:
        check_reasoning_parser(v)
        return v

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        if v not in available_engines():
            raise ValueError(f"unknown engine {v!r}; known engines: {', '.join(sorted(available_engines()))}")
        return v

    @model_validator(mode="after")
    def _use_kt_selects_engine(self) -> "Settings":
        """LLaMA-Factory's `use_kt` picks the engine unless one is named explicitly."""
        if self.use_kt is not None and "engine" not in self.model_fields_set:
            object.__setattr__(self, "engine", "ktransformers" if self.use_kt else "huggingface")
        return self

    @model_validator(mode="after")
    def _gguf_path_alone_is_the_model(self) -> "Settings":
        """gguf_path without a model folder beside it: the GGUF is the model (config, tokenizer from its metadata)."""
        if self.gguf_path and not self.model:
            object.__setattr__(self, "model", self.gguf_path)
            object.__setattr__(self, "gguf_path", None)
        return self

    def all_adapters(self) -> dict[str, str]:
        """--adapter NAME=PATH entries plus LLaMA-Factory's adapter_name_or_path (name = directory name)."""
        found = dict(self.adapters)
        for path in (self.adapter_name_or_path or "").split(","):
            if path.strip():
                found.setdefault(Path(path.strip().rstrip("/")).name, path.strip())
        return found

    def engine_config(self, model_path: str) -> EngineConfig:
        """The settings every engine understands by their EngineConfig names, and the engine-specific ones
        passed through whole."""
        common = {f.name for f in fields(EngineConfig)} & Settings.model_fields.keys() - {"adapters"}
        return EngineConfig(model_path=model_path, model_name=self.served_model_name, adapters=self.all_adapters(),
                            settings={k: getattr(self, k) for k in ENGINE_SETTINGS},
                            **{k: getattr(self, k) for k in common})


# The settings only some engine reads (`engine_setting`): EngineConfig.settings carries them to the engine.
ENGINE_SETTINGS = tuple(name for name, f in Settings.model_fields.items()
                        if (f.json_schema_extra or {}).get("engine_setting"))


def _canonical(raw: dict[str, Any], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        key = KEY_ALIASES.get(key, key)
        if key in IGNORED_KEYS:
            continue
        if key not in Settings.model_fields:
            log.warning("%s: ignoring unknown key %r", source, key)
            continue
        out[key] = value
    return out


def _from_yaml(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise SettingsError(f"config file {path}: cannot be read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise SettingsError(f"config file {path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path}: expected a mapping of keys to values at the top level")
    return _canonical(data, f"config file {path}")


def _from_env(env: dict[str, str]) -> dict[str, Any]:
    out = {field: env[var] for var, field in ENV_VARS.items() if env.get(var) not in (None, "")}
    prefix = "KTSERVE_"
    for var, value in env.items():
        if var.startswith(prefix) and var != "KTSERVE_CACHE_DIR" and var[len(prefix):].lower() in Settings.model_fields:
            out.setdefault(var[len(prefix):].lower(), value)
    return out


def load_settings(config_path: str | None = None, cli: dict[str, Any] | None = None,
                  env: dict[str, str] | None = None) -> Settings:
    """Merge the four sources and validate once, naming the offending key (and its source) on error."""
    layers = [("config file " + config_path if config_path else "config", _from_yaml(config_path)),
              ("environment", _from_env(dict(os.environ) if env is None else env)),
              ("command line", {k: v for k, v in (cli or {}).items() if v is not None})]
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for source, values in layers:
        for key, value in values.items():
            if key in ("adapters",) and isinstance(value, dict):
                value = {**merged.get(key, {}), **value}
            merged[key] = value
            origin[key] = source
    try:
        return Settings.model_validate(merged)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"]) or "config"
            where = origin.get(str(err["loc"][0]) if err["loc"] else "", "defaults")
            problems.append(f"{key} (from {where}): {err['msg']}")
        raise SettingsError("invalid configuration: " + "; ".join(problems)) from None
