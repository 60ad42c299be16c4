"""The quantized-weight cache of one layer's CPU experts (`--kt-weight-cache DIR`, engines/kt/loader.py).

Quantizing a layer's experts dominates a cold start; with a cache folder the first load writes the quantized
form and later loads read it back. kt-kernel writes the AMX forms itself, under its own per-layer folder
("<PREFIX>_<mat>_<expert>_<bytes>Byte_..."); the forms quantized in torch (FP8, RAWINT4) are saved here as one
safetensors file per layer; hot experts' weights (kept on the GPU in torch) go beside them, and so do the GPU's
copies (int8, int4 for 4-bit methods) of the experts kt-kernel does not hold (`first_expert`, kt_gpu_read_experts
and kt_gpu_resident_experts: one file, whichever memory each expert lies in), and the decode kernel's own INT8 /
INT4 form where it quantized one from the bf16 weights (read back where present). A manifest, written last, says what
the folder holds: a load reads it back only when the manifest matches this layer's method,
shape, kt-kernel build and layout, and every file it names is there."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engines.kt.experts.host_copies import COPY_TENSORS, HostExperts

FORMAT = 2
KT_FILES = {"AMXINT8": ("INT8", 8), "AMXINT4": ("INT4", 4)}  # method -> kt-kernel's file prefix, bits
MATRICES = ("gate", "up", "down")
_SAFETENSORS_DTYPES = {torch.int8: "I8", torch.uint8: "U8", torch.float32: "F32", torch.bfloat16: "BF16"}


def build_info() -> dict[str, str]:
    import kt_kernel

    return {"kt_kernel": str(kt_kernel.__version__), "cpu_variant": str(kt_kernel.__cpu_variant__),
            "int8_layout": str(getattr(kt_kernel, "__int8_weight_layout__", ""))}


@dataclass(frozen=True)
class LayerCache:
    """One layer's part of a cache folder, for one method and shape."""

    root: Path
    layer_idx: int
    method: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    # the layer's expert that kt-kernel's expert 0 is (kt_gpu_read_experts: the GPU owns the ones before it)
    first_expert: int = 0

    @property
    def dir(self) -> Path:
        return self.root / f"_layer_{self.layer_idx}"  # kt-kernel's own per-layer folder

    @property
    def written_by_kt_kernel(self) -> bool:
        """kt-kernel saves and loads this method's quantized form itself (given the root folder)."""
        return self.method in KT_FILES

    def _manifest_path(self) -> Path:
        return self.dir / f"ktserve-{self.method}.json"

    def _manifest(self) -> dict:
        first = {"first_expert": self.first_expert} if self.first_expert else {}
        return {"format": FORMAT, "method": self.method, "num_experts": self.num_experts, **first,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size, **build_info()}

    def _copies_path(self) -> Path:
        return self.dir / "ktserve-gpu-copies.safetensors"

    def _files(self) -> list[Path]:
        # the GPU's copies of the experts before `first_expert`, which kt-kernel does not hold
        copies = [self._copies_path()] if self.first_expert else []
        if not self.written_by_kt_kernel:
            return [self.dir / f"ktserve-{self.method}.safetensors", *copies]
        return self.kt_files() + copies

    def kt_files(self) -> list[Path]:
        """The files kt-kernel writes and reads for this layer (one NUMA node)."""
        prefix, bits = KT_FILES[self.method]
        files = []
        for mat, rows, cols in (("gate", self.intermediate_size, self.hidden_size),
                                ("up", self.intermediate_size, self.hidden_size),
                                ("down", self.hidden_size, self.intermediate_size)):
            for e in range(self.num_experts):
                stem = self.dir / "_numa_0" / f"{prefix}_{mat}_{e}_"
                files += [stem.with_name(stem.name + f"{rows * cols * bits // 8}Byte_quant_.kt"),
                          stem.with_name(stem.name + f"{rows * 4}Byte_scale_.kt")]
        return files

    def complete(self) -> bool:
        """Whether the folder holds this layer's weights for this method, shape and kt-kernel build."""
        try:
            manifest = json.loads(self._manifest_path().read_text())
        except (OSError, ValueError):
            return False
        return manifest == self._manifest() and all(p.is_file() for p in self._files())

    def begin_save(self) -> None:
        """Called before writing: a crash mid-save then leaves no manifest, so nothing half-written is read."""
        self._manifest_path().unlink(missing_ok=True)

    def save_prepared(self, prepared: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        self.dir.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in prepared.items()}, str(self._files()[0]))

    def load_prepared(self) -> dict[str, Any]:
        from safetensors.torch import load_file

        return load_file(str(self._files()[0]))

    def save_copies(self, copies: "HostExperts", resident: "HostExperts | None" = None) -> None:
        """Write the GPU's copies of the experts before `first_expert` (kt_gpu_read_experts): those in host
        memory, after the first ones `resident` keeps in GPU memory (kt_gpu_resident_experts)."""
        from safetensors.torch import save_file

        self.dir.mkdir(parents=True, exist_ok=True)
        parts = [resident.named(), copies.named()] if resident is not None else [copies.named()]
        save_file({name: torch.cat([p[name].cpu() for p in parts]) for name in parts[0]}, str(self._copies_path()))

    def load_copies(self, pin: bool, resident: int = 0, device: torch.device | str = "cpu", bits: int = 8
                    ) -> "tuple[HostExperts | None, HostExperts] | None":
        """The GPU's `bits`-bit copies `save_copies` wrote: the first `resident` experts in `device`'s memory (None
        where there are none), the others in host memory (page-locked when `pin`); None when the file does not
        hold `first_expert` experts of this shape and form."""
        from safetensors import safe_open

        try:
            saved = safe_open(str(self._copies_path()), framework="pt")
        except OSError:
            return None
        with saved:
            copies = HostExperts.empty(self.first_expert - resident, self.intermediate_size, self.hidden_size,
                                       bits=bits, pin=pin)
            first = (HostExperts.empty(resident, self.intermediate_size, self.hidden_size, bits=bits)
                     if resident else None)
            for name, tensor in zip(COPY_TENSORS, copies.tensors()):
                if name not in saved.keys():
                    return None
                rows = saved.get_slice(name)
                if (tuple(rows.get_shape()) != (self.first_expert, *tensor.shape[1:])
                        or rows.get_dtype() != _SAFETENSORS_DTYPES[tensor.dtype]):
                    return None
                tensor.copy_(rows[resident:])
                if first is not None:
                    first.named()[name].copy_(rows[:resident])
        return (None if first is None else first.to(device)), copies

    def _decode_kernel_path(self, fmt: str) -> Path:
        return self.dir / f"ktserve-decode-{fmt}.safetensors"

    def save_decode_kernel(self, fmt: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write the decode kernel's own quantized form of the layer (INT8 / INT4 made from the bf16 weights at
        load: decode_calls.py), so that a load from the cache serves decode calls as the first load did."""
        from safetensors.torch import save_file

        self.dir.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(self._decode_kernel_path(fmt)))

    def load_decode_kernel(self, fmt: str) -> dict[str, torch.Tensor] | None:
        """What `save_decode_kernel` wrote for `fmt` and this layer's shape, or None (not written: a cache made
        with the kernel off, or before it was kept; a file of other shapes)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(self._decode_kernel_path(fmt)))
        except (OSError, SafetensorError):  # none, or not whole (a save cut short)
            return None
        shapes = {"gate": (self.num_experts, self.intermediate_size), "up": (self.num_experts, self.intermediate_size),
                  "down": (self.num_experts, self.hidden_size)}
        if any(m not in tensors or f"{m}_scale" not in tensors or tuple(tensors[m].shape[:2]) != shape
               for m, shape in shapes.items()):
            return None
        return tensors

    def finish_save(self, hot: tuple[torch.Tensor, ...] | None, hot_experts: list[int]) -> None:
        """Write the hot experts' weights (gate, up, down stacked over `hot_experts`), then the manifest."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if hot is not None:
            tensors = {f"{m}.{e}": t[i].detach().to("cpu").contiguous()
                       for m, t in zip(MATRICES, hot) for i, e in enumerate(hot_experts)}
            torch.save(tensors, self.dir / "ktserve-gpu-experts.pt")
        self._manifest_path().write_text(json.dumps(self._manifest(), indent=1))

    def load_hot(self, hot_experts: list[int], device: torch.device | str) -> tuple[torch.Tensor, ...] | None:
        """The hot experts' (gate, up, down) stacked on `device`, or None when the cache lacks one of them."""
        try:
            saved = torch.load(self.dir / "ktserve-gpu-experts.pt", weights_only=True)
        except (OSError, RuntimeError):
            return None
        if not all(f"{m}.{e}" in saved for m in MATRICES for e in hot_experts):
            return None
        return tuple(torch.stack([saved[f"{m}.{e}"] for e in hot_experts]).to(device) for m in MATRICES)


_MERGED_KEY = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(\d+)\.numa\.(\d+)\.(weight|scale)$")
_KT_FILE = re.compile(r"^(INT8|INT4)_(gate|up|down)_(\d+)_\d+Byte_(quant|scale)_\.kt$")


@dataclass(frozen=True)
class ConvertedExperts:
    """kt-kernel's pre-converted CPU experts (`kt_weight_path`), in either layout its conversion script writes
    (kt-kernel's scripts/convert_cpu_weights.py, `kt quant`): merged safetensors files with keys
    `blk.<layer>.ffn_<gate|up|down>_exps.<expert>.numa.<node>.<weight|scale>` (the default: each tensor the bytes
    of one .kt file), or per-layer folders `_layer_<layer>/_numa_<node>/<INT8|INT4>_<mat>_<expert>_<n>Byte_<quant|
    scale>_.kt` (--no-merge-safetensor; also what kt-kernel itself saves). Read-only: nothing is written there."""

    root: Path
    method: str  # AMXINT8 | AMXINT4
    layers: frozenset[int]
    merged: bool
    hidden_size: int
    intermediate_size: int

    @classmethod
    def open(cls, root: str | os.PathLike, hidden_size: int, intermediate_size: int) -> "ConvertedExperts":
        path = Path(root)
        if not path.is_dir():
            raise ValueError(f"kt_weight_path: {path} is not a directory")
        files = sorted(path.glob("*.safetensors"))
        found: list[tuple[str, int, int]] = []  # (INT8 | INT4, layer, NUMA node)
        if files:
            from safetensors import safe_open

            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    for key in f.keys():
                        m = _MERGED_KEY.match(key)
                        if m and m.group(2) == "gate" and m.group(5) == "weight":
                            size = f.get_slice(key).get_shape()[0]
                            prefix = {8: "INT8", 4: "INT4"}.get(size * 8 // (hidden_size * intermediate_size), "?")
                            found.append((prefix, int(m.group(1)), int(m.group(4))))
        else:
            found = [(m.group(1), int(d.parent.name.removeprefix("_layer_")), int(d.name.removeprefix("_numa_")))
                     for d in path.glob("_layer_*/_numa_*") for f in d.iterdir() for m in [_KT_FILE.match(f.name)] if m]
        if not found:
            raise ValueError(f"kt_weight_path: {path} holds neither kt-kernel's merged *.safetensors (blk.<layer>."
                             "ffn_*_exps.<expert>.numa.<node>.*) nor its _layer_<n>/_numa_<m>/*.kt folders; point it "
                             "at the output folder of kt-kernel's conversion (`kt quant`, convert_cpu_weights.py)")
        prefixes, nodes = {p for p, _, _ in found}, {n for _, _, n in found}
        if prefixes - {"INT8", "INT4"} or len(prefixes) > 1:
            raise ValueError(f"kt_weight_path: {path} holds experts that are not all INT8 or all INT4 of "
                             f"{intermediate_size} x {hidden_size} (this model's expert shape)")
        if len(nodes) != 1:
            raise ValueError(f"kt_weight_path: {path} was converted for {len(nodes)} NUMA nodes; ktserve runs "
                             "kt-kernel's workers as one pool, so convert with one (`--threadpool-count 1`)")
        return cls(path, "AMX" + prefixes.pop(), frozenset(layer for _, layer, _ in found), bool(files), hidden_size,
                   intermediate_size)

    def layer(self, layer_idx: int, num_experts: int) -> dict[str, Any] | None:
        """What kt-kernel's loader takes for a layer: {} (it reads the folder itself) for the folder layout, or
        the layer's tensors {"gate": [...], "gate_scale": [...], ...} (one per expert) for the merged one; None
        when the folder lacks the layer."""
        if layer_idx not in self.layers:
            return None
        if not self.merged:
            files = LayerCache(self.root, layer_idx, self.method, num_experts, self.hidden_size,
                               self.intermediate_size).kt_files()
            missing = [f for f in files if not f.is_file()]
            if missing:
                raise ValueError(f"kt_weight_path: {missing[0]} is missing ({len(missing)} of layer {layer_idx}'s "
                                 f"{len(files)} files)")
            return {}
        from safetensors import safe_open

        slots = {"weight": "", "scale": "_scale"}
        wanted = {f"blk.{layer_idx}.ffn_{m}_exps.{e}.numa.0.{kind}": (m + slots[kind], e)
                  for m in MATRICES for e in range(num_experts) for kind in slots}
        out: dict[str, list] = {m + s: [None] * num_experts for m in MATRICES for s in slots.values()}
        for file in sorted(self.root.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key in wanted:
                        slot, e = wanted[key]
                        out[slot][e] = f.get_tensor(key).contiguous()
        lacking = sorted(k for k, (slot, e) in wanted.items() if out[slot][e] is None)
        if lacking:
            raise ValueError(f"kt_weight_path: {lacking[0]} is missing from {self.root} ({len(lacking)} tensors of "
                             f"layer {layer_idx})")
        return out
