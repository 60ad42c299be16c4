"""Routed experts of prompt chunks computed partly on the GPU, their weights streamed from pinned host memory
(`kt_gpu_prefill_tokens`).

A prompt chunk of T tokens picks nearly every expert of every layer (64 x (1 - (58/64)^T) of V2-Lite's 64 at
T = 128 is 64.0), so the CPU reads all of a layer's expert bytes once per chunk, and for long chunks it is
bound by arithmetic as well. The GPU has spare arithmetic and its own path to host memory (PCIe), so a chunk
of at least `kt_gpu_prefill_tokens` tokens splits each layer's experts: experts [0, n) are copied to the GPU
and computed there while kt-kernel computes the rest on the CPU, both at once. `ExpertStreamer.split` picks n
so that both sides take about as long (`split_experts`).

The GPU side reads its own copy of the experts (`HostExperts`): int8 with a float32 scale per output row, or for
4-bit methods int4 with a bf16 scale per 128 weights of a row (`copy_bits`), in host memory pinned in place
(cudaHostRegister, so no power-of-two rounding of torch's pinned allocator). Those copies take host memory on top
of kt-kernel's own form (a byte per expert weight in int8, about half that in int4), the reason this is opt-in.
DeepSeek-V4's MXFP4 experts are copied as the release ships them (`HostExperts.mxfp4_of`: packed E2M1 pairs and
their UE8M0 codes, as much host memory as kt-kernel's own MXFP4 buffers, into which its kernels copy them at load
rather than reading them in place), and the GPU side dequantizes them on the device, a group of experts a kernel
(E2M1 x UE8M0, engines/checkpoints/mxfp4.py), so it computes exactly kt-kernel's weights, clamping the SwiGLU inputs as V4's
experts do (`swiglu_limit`); decode steps read a share of those copies in place, as of the int8 and int4 ones
(engines/kt/experts/mapped.py). With
`kt_gpu_prefill_memory` each layer keeps copies of only its first experts, as many as the budget holds
(`experts_within`), and the GPU's share of a chunk is capped there: the time saved shrinks with the budget. The
weights travel in groups of `GROUP` experts through a ring of `RING` GPU buffers on a copy stream: while the GPU
computes one group the next ones are in flight, and the last groups of a layer prefetch the next layer's
first. One host sync per layer (the per-expert token counts) bounds the Python side.

A layer's first experts may lie in the GPU's memory instead (`ExpertStreamer.resident`, kt_gpu_resident_experts):
a chunk computes those where they lie while the ring brings the others.

Everything here also runs on the CPU (no streams, plain copies), which is how the tests check its arithmetic
and its buffer ring where there is no GPU.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engines.checkpoints import mxfp4 as mxfp4_format
from engines.kt.experts.host_copies import CPU_EXPERT_BYTES_PER_S, HostExperts, dequantize_int4
from engines.kt.experts.mapped import MappedExperts, dequantize_int4_into, dequantize_mxfp4_into, triton_available

log = logging.getLogger("ktserve.engine.kt")

GROUP = 8  # experts per copy: 69 MB of int8 for a V2-Lite layer's eight
RING = 3  # GPU buffers of a group each: one computing, two in flight
# Each expert's rows are multiplied in a multiple of this many (the extra rows are the next expert's, whose own
# product overwrites them): matrix products of fewer distinct sizes, each of which the GPU libraries pick and
# compile kernels for once, where a prompt would otherwise bring dozens of new sizes per layer.
ROW_ALIGN = 32

# What the CPU side does, for the split (its read rate of experts: host_copies.CPU_EXPERT_BYTES_PER_S). Measured
# on the GPU machine (nvidia-h200, 14 kt-kernel threads), a 2,048-token prompt took 0.87 s with every layer's
# experts on the CPU (2,048 x 6 x 26 token-experts).
CPU_TOKEN_EXPERTS_PER_S = 2048 * 6 * 26 / 0.87
# kt-kernel's FP8 kernel is far slower at prompts: with the FP8 method on an H200 machine (2026-11-26,
# bench/results/nvidia-h200-2026-11-26/fp8/) a 512-token prompt took 3.69 s with every expert on the CPU, 17x the
# INT8 rate per token-expert, and splitting by the INT8 rate left half the experts there (2.06 s).
# kt-kernel's MXFP4 kernel (V4's experts), on the same H200 machine (2026-11-28, 14 threads, `python -m bench.v4_trace
# --v4-layers 4 --prompt 2048`, V4-Flash's shape: 256 experts, top-6, hidden 4096, intermediate 2048): 2.09 s a layer
# for a 2,048-token prompt (2,048 x 6 token-experts), 99% of the prefill.
CPU_TOKEN_EXPERTS_PER_S_BY_METHOD = {"FP8": 512 * 6 * 26 / 3.69, "MXFP4": 2048 * 6 / 2.09}
# Where the balance gives the GPU at least this share, it takes every expert: the CPU's remainder costs more than
# it saves (the chunk's copy to the host and back, the stream callbacks, and the CPU and the copy engine reading
# the same DRAM). `python -m bench.expert_streaming` on the H100 machine (54.5 GB/s copies), ms per V2-Lite
# layer, all on the CPU / all on the GPU / split: 2,048 tokens 38.8 / 12.0 / 12.5 (49 of 64 on the GPU),
# 8,192 tokens 110.7 / 13.5 / 15.6 (59); while at 512 tokens 15.8 / 10.2 / 8.4 (33) and at 128 10.5 / 13.5 / 9.4
# (33) the split is the fastest.
ALL_ON_GPU_SHARE = 0.75
# kt-kernel's MXFP4 kernel is slower still on a prompt's smaller calls than its 2,048-token rate says, so its share
# of a split call finishes long after the GPU's: V4-Flash's shape at 4 layers on the H200 machine (2026-12-04, `python
# -m bench.probes.v4_ttft --prompts 112,129,200,384,700,1500 --setting kt_gpu_prefill_tokens=100`), a 112 / 129 /
# 200-token prompt took 0.47 / 0.52 / 0.32 s split and 0.29 / 0.33 / 0.32 s with every expert on the GPU (longer
# ones the same either way: the balance gives the GPU them all). A call of these methods that streams takes them all.
ALL_ON_GPU_METHODS = frozenset({"MXFP4"})


def split_experts(tokens: int, top_k: int, num_experts: int, cpu_bytes: int, gpu_bytes: int,
                  pcie_bytes_per_s: float, method: str = "AMXINT8") -> int:
    """How many of a layer's experts the GPU should take for a chunk of `tokens`, so that the CPU (bound by
    reading its `cpu_bytes` of experts, or by arithmetic: `CPU_TOKEN_EXPERTS_PER_S`, or `method`'s own rate) and
    the GPU (bound by copying `gpu_bytes` over PCIe) finish together: both sides scale with the share of experts
    they take. All of them from `ALL_ON_GPU_SHARE` on, and always for `ALL_ON_GPU_METHODS`."""
    if method in ALL_ON_GPU_METHODS:
        return num_experts
    token_rate = CPU_TOKEN_EXPERTS_PER_S_BY_METHOD.get(method, CPU_TOKEN_EXPERTS_PER_S)
    cpu = max(cpu_bytes / CPU_EXPERT_BYTES_PER_S, tokens * top_k / token_rate)
    gpu = gpu_bytes / pcie_bytes_per_s
    share = cpu / (cpu + gpu)
    return num_experts if share >= ALL_ON_GPU_SHARE else max(0, round(num_experts * share))


@dataclass(slots=True)
class _Slot:
    """One GPU buffer of the ring: a group of experts, the events ordering its copy and its use."""

    tensors: tuple[torch.Tensor, ...]  # as HostExperts.tensors(), `ExpertStreamer.group` experts each
    ready: torch.cuda.Event | None  # its copy finished (recorded on the copy stream)
    free: torch.cuda.Event | None  # the computation reading it finished (recorded on the compute stream)
    tag: tuple[int, int, int] = (-1, -1, -1)  # (layer, first expert, experts) it holds or is receiving


@dataclass
class StreamStats:
    chunks: int = 0  # layer calls that streamed experts
    experts: int = 0  # experts computed on the GPU
    bytes: int = 0  # bytes copied to the GPU


@dataclass
class ExpertStreamer:
    """The GPU side of one model's prompt chunks on `device`: every layer's `HostExperts`, the ring, the copy
    stream. A model's layers run one after another on one stream, so they share one streamer (per device)."""

    device: torch.device
    # each layer's copies in host memory: its experts [resident, held), numbered from 0 here
    layers: dict[int, HostExperts] = field(default_factory=dict)
    # each layer's first experts kept in the device's memory instead (kt_gpu_resident_experts): [0, resident)
    resident: dict[int, HostExperts] = field(default_factory=dict)
    stats: StreamStats = field(default_factory=StreamStats)
    pcie_bytes_per_s: float | None = None  # measured when the first layer registers
    # the kernels that let decode steps read held experts straight from host memory (engines/kt/experts/mapped.py),
    # set up when the first layer registers copies to be read so; None: none do
    mapped: MappedExperts | None = None

    def __post_init__(self) -> None:
        self._ring: list[_Slot] = []
        self.group = GROUP  # experts per copy; set when the first layer registers
        self._gate_up: torch.Tensor | None = None  # the group being computed, in bf16 (`_build_scratch`)
        self._down: torch.Tensor | None = None
        # int4 copies into that bf16 form: a group by one Triton kernel a matrix on a GPU (experts/mapped.py), else
        # an expert at a time by torch (a group's temporaries would take ~0.5 GB each for V3)
        self._unpack_int4 = self._unpack_mxfp4 = None  # MXFP4 copies likewise (engines/kt/experts/mapped.py)
        if self.device.type == "cuda" and triton_available():
            self._unpack_int4, self._unpack_mxfp4 = dequantize_int4_into, dequantize_mxfp4_into
        self._next = 0  # the ring slot the next copy fills
        self._queue: deque[_Slot] = deque()  # filled (or filling) slots not yet computed, oldest first
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # ------------------------------------------------------------------------------------------ set-up
    def register(self, layer: int, host: HostExperts, top_k: int = 8, read_in_place: bool = False,
                 resident: HostExperts | None = None, limit: float = 0.0) -> None:
        """Keep `layer`'s copies: `host` in host memory, after the first experts `resident` keeps in the device's.
        With `read_in_place`, decode steps may also read them on the GPU straight from where they lie
        (engines/kt/experts/mapped.py: on a CUDA device, where Triton is installed; int8, int4 or MXFP4 copies, their
        SwiGLU inputs clamped at `limit`, V4's swiglu_limit, where it is set); `top_k` (the router's) sizes those
        steps' scratch."""
        if host.held == 0 and (resident is None or resident.held == 0):
            raise ValueError(f"streamed experts of layer {layer}: the copy holds no expert")
        self.layers[layer] = host
        if resident is not None and resident.held:
            self.resident[layer] = resident
        else:
            self.resident.pop(layer, None)
        if self._gate_up is None:
            self._build_scratch(host if host.held else resident)
        if not self._ring and host.held:  # no ring where every expert so far lies in the device's memory
            self._build_ring(host)
        if self.pcie_bytes_per_s is None and host.held:
            self.pcie_bytes_per_s = self._measure_copy(host)
        if read_in_place and self.mapped is None and self.device.type == "cuda":
            self.mapped = MappedExperts(self.device) if triton_available() else None
        if read_in_place and self.mapped is not None:
            self.mapped.register(layer, host, top_k, resident=self.resident.get(layer), limit=limit)

    def resident_experts(self, layer: int) -> int:
        """How many of `layer`'s first experts lie in the device's memory."""
        found = self.resident.get(layer)
        return 0 if found is None else found.held

    def held(self, layer: int) -> int:
        """How many of `layer`'s experts (the first ones) this streamer holds copies of; 0 for another layer."""
        host = self.layers.get(layer)
        return 0 if host is None else self.resident_experts(layer) + host.held

    def ring_bytes(self) -> int:
        """GPU memory the copy ring's buffers take (0 before a layer with copies in host memory registers)."""
        return sum(t.numel() * t.element_size() for slot in self._ring for t in slot.tensors)

    def _build_scratch(self, copies: HostExperts) -> None:
        """The group size and the bf16 form of the group being computed (int8 values are exact in bf16; 4-bit
        copies are scaled into it)."""
        self.group = min(GROUP, copies.held)  # experts per copy (fewer where a layer holds fewer)
        h, i = copies.hidden, copies.intermediate
        self._gate_up = torch.empty(self.group, 2 * i, h, dtype=torch.bfloat16, device=self.device)
        self._down = torch.empty(self.group, h, i, dtype=torch.bfloat16, device=self.device)

    def _build_ring(self, host: HostExperts) -> None:
        cuda = self.device.type == "cuda"
        for _ in range(RING):
            tensors = tuple(torch.empty((self.group, *t.shape[1:]), dtype=t.dtype, device=self.device)
                            for t in host.tensors())
            self._ring.append(_Slot(tensors, torch.cuda.Event() if cuda else None,
                                    torch.cuda.Event() if cuda else None))

    def _measure_copy(self, host: HostExperts) -> float:
        """Host-to-GPU bytes per second of one group's copy (the second of two; the first warms up)."""
        if self.device.type != "cuda":
            return float("inf")
        slot = self._ring[0]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._copy_stream):
            for timed in (False, True):
                if timed:
                    start.record()
                for dst, src in zip(slot.tensors, host.tensors()):
                    dst.copy_(src[:self.group], non_blocking=True)
            end.record()
        end.synchronize()
        group_bytes = sum(t[:self.group].numel() * t.element_size() for t in host.tensors())
        rate = group_bytes / (start.elapsed_time(end) / 1e3)
        log.info("streamed experts: host-to-GPU copies run at %.1f GB/s on %s", rate / 1e9, self.device)
        return rate

    def split(self, layer: int, tokens: int, top_k: int, num_experts: int, cpu_bytes: int,
              method: str = "AMXINT8") -> int:
        """Experts [0, n) of `layer` (of its `num_experts`) the GPU takes for a chunk of `tokens`: the balance
        of `split_experts`, at most the experts the layer holds copies of."""
        host = self.layers.get(layer)
        if host is None or not host.held:
            return 0
        gpu_bytes = (host.gate_up.nbytes + host.down.nbytes) // host.held * num_experts
        n = split_experts(tokens, top_k, num_experts, cpu_bytes, gpu_bytes, self.pcie_bytes_per_s, method)
        return min(n, self.held(layer))

    # ------------------------------------------------------------------------------------------ compute
    @torch.no_grad()
    def compute(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                experts: int, limit: float = 0.0) -> torch.Tensor:
        """sum over the routed experts below `experts` of weight * expert(hidden), float32 [T, H] on the device;
        queued on the current stream (one host sync: the per-expert token counts). With `limit` (V4's
        swiglu_limit), gate is clamped from above and up to [-limit, limit] before the activation, as kt-kernel's
        MXFP4 and FP8 kernels and transformers' DeepseekV4Experts do."""
        tokens, top_k = topk_ids.shape
        if experts > self.held(layer):
            raise ValueError(f"streamed experts of layer {layer}: {experts} asked for, copies of "
                             f"{self.held(layer)} held")
        flat = topk_ids.reshape(-1).to(self.device)
        key = torch.where((flat >= 0) & (flat < experts), flat, experts)  # the CPU's share sorts last
        order = key.argsort(stable=True)
        counts = torch.bincount(key, minlength=experts + 1)[:experts].tolist()
        taken = sum(counts)
        order = order[:taken]
        token = order // top_k
        x = torch.zeros(taken + ROW_ALIGN, hidden.shape[1], dtype=torch.bfloat16, device=self.device)
        torch.index_select(hidden.to(self.device, torch.bfloat16), 0, token, out=x[:taken])
        y = torch.empty(taken + ROW_ALIGN, hidden.shape[1], dtype=torch.bfloat16, device=self.device)
        out = torch.zeros(tokens, hidden.shape[1], dtype=torch.float32, device=self.device)
        if taken == 0:
            return out
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        mxfp4 = self.layers[layer].mxfp4
        # experts [0, resident) are read where they lie; the others come through the ring, in groups numbered
        # within the layer's host copies
        resident = min(self.resident_experts(layer), experts)
        starts = range(resident, experts, self.group)
        plan = [(layer, s - resident, min(self.group, experts - s)) for s in starts]
        following = min((k for k in self.layers if k > layer), default=None)
        if following is not None:  # the next layer most likely takes the same share of the next chunk-layer
            plan += [(following, s, n) for _, s, n in plan[:RING] if s + n <= self.layers[following].held]
        self._keep_prefetched(plan)
        filled = len(self._queue)
        while filled < len(plan) and len(self._queue) < RING:  # in flight while the resident experts compute
            self._fill(plan[filled])
            filled += 1
        offset = 0
        for start in range(0, resident, self.group):
            n = min(self.group, resident - start)
            group = tuple(t[start:start + n] for t in self.resident[layer].tensors())
            offset = self._compute_group(group, counts[start:start + n], x, y, offset, limit, mxfp4)
        for start, n in ((s, n) for _, s, n in plan[:len(starts)]):
            while filled < len(plan) and len(self._queue) < RING:
                self._fill(plan[filled])
                filled += 1
            slot = self._queue.popleft()
            if stream is not None:
                stream.wait_event(slot.ready)
            first = resident + start
            offset = self._compute_group(slot.tensors, counts[first:first + n], x, y, offset, limit, mxfp4)
            if stream is not None:
                slot.free.record(stream)
        while filled < len(plan) and len(self._queue) < RING:  # prefetch the next layer's first groups
            self._fill(plan[filled])
            filled += 1
        weights = topk_weights.reshape(-1).to(self.device, torch.float32)[order]
        out.index_add_(0, token, y[:taken].float() * weights.unsqueeze(1))
        self.stats.chunks += 1
        self.stats.experts += experts
        return out

    def _compute_group(self, tensors: tuple[torch.Tensor, ...], counts: list[int], x: torch.Tensor,
                       y: torch.Tensor, offset: int, limit: float = 0.0, mxfp4: bool = False) -> int:
        """The experts of `tensors` (as HostExperts.tensors(), on the device: a ring slot or resident copies)
        over their rows of the sorted tokens `x`, into `y`, from row `offset` on (the experts in order, each over
        its rows rounded up to ROW_ALIGN), SwiGLU inputs clamped at `limit` (0: not); the offset after them.
        `mxfp4`: the tensors are MXFP4 weights (HostExperts.mxfp4), dequantized on the device: a group in one kernel
        a matrix on a GPU with Triton, else an expert at a time by torch."""
        gate_up_q, gate_up_s, down_q, down_s = tensors
        n = len(counts)
        gate_up, down = self._gate_up[:n], self._down[:n]
        hidden, inter = down.shape[1], down.shape[2]
        int8 = gate_up_q.dtype == torch.int8  # exact in bf16, its row scales multiply the products
        unpack = None if int8 else self._unpack_mxfp4 if mxfp4 else self._unpack_int4
        per_expert = not int8 and unpack is None
        if int8:
            gate_up.copy_(gate_up_q[:n])
            down.copy_(down_q[:n])
            gate_up_s, down_s = gate_up_s[:n].to(torch.bfloat16), down_s[:n].to(torch.bfloat16)
        elif not per_expert:
            unpack(gate_up, gate_up_q[:n], gate_up_s[:n])
            unpack(down, down_q[:n], down_s[:n])
        for j, count in enumerate(counts):
            if count == 0:
                continue
            if per_expert and mxfp4:
                gate_up[j].copy_(mxfp4_format.dequantize(gate_up_q[j], gate_up_s[j]))
                down[j].copy_(mxfp4_format.dequantize(down_q[j], down_s[j]))
            elif per_expert:
                gate_up[j].copy_(dequantize_int4(gate_up_q[j], gate_up_s[j], hidden))
                down[j].copy_(dequantize_int4(down_q[j], down_s[j], inter))
            rows = slice(offset, offset + -(-count // ROW_ALIGN) * ROW_ALIGN)
            h = x[rows] @ gate_up[j].T
            if int8:
                h *= gate_up_s[j]
            gate, up = h[:, :inter], h[:, inter:]
            if limit:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            act = F.silu(gate) * up
            if int8:
                torch.mul(act @ down[j].T, down_s[j], out=y[rows])
            else:
                torch.matmul(act, down[j].T, out=y[rows])
            offset += count
        return offset

    # ------------------------------------------------------------------------------------------ the ring
    def _keep_prefetched(self, plan: list[tuple[int, int, int]]) -> None:
        """Keep the slots already filled when they are the start of `plan`, else drop them all (their data is
        simply overwritten later: each slot's next copy waits for its last use)."""
        if [slot.tag for slot in self._queue] != plan[:len(self._queue)]:
            self._queue.clear()

    def _fill(self, tag: tuple[int, int, int]) -> None:
        """Queue the copy of `tag`'s experts into the next ring slot, after that slot's last computation."""
        layer, start, n = tag
        slot = self._ring[self._next]
        self._next = (self._next + 1) % RING
        host = self.layers[layer]
        if self._copy_stream is None:
            for dst, src in zip(slot.tensors, host.tensors()):
                dst[:n].copy_(src[start:start + n])
        else:
            self._copy_stream.wait_event(slot.free)
            with torch.cuda.stream(self._copy_stream):
                for dst, src in zip(slot.tensors, host.tensors()):
                    dst[:n].copy_(src[start:start + n], non_blocking=True)
            slot.ready.record(self._copy_stream)
        slot.tag = tag
        self.stats.bytes += sum(t[start:start + n].numel() * t.element_size() for t in host.tensors())
        self._queue.append(slot)


class ExpertStreamers:
    """One model's streamers, one per GPU its expert layers send output to (OperatorOptions.streamers)."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, ExpertStreamer] = {}

    def for_device(self, device: torch.device) -> ExpertStreamer:
        found = self._by_device.get(device)
        if found is None:
            found = self._by_device[device] = ExpertStreamer(device)
        return found

    def active(self) -> list[ExpertStreamer]:
        """The streamers some layer registered with (none where no expert layer sends output to a GPU)."""
        return [s for s in self._by_device.values() if s.layers]

    def warm_up_reads(self) -> None:
        """Compile the kernels that read copies in place in decode steps (engines/kt/experts/mapped.py), wherever a
        layer registered some, before a request waits for them."""
        for streamer in self.active():
            if streamer.mapped is not None:
                streamer.mapped.warm_up()
