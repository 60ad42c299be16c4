"""A checkpoint as a source of tensors in their stored form: the seam between checkpoint formats and loaders.

A loader asks a `CheckpointSource` for its items one at a time and places each: a `StoredTensor` (one weight
of the model, under the model's parameter name, as stored: plain, or FP8 blocks with their multipliers)
becomes a parameter through `load(device, dtype)`, which moves the stored bytes first and converts on the
final device; a `StoredExperts` (one MoE layer's routed experts, stacked, in the form stored) goes to the
experts operator, which takes that form as it is where its kernel reads it (FP8 blocks) or converts it.
`SafetensorsSource` reads Hugging Face safetensors directories, BF16 or block-scaled FP8 as DeepSeek ships
them (config.json's `quantization_config`); `engines.checkpoints.gguf.GGUFCheckpoint` reads llama.cpp's GGUF
files, whose tensors come dequantized (`StoredTensor.stored` names their ggml type) and whose experts come as
ggml blocks (`ExpertsLayer.form` "ggml") that kt-kernel's llamafile kernel reads in place. Peak host
memory while reading is one layer's experts in their stored form plus the tensors in flight."""
from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol

import torch

from engines.base import CheckpointStorage
from engines.checkpoints.fp8 import DEFAULT_BLOCK, dequantize_blocks

log = logging.getLogger("ktserve.checkpoints")

PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
MATRICES = ("gate_proj", "up_proj", "down_proj")
SCALE_SUFFIX = "_scale_inv"  # FP8 multipliers: "<name>.weight" -> "<name>.weight_scale_inv"
QUANT_METHODS_READ = ("fp8",)


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "float32",
            torch.float8_e4m3fn: "FP8"}.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(slots=True)
class StoredTensor:
    """One weight of the model as the checkpoint stores it; `scale` holds FP8 blocks' multipliers."""

    name: str
    data: torch.Tensor
    scale: torch.Tensor | None = None
    block: tuple[int, int] = DEFAULT_BLOCK
    stored: str = ""  # the checkpoint's own type where `data` was converted from it on reading (a GGUF's Q8_0)

    @property
    def stored_as(self) -> str:
        return self.stored or ("FP8" if self.scale is not None else dtype_name(self.data.dtype))

    def load(self, device: str | torch.device, dtype: torch.dtype | None) -> torch.Tensor:
        """The weight in `dtype` on `device`: FP8 bytes travel as they are and are dequantized there."""
        if self.scale is not None:
            data = self.data.to(device)
            try:
                return dequantize_blocks(data, self.scale.to(device), dtype or torch.bfloat16, self.block)
            except ValueError as exc:  # a scale of the wrong shape: say which tensor
                raise ValueError(f"model: {self.name}: {exc}") from None
        tensor = self.data
        if tensor.is_floating_point() and dtype is not None:
            tensor = tensor.to(dtype)
        return tensor.to(device)


@dataclass(slots=True)
class StoredExperts:
    """One MoE layer's routed experts as stored, stacked: gate/up [E, I, H], down [E, H, I]; with `scales`
    (one [E, rows / 128, cols / 128] float32 tensor each) they are FP8 blocks, else plain floats."""

    prefix: str  # the experts module, e.g. "model.layers.3.mlp.experts"
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    block: tuple[int, int] = DEFAULT_BLOCK

    @property
    def form(self) -> str:
        """The weights kt-kernel methods read (expert_methods.ExpertMethod.weights): fp8_blocks or bf16."""
        return "fp8_blocks" if self.scales is not None else "bf16"

    @property
    def stored_as(self) -> str:
        return "FP8" if self.scales is not None else dtype_name(self.gate.dtype)

    def num_experts(self) -> int:
        return self.gate.shape[0]

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate, up, down in `dtype` (one expert at a time, so the float32 temporaries stay one matrix)."""
        if self.scales is None:
            return self.gate, self.up, self.down
        out = []
        for weights, scales in zip((self.gate, self.up, self.down), self.scales):
            full = torch.empty(weights.shape, dtype=dtype, device=weights.device)
            for e in range(weights.shape[0]):
                full[e] = dequantize_blocks(weights[e], scales[e], dtype, self.block)
            out.append(full)
        return out[0], out[1], out[2]

    def blocks(self, skip: int = 0) -> dict[str, torch.Tensor]:
        """FP8 experts [skip, E) as kt-kernel's FP8 kernels read them: e4m3 bytes and float32 multipliers."""
        if self.scales is None:
            raise ValueError(f"{self.prefix}: the experts are not stored as FP8 blocks")
        out: dict[str, torch.Tensor] = {}
        for m, weights, scales in zip(("gate", "up", "down"), (self.gate, self.up, self.down), self.scales):
            out[m] = weights[skip:].view(torch.uint8).contiguous()
            out[f"{m}_scale"] = scales[skip:].to(torch.float32).contiguous()
        return out

    def first(self, count: int) -> "StoredExperts":
        scales = None if self.scales is None else tuple(s[:count] for s in self.scales)
        return StoredExperts(self.prefix, self.gate[:count], self.up[:count], self.down[:count], scales, self.block)


class ExpertsLayer(Protocol):
    """One MoE layer's routed experts in a checkpoint's stored form: `StoredExperts`, or a GGUF's blocks
    (engines/checkpoints/gguf: `GGUFExperts`, form "ggml", whose `blocks()` the llamafile kernel reads)."""

    prefix: str

    @property
    def form(self) -> str: ...

    @property
    def stored_as(self) -> str: ...

    def num_experts(self) -> int: ...

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """gate/up [E, I, H], down [E, H, I] as floats."""


class CheckpointSource(Protocol):
    """What a loader needs of a checkpoint format."""

    path: Path
    format: str  # what the checkpoint is, for the start-up log and /version ("safetensors, FP8 e4m3 ...")
    experts_form: str  # the form its routed experts come in (ExpertsLayer.form): bf16 | fp8_blocks | ggml

    def items(self, num_experts: int, progress: Any = None, skip: frozenset[str] = frozenset()
              ) -> Iterator[StoredTensor | ExpertsLayer]:
        """Every weight the model uses: per-expert weights come as one ExpertsLayer per complete layer, except
        the layers in `skip` (experts modules already loaded from elsewhere), whose experts are not even read."""

    def layer_experts(self, prefix: str, num_experts: int, first: int | None = None) -> ExpertsLayer:
        """One layer's routed experts (with `first`, experts [0, first)), read again (expert LoRA, copies)."""

    def for_layers(self, num_layers: int, skip: re.Pattern | None = None) -> "CheckpointSource":
        """The source that reads the decoder layers [0, num_layers) only (past them: DeepSeek's MTP layer) and no
        tensor whose name `skip` matches."""


def quantization_block(config: dict, where: Path) -> tuple[int, int] | None:
    """The FP8 block of a checkpoint's config.json (None: not quantized); a method we do not read is an error."""
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method not in QUANT_METHODS_READ:
        raise ValueError(f"model: {where} declares quantization_config.quant_method {method!r}, which ktserve does "
                         f"not read; it reads block-scaled FP8 ('fp8', as DeepSeek releases ship) and unquantized "
                         f"BF16/FP16/FP32 checkpoints (convert this one to BF16, or use a release in one of those)")
    fmt = quant.get("fmt", "e4m3")
    block = quant.get("weight_block_size")
    if fmt != "e4m3" or not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) for b in block)):
        raise ValueError(f"model: {where} declares fp8 with fmt={fmt!r}, weight_block_size={block!r}; ktserve reads "
                         "e4m3 weights scaled per 2-D block (weight_block_size: [128, 128] in DeepSeek's releases)")
    return block[0], block[1]


def checkpoint_files(model_path: Path) -> list[Path]:
    """The safetensors files of a model directory; a shard its index names but the folder lacks is an error."""
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_path / n).is_file()]
        if missing:
            raise ValueError(f"model: {index.name} names {len(missing)} shard(s) that {model_path} lacks, e.g. "
                             f"{missing[0]}: the download is incomplete; fetch the missing files again (e.g. "
                             f"`huggingface-cli download <repo> {missing[0]} --local-dir {model_path}`)")
        return [model_path / n for n in names]
    single = model_path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_path.glob("*.safetensors"))
    if not found:
        raise ValueError(f"model: no safetensors weights in {model_path}")
    return found


def iter_tensors(files: list[Path], progress: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in `files`, shard by shard, as stored: for a family reading a layout of its
    own (V4's released names and `.scale` blocks), which SafetensorsSource does not pair."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
        if progress is not None:
            progress.update(1)


def tensor_names(model_path: Path) -> set[str]:
    """Every tensor name of the checkpoint, from its index or its shards' headers (no tensor is read)."""
    from safetensors import safe_open

    index = Path(model_path) / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for path in checkpoint_files(Path(model_path)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


class SafetensorsSource:
    """A Hugging Face safetensors directory, BF16 or DeepSeek's block-scaled FP8 (`weight_scale_inv`).

    Layers from `num_layers` on (DeepSeek-V3's multi-token-prediction layer `model.layers.<num_hidden_layers>`)
    are skipped, said in one log line, and so are the tensors whose names `skip` matches (the MTP layer's copies
    of the embedding and LM head, when it is loaded to draft with)."""

    def __init__(self, model_path: str | Path, num_layers: int | None = None, skip: re.Pattern | None = None):
        self.path = Path(model_path)
        self.skip = skip
        config_path = self.path / "config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.block = quantization_block(config, config_path)
        self.files = checkpoint_files(self.path)
        self.num_layers = num_layers
        self.experts_form = "fp8_blocks" if self.block else "bf16"
        self.format, self.stored_as = describe(config, self.block)

    def for_layers(self, num_layers: int, skip: re.Pattern | None = None) -> "SafetensorsSource":
        """This checkpoint read up to layer `num_layers` (excluded), without the tensors `skip` matches."""
        return SafetensorsSource(self.path, num_layers, skip)

    def _tensors(self, progress: Any = None, prefix: str = "", skip: frozenset[str] = frozenset()
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        skipped: set[int] = set()
        for path in self.files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if not name.startswith(prefix):
                        continue
                    layer = LAYER_KEY.match(name)
                    if layer and self.num_layers is not None and int(layer.group(1)) >= self.num_layers:
                        skipped.add(int(layer.group(1)))
                        continue
                    if skip and name.partition(".mlp.experts.")[0] + ".mlp.experts" in skip:
                        continue
                    if self.skip is not None and self.skip.match(name):
                        continue
                    yield name, f.get_tensor(name)
            if progress is not None:
                progress.update(1)
        if skipped:
            log.info("checkpoint: layer(s) %s skipped (past num_hidden_layers=%d: DeepSeek's multi-token-prediction "
                     "layer, which serving does not use)", ", ".join(map(str, sorted(skipped))), self.num_layers)

    def _paired(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor,
                                                                                     torch.Tensor | None]]:
        """(name, weight, FP8 multipliers or None): an FP8 weight waits for its `weight_scale_inv`, which may come
        before or after it (another shard)."""
        waiting: dict[str, torch.Tensor] = {}
        scales: dict[str, torch.Tensor] = {}
        for name, tensor in tensors:
            if name.endswith(SCALE_SUFFIX):
                weight = name.removesuffix(SCALE_SUFFIX)
                if weight in waiting:
                    yield weight, waiting.pop(weight), tensor
                else:
                    scales[weight] = tensor
            elif tensor.dtype == torch.float8_e4m3fn:
                if name in scales:
                    yield name, tensor, scales.pop(name)
                else:
                    waiting[name] = tensor
            else:
                yield name, tensor, None
        if waiting or scales:
            lone = sorted(waiting)[:1] or [s + SCALE_SUFFIX for s in sorted(scales)][:1]
            raise ValueError(f"model: {len(waiting) + len(scales)} FP8 weights or block scales of {self.path} lack "
                             f"their pair, e.g. {lone[0]} (every FP8 '<name>.weight' needs '<name>.weight_scale_inv')")

    def state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every tensor under its checkpoint name, FP8 weights dequantized to `dtype`: for loaders that take a whole
        state dict (the huggingface engine); the whole model in memory at once."""
        return {name: tensor if scale is None else StoredTensor(name, tensor, scale, self.block).load("cpu", dtype)
                for name, tensor, scale in self._paired(self._tensors())}

    def items(self, num_experts: int, progress: Any = None, skip: frozenset[str] = frozenset()
              ) -> Iterator[StoredTensor | StoredExperts]:
        staged: dict[str, dict[str, dict[int, tuple]]] = defaultdict(lambda: defaultdict(dict))
        for name, tensor, scale in self._paired(self._tensors(progress, skip=skip)):
            expert = PER_EXPERT.match(name)
            if not expert:
                yield StoredTensor(name, tensor, scale, self.block or DEFAULT_BLOCK)
                continue
            prefix = expert.group(1)
            parts = staged[prefix]
            parts[expert.group(3)][int(expert.group(2))] = (tensor, scale)
            if all(len(parts[m]) == num_experts for m in MATRICES):
                del staged[prefix]
                yield self._stack(prefix, parts, num_experts)
        if staged:
            raise ValueError(f"model: routed experts incomplete in the checkpoint for {', '.join(sorted(staged)[:3])}")

    def layer_experts(self, prefix: str, num_experts: int, first: int | None = None) -> StoredExperts:
        count = num_experts if first is None else min(first, num_experts)
        parts: dict[str, dict[int, tuple]] = defaultdict(dict)
        fused: dict[str, torch.Tensor] = {}
        wanted = (t for t in self._tensors(prefix=prefix + ".")
                  if not (PER_EXPERT.match(t[0]) and int(PER_EXPERT.match(t[0]).group(2)) >= count))
        for name, tensor, scale in self._paired(wanted):
            expert = PER_EXPERT.match(name)
            if expert and expert.group(1) == prefix:
                parts[expert.group(3)][int(expert.group(2))] = (tensor, scale)
            elif name in (f"{prefix}.gate_up_proj", f"{prefix}.down_proj"):
                fused[name.rpartition(".")[2]] = tensor
        if len(fused) == 2:
            gate, up = fused["gate_up_proj"][:count].chunk(2, dim=1)
            return StoredExperts(prefix, gate, up, fused["down_proj"][:count])
        if any(len(parts[m]) != count for m in MATRICES):
            raise ValueError(f"model: routed experts incomplete in the checkpoint for {prefix}")
        return self._stack(prefix, parts, count)

    def _stack(self, prefix: str, parts: dict[str, dict[int, tuple]], count: int) -> StoredExperts:
        weights = [torch.stack([parts[m][e][0] for e in range(count)]) for m in MATRICES]
        fp8 = parts[MATRICES[0]][0][1] is not None
        scales = tuple(torch.stack([parts[m][e][1] for e in range(count)]) for m in MATRICES) if fp8 else None
        return StoredExperts(prefix, weights[0], weights[1], weights[2], scales, self.block or DEFAULT_BLOCK)


def describe(config: dict, block: tuple[int, int] | None) -> tuple[str, str]:
    """A safetensors checkpoint's format ("safetensors, FP8 e4m3 in 128x128 blocks") and what its projections are
    stored as (FP8, bf16, ...), from its config.json and `quantization_block`."""
    if block:
        return "safetensors, FP8 e4m3 in {}x{} blocks".format(*block), "FP8"
    name = config.get("torch_dtype") or config.get("dtype")
    stored = dtype_name(getattr(torch, str(name), torch.bfloat16) if name else torch.bfloat16)
    return f"safetensors, {stored}", stored


PARTS = (("experts", re.compile(r"\.mlp\.experts\.")), ("norms", re.compile(r"norm\.weight$")),
         ("attention", re.compile(r"\.self_attn\.")),
         ("router", re.compile(r"\.mlp\.gate\.")), ("mlp", re.compile(r"\.mlp\.")),
         ("embeddings", re.compile(r"(^|\.)(embed_tokens|lm_head)\.")))


def part_of(name: str) -> str:
    """The part of a DeepSeek model a parameter belongs to, as the storage report groups them."""
    return next((part for part, pattern in PARTS if pattern.search(name)), "other")


class StorageNotes:
    """How each part of the model was loaded, noted as it happens; `report` gives the CheckpointStorage."""

    def __init__(self) -> None:
        self._notes: dict[str, set[str]] = defaultdict(set)

    def note(self, part: str, storage: str) -> None:
        self._notes[part].add(storage)

    def loaded(self, name: str, stored_as: str, dtype: torch.dtype) -> None:
        """A weight stored as `stored_as` and held in `dtype` ("bf16 from FP8", or "bf16" when unchanged)."""
        held = dtype_name(dtype)
        self.note(part_of(name), held if held == stored_as else f"{held} from {stored_as}")

    def report(self, checkpoint_format: str) -> Any:
        order = ("experts", "attention", "mlp", "router", "embeddings", "norms", "other")
        parts = tuple((p, " / ".join(sorted(self._notes[p]))) for p in order if self._notes.get(p))
        return CheckpointStorage(checkpoint_format, parts)
