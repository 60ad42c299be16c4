"""What every engine reads from a model directory the same way: tokenizer, ids, devices, limits."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engines.base import EngineConfig
from engines.templates import builtin_template


def resolve_device(name: str) -> torch.device:
    """"auto" picks CUDA when there is a GPU; an explicit CUDA device on a machine without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} asked for, but this machine has no CUDA GPU")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on a GPU; float32 on the CPU, where bf16 matmuls are slow and lose precision."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
              "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
    if name not in dtypes:
        raise ValueError(f"dtype: {name!r} is not one of auto, {', '.join(dtypes)}")
    return dtypes[name]


def model_id(config: EngineConfig) -> str:
    return config.model_name or Path(config.model_path.rstrip("/")).name


def load_tokenizer(model_path: str, template: str | None = None, trust_remote_code: bool = False,
                   config: Any = None) -> Any:
    """The model directory's tokenizer; `template` (a built-in name) replaces its chat template. Tokenizers shipped
    as code (Kimi-K2's tiktoken one) need `trust_remote_code`; `config`, the model's config when the caller has read
    it (transformers would otherwise read config.json again, by its model_type)."""
    from transformers import AutoTokenizer

    extra = {} if config is None else {"config": config}
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code, **extra)
    if template:
        tokenizer.chat_template = builtin_template(template)
    return tokenizer


def ships_chat_template(model_dir: Path) -> bool:
    """Whether a model folder carries a jinja chat template (chat_template.jinja, or tokenizer_config.json's)."""
    config = model_dir / "tokenizer_config.json"
    return (model_dir / "chat_template.jinja").is_file() or (
        config.is_file() and bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template")))


def eos_token_ids(model_config: Any, tokenizer: Any, model_dir: Path) -> tuple[int, ...]:
    """Every id that ends generation: the tokenizer's EOS plus generation_config.json's eos_token_id(s)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    sources = [getattr(model_config, "eos_token_id", None)]
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def context_length(model_config: Any, tokenizer: Any, override: int | None) -> int:
    native = int(getattr(model_config, "max_position_embeddings", 0) or 0) or int(tokenizer.model_max_length)
    if override is not None:
        if override > native:
            raise ValueError(f"max_model_len: {override} is larger than the model's {native} positions")
        return override
    return native


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")


def weights_size(model_path: str | Path) -> int:
    """Bytes of the weight files in a model directory (what Ollama reports as a model's size)."""
    path = Path(model_path)
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file())


def parameter_count(model_path: str | Path) -> int:
    """Elements of every tensor in a model directory's safetensors shards, read from their headers alone
    (Ollama's `parameter_size`); 0 when the weights are in another format."""
    import json
    import math
    import struct

    path = Path(model_path)
    if not path.is_dir():
        return 0
    total = 0
    for shard in sorted(path.glob("*.safetensors")):
        if not shard.is_file():
            continue
        with open(shard, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total
