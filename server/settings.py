"""One settings object, filled from (lowest to highest) defaults, a YAML file, environment variables and
command-line flags. LLaMA-Factory's key names and environment variables are accepted as they are, so its
users bring their configs unchanged. A bad value stops start-up with a message naming the key."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engines.base import EngineConfig

log = logging.getLogger("ktserve.settings")


class SettingsError(ValueError):
    """A configuration problem; the message names the key and where it came from."""


# LLaMA-Factory (and KTransformers) keys -> ours. Keys absent here and from Settings are warned about.
KEY_ALIASES: dict[str, str] = {
    "model_name_or_path": "model",
    "infer_backend": "engine",
    "kt_maxlen": "max_model_len",
    "cutoff_len": "max_model_len",
    "api_model_name": "served_model_name",
    "infer_dtype": "dtype",
    "vllm_maxlen": "max_model_len",
}
# LLaMA-Factory keys that mean nothing for serving; accepted silently.
IGNORED_KEYS = frozenset({
    "finetuning_type", "stage", "do_train", "do_predict", "output_dir", "quantization_bit", "flash_attn",
    "export_dir", "dataset", "dataset_dir", "kt_mode",
})
VLLM_KEYS = ("vllm_gpu_util", "vllm_enforce_eager", "vllm_max_lora_rank", "vllm_config")
ENV_VARS: dict[str, str] = {
    "API_HOST": "host", "API_PORT": "port", "API_KEY": "api_key", "API_MODEL_NAME": "served_model_name",
    "MAX_CONCURRENT": "max_concurrent",
}


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # model
    model: str | None = Field(None, description="model directory; default: the built-in demo model")
    served_model_name: str | None = None
    engine: str = "ktransformers"
    use_kt: bool | None = None
    template: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False
    max_model_len: int | None = Field(None, gt=0)
    # adapters
    adapter_name_or_path: str | None = None  # LLaMA-Factory: comma-separated directories
    adapters: dict[str, str] = Field(default_factory=dict)
    adapter_roots: list[str] = Field(default_factory=list)
    # KTransformers engine
    kt_optimize_rule: str | None = None
    cpu_infer: int | None = Field(None, gt=0)
    chunk_size: int = Field(2048, gt=0)
    kt_use_cuda_graph: bool = False
    kt_force_think: bool = False
    kt_method: str | None = None
    kt_strict_placement: bool = False
    kt_weight_cache: str | None = None
    kv_cache_tokens: int | None = Field(None, gt=0)
    prefix_cache: bool = True
    attention_backend: Literal["auto", "flashinfer", "torch"] = "auto"
    # vLLM engine (LLaMA-Factory's keys; engines/vllm/settings.py)
    vllm_gpu_util: float = Field(0.9, gt=0, le=1)
    vllm_enforce_eager: bool | None = None
    vllm_max_lora_rank: int = Field(32, gt=0)
    vllm_config: dict[str, Any] = Field(default_factory=dict)
    # serving
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None
    max_concurrent: int = Field(16, gt=0)
    max_queue: int = Field(256, ge=0)
    request_timeout: float | None = Field(None, gt=0)
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0)
    read_timeout: float = Field(30.0, gt=0)  # seconds a client gets to send a whole request (server/http_protocol.py)
    graceful_timeout: float = Field(30.0, ge=0)
    reasoning_parser: str | None = None
    metrics_public: bool = False
    cors_origins: list[str] = Field(default_factory=list)
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["debug", "info", "warning", "error"] = "info"

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
        from server.reasoning import check_reasoning_parser
        check_reasoning_parser(v)
        return v

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        from engines.registry import available_engines
        if v not in available_engines():
            raise ValueError(f"unknown engine {v!r}; known engines: {', '.join(sorted(available_engines()))}")
        return v

    @model_validator(mode="after")
    def _use_kt_selects_engine(self) -> "Settings":
        """LLaMA-Factory's `use_kt` picks the engine unless one is named explicitly."""
        if self.use_kt is not None and "engine" not in self.model_fields_set:
            object.__setattr__(self, "engine", "ktransformers" if self.use_kt else "huggingface")
        return self

    def all_adapters(self) -> dict[str, str]:
        """--adapter NAME=PATH entries plus LLaMA-Factory's adapter_name_or_path (name = directory name)."""
        found = dict(self.adapters)
        for path in (self.adapter_name_or_path or "").split(","):
            if path.strip():
                found.setdefault(Path(path.strip().rstrip("/")).name, path.strip())
        return found

    def engine_config(self, model_path: str) -> EngineConfig:
        return EngineConfig(
            model_path=model_path, model_name=self.served_model_name, device=self.device, dtype=self.dtype,
            max_concurrent=self.max_concurrent, max_queue=self.max_queue, max_model_len=self.max_model_len,
            chunk_size=self.chunk_size, trust_remote_code=self.trust_remote_code, template=self.template,
            adapters=self.all_adapters(), kt_optimize_rule=self.kt_optimize_rule, cpu_infer=self.cpu_infer,
            kt_method=self.kt_method, kt_strict_placement=self.kt_strict_placement,
            kt_weight_cache=self.kt_weight_cache, kv_cache_tokens=self.kv_cache_tokens,
            kt_use_cuda_graph=self.kt_use_cuda_graph, kt_force_think=self.kt_force_think,
            prefix_cache=self.prefix_cache, attention_backend=self.attention_backend,
            extra={k: getattr(self, k) for k in VLLM_KEYS if getattr(self, k) is not None})


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
