"""Finding and opening the files of a GGUF checkpoint: one `.gguf` file, the first of a split set
(`<name>-00001-of-00003.gguf`, the other parts beside it), or a folder holding either. Metadata (the
architecture, hyper-parameters, tokenizer) is in the first file; tensors may be in any part."""
from __future__ import annotations

import mmap
import re
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF checkpoint: a .gguf file, or a folder with .gguf files and no safetensors."""
    path = Path(path)
    if path.is_dir():
        return any(path.glob("*.gguf")) and not any(path.glob("*.safetensors"))
    return path.suffix == ".gguf"


def checkpoint_parts(path: str | Path) -> list[Path]:
    """Every file of the checkpoint `path` names, first part first; ValueError naming a missing part."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        firsts = [f for f in found if not SPLIT_NAME.match(f.name) or SPLIT_NAME.match(f.name)["no"] == "00001"]
        if len(firsts) != 1:
            names = ", ".join(f.name for f in (firsts or found)[:4])
            raise ValueError(f"model: {path} holds {len(firsts)} GGUF checkpoints ({names or 'none'}); name the file "
                             "(the first part of a split set)")
        path = firsts[0]
    if not path.is_file():
        raise ValueError(f"model: GGUF file {path} does not exist")
    split = SPLIT_NAME.match(path.name)
    if split is None:
        return [path]
    if split["no"] != "00001":
        raise ValueError(f"model: {path.name} is part {int(split['no'])} of a split GGUF; name the first part, "
                         f"{split['stem']}-00001-of-{split['count']}.gguf")
    count = int(split["count"])
    parts = [path.with_name(f"{split['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ValueError(f"model: split GGUF part {missing[0]} is missing from {path.parent} (the set has {count} "
                         f"parts; {len(missing)} missing)")
    return parts


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # a view of the mapped file: float32 / float16 values, or uint8 rows of blocks


def read_gguf(path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """A GGUF file's metadata and tensors (views of a read-only mapping of the file). Parsed here rather than
    by gguf.GGUFReader, which took 30 s over the 257,000 strings of a DeepSeek tokenizer."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        value = struct.unpack_from(fmt, buf, pos)[0]
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        size = take("<Q")
        pos += size
        return bytes(buf[pos - size:pos]).decode("utf-8", errors="replace")

    def value(kind: int) -> Any:
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            item, count = take("<I"), take("<Q")
            return [value(item) for _ in range(count)]
        return take(_SCALARS[kind])

    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("no GGUF magic number at its start")
    pos = 4
    version, count, kv_count = take("<I"), take("<Q"), take("<Q")
    if version < 2:
        raise ValueError(f"GGUF version {version} is older than this reader's 2")
    meta = {}
    for _ in range(kv_count):
        key = string()
        meta[key] = value(take("<I"))
    infos = []
    for _ in range(count):
        name = string()
        dims = [take("<Q") for _ in range(take("<I"))]
        infos.append((name, dims, take("<I"), take("<Q")))
    alignment = int(meta.get("general.alignment", 32))
    start = -(-pos // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in infos:
        qtype = GGMLQuantizationType(kind)
        block, size = GGML_QUANT_SIZES[qtype]
        shape = list(reversed(dims))  # numpy order: the fastest-varying dimension last
        dtype = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}.get(qtype, np.uint8)
        if dtype == np.uint8:
            shape[-1] = shape[-1] // block * size
        data = np.frombuffer(buf, dtype=dtype, count=int(np.prod(shape)), offset=start + offset).reshape(shape)
        tensors.append(GGUFTensor(name, qtype, data))
    return meta, tensors


@dataclass
class GGUFFiles:
    """The opened parts, the first part's metadata and where each tensor is."""

    parts: list[Path]
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, GGUFTensor] = field(default_factory=dict)

    @classmethod
    def open(cls, path: str | Path) -> "GGUFFiles":
        files = cls(checkpoint_parts(path))
        for i, part in enumerate(files.parts):
            try:
                meta, tensors = read_gguf(part)
            except (ValueError, OSError, struct.error, KeyError) as exc:
                raise ValueError(f"model: {part} is not a readable GGUF file ({exc})") from None
            if i == 0:
                files.meta = meta
            files.tensors.update((t.name, t) for t in tensors)
        declared = files.value("split.count")
        if declared is not None and int(declared) != len(files.parts):
            raise ValueError(f"model: {files.parts[0].name} says its set has {declared} parts, the file names say "
                             f"{len(files.parts)}")
        return files

    def __len__(self) -> int:  # files, as the loader's progress counts a checkpoint's shards
        return len(self.parts)

    @property
    def first(self) -> Path:
        return self.parts[0]

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value of the first part (strings decoded, arrays as lists), or `default`."""
        return self.meta.get(key, default)

    def type_name(self, name: str) -> str:
        return self.tensors[name].type.name

    def array(self, name: str) -> np.ndarray:
        """The tensor as stored: float arrays for F32/F16, uint8 rows of blocks for the others (a view of the file)."""
        return self.tensors[name].data

    def tensor_bytes(self, name: str) -> "Any":
        """The stored blocks as a uint8 torch tensor [..., row bytes] sharing the file's memory (read-only)."""
        import torch

        data = self.array(name)
        raw = data.view(np.uint8).reshape(*data.shape[:-1], -1)
        with warnings.catch_warnings():  # the mapping is read-only; nothing here writes to it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(raw)

    def dequantized(self, name: str, index: int | None = None) -> np.ndarray:
        """The tensor (with `index`, its slice of that index along the first dimension: one expert) as float32,
        whatever its type (the gguf package's dequantize reads nearly every type it defines)."""
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        try:
            data = tensor.data if index is None else tensor.data[index]
            return np.array(dequantize(data, tensor.type), dtype=np.float32)  # a copy, not the file's
        except NotImplementedError:
            raise ValueError(f"model: tensor {name} of {self.first.name} is stored as {tensor.type.name}, "
                             "a type the installed gguf package cannot dequantize") from None
