"""The GPU's own copies of routed experts in host memory (`HostExperts`), which prompt chunks stream to the GPU
(streaming.py) and decode steps read in place (mapped.py): int8 with a float32 scale per output row, or for 4-bit
methods int4 with a bf16 scale per 128 weights of a row (`copy_bits`), or V4's MXFP4 experts as released; pinned in
place (cudaHostRegister, so no power-of-two rounding of torch's pinned allocator)."""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from engines.checkpoints import mxfp4 as mxfp4_format

PAGE = 4096  # bytes: the unit host memory is pinned in
_HOST_REGISTER_PORTABLE, _HOST_REGISTER_MAPPED = 1, 2  # cudaHostRegister flags

# kt-kernel's read rate of experts, which the GPU's share of a layer is weighed against. Measured on the GPU machine
# (nvidia-h200, 14 kt-kernel threads): the INT8 MoE forward of one V2-Lite layer reads its experts at 49-52 GB/s
# (`python -m bench.expert_floor`).
CPU_EXPERT_BYTES_PER_S = 50e9

# The 4-bit copies: a bf16 scale per INT4_GROUP weights of a row; a row is packed in blocks of 2 * INT4_GROUP
# weights, 128 bytes each, weight j of a block in the low nibble of the block's byte j and weight INT4_GROUP + j in
# its high nibble, so a kernel reading a block's bytes gets two whole groups without shuffling them; rows are padded
# with zeros to whole blocks.
INT4_GROUP = 128
INT4_BLOCK = 2 * INT4_GROUP


def copy_bits(method_bits: int) -> int:
    """The bits of the GPU's copies for a method of `method_bits`-bit weights: 4 for 4-bit methods (as small as
    kt-kernel's form), 8 for the others."""
    return 4 if method_bits <= 4 else 8


def _padded(cols: int) -> int:
    return -(-cols // INT4_BLOCK) * INT4_BLOCK


def _copy_specs(experts: int, intermediate: int, hidden: int, bits: int, mxfp4: bool = False
                ) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of `HostExperts`' tensors (gate_up, its scales, down, its scales) for `experts` experts."""
    if mxfp4:  # as released: packed E2M1 pairs, a UE8M0 code (a power of two) per 32 weights of a row
        return [((experts, 2 * intermediate, hidden // 2), torch.uint8),
                ((experts, 2 * intermediate, hidden // mxfp4_format.GROUP), torch.uint8),
                ((experts, hidden, intermediate // 2), torch.uint8),
                ((experts, hidden, intermediate // mxfp4_format.GROUP), torch.uint8)]
    if bits == 8:
        return [((experts, 2 * intermediate, hidden), torch.int8), ((experts, 2 * intermediate), torch.float32),
                ((experts, hidden, intermediate), torch.int8), ((experts, hidden), torch.float32)]
    if bits == 4:
        h, i = _padded(hidden), _padded(intermediate)
        return [((experts, 2 * intermediate, h // 2), torch.uint8),
                ((experts, h // INT4_GROUP, 2 * intermediate), torch.bfloat16),
                ((experts, hidden, i // 2), torch.uint8), ((experts, i // INT4_GROUP, hidden), torch.bfloat16)]
    raise ValueError(f"the GPU's copies of experts are 8- or 4-bit, not {bits}-bit")


def expert_copy_bytes(hidden: int, intermediate: int, bits: int = 8, mxfp4: bool = False) -> int:
    """Host bytes of one expert's copy: int8 gate, up and down with a float32 scale per output row, or with
    `bits` = 4 the packed int4 rows with their bf16 group scales; with `mxfp4`, the released MXFP4 weights."""
    return sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
               for shape, dtype in _copy_specs(1, intermediate, hidden, bits, mxfp4))


def experts_within(budget_bytes: float, layers: int, num_experts: int, hidden: int, intermediate: int,
                   bits: int = 8, mxfp4: bool = False) -> int:
    """How many of each layer's experts (the first ones) `layers` layers can keep copies of in `budget_bytes`."""
    if layers <= 0:
        return num_experts
    return min(num_experts, int(budget_bytes // (layers * expert_copy_bytes(hidden, intermediate, bits, mxfp4))))


def _quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] -> (int8 [..., rows, cols], float32 [..., rows]); weight ~= q * scale per row."""
    w = weight.float()
    scale = w.abs().amax(dim=-1).clamp_min(1e-12) / 127
    return torch.round(w / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8), scale


def _quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] -> (uint8 [..., rows, padded / 2], bf16 [..., padded / INT4_GROUP, rows]): symmetric int4
    per group of INT4_GROUP weights of a row, stored as value + 8, packed as INT4_BLOCK describes; the scales of a
    group lie together for all rows (a kernel reads a block of rows' scales at once)."""
    *lead, rows, cols = weight.shape
    w = F.pad(weight.float(), (0, _padded(cols) - cols)).reshape(*lead, rows, -1, INT4_GROUP)
    scale = (w.abs().amax(-1, keepdim=True) / 7).clamp_min(1e-12).bfloat16()
    q = (torch.round(w / scale.float()).clamp_(-7, 7) + 8).to(torch.uint8).reshape(*lead, rows, -1, 2, INT4_GROUP)
    packed = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*lead, rows, -1)
    return packed, scale.squeeze(-1).transpose(-1, -2).contiguous()


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, cols: int) -> torch.Tensor:
    """The bf16 weights [..., rows, cols] of `_quantize_int4`'s packed rows and scales."""
    *lead, rows, half = packed.shape
    blocks = packed.reshape(*lead, rows, half // INT4_GROUP, 1, INT4_GROUP)
    q = torch.cat([blocks & 15, blocks >> 4], dim=-2).reshape(*lead, rows, -1, INT4_GROUP).to(torch.bfloat16) - 8
    w = q * scale.transpose(-1, -2).unsqueeze(-1)
    return w.reshape(*lead, rows, -1)[..., :cols]


def _host_tensors(specs: list[tuple[tuple[int, ...], torch.dtype]], pin: bool
                  ) -> tuple[list[torch.Tensor], Callable[[], None] | None]:
    """Tensors of these shapes and dtypes laid out in one host allocation, page-locked where it lies when
    `pin` (cudaHostRegister: exact size, no power-of-two rounding as torch's pinned allocator has), and the
    call that unpins it (None when not pinned). The registered range is whole pages inside the allocation,
    so it never shares a page with another registration."""
    sizes = [torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
    aligned = [-(-size // 64) * 64 for size in sizes]
    total = -(-sum(aligned) // PAGE) * PAGE
    raw = torch.empty(total + PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE
    block = raw[skip:skip + total]
    unpin = None
    if pin:
        cudart = torch.cuda.cudart()
        # portable and mapped: any GPU may read it, by copies or straight from a kernel (experts/mapped.py)
        flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
        if int(cudart.cudaHostRegister(block.data_ptr(), total, flags)) != 0:
            raise RuntimeError(f"could not pin {total} bytes of host memory for the GPU's copies of experts; "
                               "kt_gpu_read_experts=0 (and no kt_gpu_prefill_tokens) keeps every expert in kt-kernel")
        unpin = partial(cudart.cudaHostUnregister, block.data_ptr())
    out, offset = [], 0
    for (shape, dtype), size, step in zip(specs, sizes, aligned):
        out.append(block[offset:offset + size].view(dtype).view(shape))
        offset += step
    return out, unpin


COPY_TENSORS = ("gate_up", "gate_up_scale", "down", "down_scale")  # HostExperts' fields, as saved


@dataclass(slots=True, weakref_slot=True)
class HostExperts:
    """One layer's routed experts as the GPU side reads them: int8 with a float32 scale per output row, or (4-bit
    copies) int4 packed two to a byte with a bf16 scale per INT4_GROUP weights of a row (`_quantize_int4`), or
    (`mxfp4`) V4's MXFP4 weights as released (`mxfp4_of`)."""

    gate_up: torch.Tensor  # int8 [E, 2I, H]: gate rows, then up rows; 4-bit: uint8 [E, 2I, padded H / 2]; MXFP4:
    # uint8 [E, 2I, H / 2], E2M1 pairs, the earlier column in the low nibble
    gate_up_scale: torch.Tensor  # float32 [E, 2I]; 4-bit: bf16 [E, padded H / INT4_GROUP, 2I]; MXFP4: UE8M0 codes
    # uint8 [E, 2I, H / 32]
    down: torch.Tensor  # int8 [E, H, I]; 4-bit: uint8 [E, H, padded I / 2]; MXFP4: uint8 [E, H, I / 2]
    down_scale: torch.Tensor  # float32 [E, H]; 4-bit: bf16 [E, padded I / INT4_GROUP, H]; MXFP4: uint8 [E, H, I / 32]
    mxfp4: bool = False
    pinned: bool = False  # page-locked (cudaHostRegister) while this object lives

    @classmethod
    def quantize(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *, bits: int = 8,
                 work_device: torch.device | str = "cpu", pin: bool = False) -> "HostExperts":
        """From the checkpoint's gate/up [E, I, H] and down [E, H, I], as `bits`-bit copies (8 or 4); quantized one
        expert at a time on `work_device` (a GPU does a V2-Lite layer in well under a second) into host memory."""
        E, I, H = gate.shape
        host = cls.empty(E, I, H, bits=bits, pin=pin)
        quantize = _quantize_rows if bits == 8 else _quantize_int4
        for e in range(E):
            gu = torch.cat([gate[e], up[e]]).to(work_device)
            q, s = quantize(gu)
            host.gate_up[e].copy_(q)
            host.gate_up_scale[e].copy_(s)
            q, s = quantize(down[e].to(work_device))
            host.down[e].copy_(q)
            host.down_scale[e].copy_(s)
        return host

    @classmethod
    def empty(cls, experts: int, intermediate: int, hidden: int, *, bits: int = 8, pin: bool = False,
              mxfp4: bool = False) -> "HostExperts":
        """Uninitialized `bits`-bit copies (8 or 4), or MXFP4 weights, of `experts` experts, in one host allocation
        (page-locked when `pin`)."""
        tensors, unpin = _host_tensors(_copy_specs(experts, intermediate, hidden, bits, mxfp4), pin and experts > 0)
        host = cls(*tensors, mxfp4=mxfp4, pinned=unpin is not None)
        if unpin is not None:  # the memory stays pinned as long as this object holds it
            weakref.finalize(host, unpin)
        return host

    @classmethod
    def mxfp4_of(cls, weights: dict[str, torch.Tensor], *, pin: bool = False) -> "HostExperts":
        """Copies of a layer's MXFP4 experts as a checkpoint ships them ("gate"/"up" [E, I, H/2], "down" [E, H, I/2]
        packed, "<m>_scale" UE8M0 [E, n, k/32], uint8 or float8_e8m0fnu), byte for byte, in one host allocation
        (page-locked when `pin`)."""
        (E, I, _), H = weights["gate"].shape, weights["down"].shape[1]
        host = cls.empty(E, I, H, pin=pin, mxfp4=True)
        for name, packed, scale, rows in (("gate", host.gate_up, host.gate_up_scale, slice(0, I)),
                                          ("up", host.gate_up, host.gate_up_scale, slice(I, 2 * I)),
                                          ("down", host.down, host.down_scale, slice(None))):
            packed[:, rows].copy_(weights[name].view(torch.uint8))
            scale[:, rows].copy_(weights[f"{name}_scale"].view(torch.uint8))
        return host

    def to(self, device: torch.device | str) -> "HostExperts":
        """These copies in `device`'s memory (a GPU's own: kt_gpu_resident_experts)."""
        return HostExperts(*(t.to(device) for t in self.tensors()), mxfp4=self.mxfp4)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.gate_up, self.gate_up_scale, self.down, self.down_scale

    def named(self) -> dict[str, torch.Tensor]:
        return dict(zip(COPY_TENSORS, self.tensors()))

    @property
    def held(self) -> int:
        """How many experts (the layer's first ones) this copy holds."""
        return self.gate_up.shape[0]

    @property
    def bits(self) -> int:
        return 4 if self.gate_up.dtype == torch.uint8 else 8

    @property
    def form(self) -> str:
        """What the start-up log calls these copies: int8, int4 or mxfp4."""
        return "mxfp4" if self.mxfp4 else f"int{self.bits}"

    @property
    def hidden(self) -> int:
        return self.down.shape[1]

    @property
    def intermediate(self) -> int:
        return self.gate_up.shape[1] // 2

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
