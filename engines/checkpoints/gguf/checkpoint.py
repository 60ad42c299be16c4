"""A GGUF checkpoint as the engines read it: its config and tokenizer, and its tensors under Hugging Face names
as a checkpoint source (engines/checkpoints/source.py: `items`), which the loaders take as they take any other.

With `hf_dir` (KTransformers' `model_path` beside `gguf_path`), the config, tokenizer and generation config
come from that folder; without it, from the GGUF metadata. Non-expert tensors are dequantized to float32 one
at a time; each layer's routed experts come as one `GGUFExperts`, whose blocks a kernel may read in place
(views of the memory-mapped file) or which dequantizes them for a conversion."""
from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from engines.checkpoints.gguf import deepseek2, routing
from engines.checkpoints.source import StoredTensor
from engines.checkpoints.gguf.files import SPLIT_NAME, GGUFFiles
from engines.checkpoints.gguf.tokenizer import build_tokenizer
from engines.model_files import load_tokenizer
from engines.templates import builtin_template

log = logging.getLogger("ktserve.checkpoints.gguf")
DEQUANTIZE_THREADS = max(1, min(8, (os.cpu_count() or 1) - 1))  # experts dequantized at once while converting


@dataclass
class GGUFExperts:
    """One layer's routed experts as the file stores them: gate/up [E, I, H], down [E, H, I] in ggml blocks."""

    prefix: str  # the experts module, e.g. "model.layers.3.mlp.experts"
    files: GGUFFiles
    names: dict[str, str]  # "gate" | "up" | "down" -> GGUF tensor name
    count: int | None = None  # experts [0, count) only (`dequantized`); None: all of them
    form = "ggml"  # the weights kt-kernel's LLAMAFILE method reads (expert_methods.ExpertMethod.weights)

    @property
    def stored_as(self) -> str:
        return "/".join(dict.fromkeys(stored_name(t) for t in self.types().values()))

    def num_experts(self) -> int:
        return self.count or self.files.tensors[self.names["gate"]].data.shape[0]

    def types(self) -> dict[str, str]:
        return {proj: self.files.type_name(name) for proj, name in self.names.items()}

    def blocks(self) -> dict[str, tuple[torch.Tensor, str]]:
        """{"gate" | "up" | "down": (uint8 [E, rows, row bytes] sharing the file's memory, ggml type name)}."""
        return {proj: (self.files.tensor_bytes(name), self.files.type_name(name)) for proj, name in self.names.items()}

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate, up, down in `dtype`, dequantized one expert at a time on DEQUANTIZE_THREADS threads (one expert's
        float32 temporaries each): the gguf package's numpy dequantizes ~100M values a second on one core and
        releases the GIL, and a V2-Lite GGUF's experts are 14.4G values."""
        from concurrent.futures import ThreadPoolExecutor

        def one(name: str, e: int) -> torch.Tensor:
            return torch.from_numpy(self.files.dequantized(name, e)).to(dtype)

        out = []
        with ThreadPoolExecutor(DEQUANTIZE_THREADS, thread_name_prefix="gguf-dequantize") as pool:
            for proj in ("gate", "up", "down"):
                name = self.names[proj]
                out.append(torch.stack(list(pool.map(lambda e, name=name: one(name, e), range(self.num_experts())))))
        return out[0], out[1], out[2]


class GGUFCheckpoint:
    """A GGUF checkpoint: a CheckpointSource (engines/checkpoints/source.py) with the config and tokenizer."""

    experts_form = "ggml"  # the form its routed experts come in (GGUFExperts.form)

    def __init__(self, path: str | Path, hf_dir: str | Path | None = None):
        self.files = GGUFFiles.open(path)
        self.path = self.files.first
        self.hf_dir = Path(hf_dir) if hf_dir else None
        # what the metadata lacked of the routing and where it came from (routing.Routing.note), once `config()`
        # has read it: for the start-up log and /version
        self.routing_note: str | None = None
        parts = len(self.files.parts)
        # what the checkpoint is, for the start-up log and /version (CheckpointSource.format)
        self.format = (f"GGUF {deepseek2.ARCHITECTURE} ({parts} file{'s' if parts > 1 else ''}"
                       f"{', config and tokenizer from ' + str(self.hf_dir) if self.hf_dir else ''})")
        arch = self.files.value("general.architecture")
        if arch != deepseek2.ARCHITECTURE:
            raise ValueError(f"model: {self.files.first} is a GGUF of architecture {arch!r}; ktserve serves "
                             f"{deepseek2.ARCHITECTURE!r} GGUFs (DeepSeek V2, V2-Lite, V3, R1, V3.1)")
        if self.hf_dir is not None and not (self.hf_dir / "config.json").is_file():
            raise ValueError(f"model_path: {self.hf_dir} has no config.json (it should hold the original model's "
                             "config and tokenizer files)")

    @property
    def name(self) -> str:
        """The model's name: the first file's without the split suffix and extension."""
        split = SPLIT_NAME.match(self.files.first.name)
        return split["stem"] if split else self.files.first.stem

    def _meta(self, key: str, default: Any = None) -> Any:
        return self.files.value(f"{deepseek2.ARCHITECTURE}.{key}", default)

    def config(self) -> Any:
        from transformers import AutoConfig

        if self.hf_dir is not None:
            config = AutoConfig.from_pretrained(self.hf_dir)
            if hasattr(config, "quantization_config"):  # an FP8 release's folder: the GGUF's weights are its own
                del config.quantization_config
            return config
        has_bias = any(n.endswith(".exp_probs_b.bias") for n in self.files.tensors)
        found = routing.resolve(self._meta, has_bias, self.files.first.name)
        self.routing_note = found.note(self.files.first.name)
        if self.routing_note:
            (log.warning if found.doubtful else log.info)("routing: %s", self.routing_note)
        fields = deepseek2.config_dict(self._meta, found.fields, len(self.files.value("tokenizer.ggml.tokens", [])),
                                       self.files.first.name)
        fields["bos_token_id"] = self.files.value("tokenizer.ggml.bos_token_id")
        fields["eos_token_id"] = self.files.value("tokenizer.ggml.eos_token_id")
        return AutoConfig.for_model(fields.pop("model_type"), **fields)

    def tokenizer(self, template: str | None = None) -> Any:
        if self.hf_dir is not None:
            return load_tokenizer(str(self.hf_dir), template)

        tokenizer = build_tokenizer(self.files.value, str(self.files.first))
        if template:
            tokenizer.chat_template = builtin_template(template)
        return tokenizer

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | GGUFExperts]]:
        """(checkpoint name, float32 tensor) for every non-expert tensor, ("model.layers.N.mlp.experts",
        GGUFExperts) for each layer's routed experts: a whole state dict's worth (the reference model in tests)."""
        for name, value, _ in self._read():
            yield name, value

    def items(self, num_experts: int, progress: Any = None, skip: frozenset[str] = frozenset()
              ) -> Iterator[StoredTensor | GGUFExperts]:
        """The loader's view (engines/checkpoints/source.py: CheckpointSource): every non-expert tensor as a
        StoredTensor, dequantized as it is read and naming its ggml type, and each layer's routed experts as their
        blocks (GGUFExperts, form "ggml"), except the experts modules in `skip`."""
        for name, value, stored in self._read(skip):
            if isinstance(value, GGUFExperts):
                if value.num_experts() != num_experts:
                    raise ValueError(f"model: {value.prefix} has {value.num_experts()} experts in "
                                     f"{self.files.first.name}, the config says {num_experts}")
                yield value
            else:
                yield StoredTensor(name, value, stored=stored)
        if progress is not None:
            progress.update(len(self.files.parts))

    def layer_experts(self, prefix: str, num_experts: int, first: int | None = None) -> GGUFExperts:
        """One layer's routed experts (with `first`, experts [0, first)), read again (expert LoRA, copies)."""
        layer = int(prefix.split(".")[2])
        names = {deepseek2.EXPERT_TENSORS[p[1]]: n for n in self.files.tensors
                 if (p := deepseek2.layer_part(n)) and p[0] == layer and p[1] in deepseek2.EXPERT_TENSORS}
        if len(names) != 3:
            raise ValueError(f"model: layer {layer}'s routed experts are incomplete in {self.files.first.name}")
        return GGUFExperts(prefix, self.files, names, min(first or num_experts, num_experts))

    def for_layers(self, num_layers: int, skip: Any = None) -> "GGUFCheckpoint":
        """Itself: llama.cpp's converter writes the decoder layers only (no multi-token-prediction layer)."""
        return self

    def _read(self, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor | GGUFExperts, str]]:
        """(checkpoint name, tensor or GGUFExperts, stored type) in file order; a tensor this architecture does
        not name comes under its GGUF name (the loader reports it)."""
        split_kv: dict[int, dict[str, str]] = {}
        experts: dict[int, dict[str, str]] = {}
        has_kv_b = {p[0] for n in self.files.tensors if (p := deepseek2.layer_part(n)) and p[1] == "attn_kv_b"}
        for name in self.files.tensors:
            part = deepseek2.layer_part(name)
            if part and part[1] in deepseek2.EXPERT_TENSORS:
                experts.setdefault(part[0], {})[deepseek2.EXPERT_TENSORS[part[1]]] = name
                if len(experts[part[0]]) == 3:
                    prefix = f"model.layers.{part[0]}.mlp.experts"
                    layer = GGUFExperts(prefix, self.files, experts.pop(part[0]))
                    if prefix not in skip:
                        yield prefix, layer, layer.stored_as
                continue
            if part and part[1] in deepseek2.SPLIT_KV_B:
                if part[0] in has_kv_b:
                    continue  # the whole kv_b is there too
                pair = split_kv.setdefault(part[0], {})
                pair[part[1]] = name
                if len(pair) == 2:
                    kv_b = deepseek2.kv_b_from_split(self.files.dequantized(pair["attn_k_b"]),
                                                     self.files.dequantized(pair["attn_v_b"]),
                                                     int(self._meta("attention.head_count")))
                    yield (f"model.layers.{part[0]}.self_attn.kv_b_proj.weight", torch.from_numpy(kv_b),
                           stored_name(self.files.type_name(pair["attn_k_b"])))
                continue
            yield (deepseek2.hf_name(name) or name, torch.from_numpy(self.files.dequantized(name)),
                   stored_name(self.files.type_name(name)))
        for layer in experts:
            raise ValueError(f"model: layer {layer}'s routed experts are incomplete in {self.files.first.name} "
                             f"(only {', '.join(experts[layer].values())})")

    def expert_types(self) -> Counter:
        """How many expert tensors are stored in each type."""
        return Counter(self.files.type_name(n) for n in self.files.tensors
                       if (p := deepseek2.layer_part(n)) and p[1] in deepseek2.EXPERT_TENSORS)


def stored_name(ggml_type: str) -> str:
    """A ggml type as the storage report names it: the float types as torch's are named (bf16, fp16, float32),
    the block types as llama.cpp names them (Q8_0, Q4_K)."""
    return {"F32": "float32", "F16": "fp16", "BF16": "bf16"}.get(ggml_type, ggml_type)
