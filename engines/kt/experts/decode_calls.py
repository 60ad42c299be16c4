"""Which calls of a CPU-expert layer our decode kernel computes instead of kt-kernel (`kt_decode_kernel`).

Decode calls (a few rows) read each chosen expert once; our kernel (engines/kt/experts/decode_kernel/) streams the
weights at the memory's rate where kt-kernel's classes do not (bench/results/nvidia-h200-2026-12-02-decode-kernel:
14 threads, one layer call, ours against kt-kernel's at 1 / 16 tokens: MXFP4 1.48 / 18.0 ms against 2.20 / 46.8,
INT8 0.57 / 5.15 against 0.93 / 7.26, INT4 0.52 / 4.47 against 0.75 / 5.16, FP8 6.15 / 46.6 against 6.13 / 57.3).
Those are the kernel's float dot products; MXFP4 and INT4 have since taken theirs on int8-rounded activations where
the CPU has AVX512-VNNI, AVX-VNNI or AVX2 (the decode kernel's docstring), not yet measured on that host.
The choice is made here, in one place, once per layer at load (`DecodeKernelPolicy.build`), and per call only
from the call's own row count (`DecodeCalls.covers`), so a row's result never depends on other requests' rows
beyond what that count already decides (batch-invariant requests run their chunks alone).

What the kernel takes, and from what (the weights kt-kernel was loaded from, at load time):
- MXFP4: the released E2M1 bytes and UE8M0 exponents, the very tensors kt-kernel was handed (kept alive: kt-kernel's
  own classes copy theirs); converted layers recover the exponents from kt-kernel's bf16 multipliers (exact);
- FP8: the e4m3 blocks and their float multipliers kt-kernel was handed;
- RAWINT4: its int4 groups of 32 with bf16 scales, the kernel's own INT4 form, as they are;
- AMXINT8 / AMXINT4: quantized from the same bf16 weights, the kernel's way (INT8 per row; INT4 per 32 with bf16
  scales, finer than kt-kernel's per-row INT4);
- LLAMAFILE: ggml blocks whose gate, up and down are each of a type the kernel reads (decode_kernel.GGML_FORMATS:
  Q8_0, Q4_0, Q4_K or Q6_K; gate and up of one type, down of its own, as a "Q4_K_M" file's Q4_K gate/up and Q6_K
  down), the very blocks kt-kernel reads (a GGUF's mapped file, or those converted at load for llamafile_type
  Q8_0); other ggml types (Q5_K, ..., BF16), gate and up of two types, and Q4_K / Q6_K rows not a multiple of 256
  values (which ggml never writes) stay kt-kernel's, the reason recorded. kt-kernel's llamafile
  calls are not stream-ordered (cpu.py: `_can_use_stream`), so the kernel serves these layers' decode calls where
  the hidden states are on the CPU (the CPU-only rules);
- BF16: not covered (kt-kernel serves).
Layers whose output goes to a GPU queue the kernel on the CUDA stream as kt-kernel's calls are queued (cpu.py's
stream-ordered path: decode_kernel/streams.py's `StreamTask`, a doorbell and a done cell in pinned host memory or
two host functions, which captured decode graphs replay); the share of a decode
call's experts the GPU reads from their host copies (kt_gpu_read_experts) reaches the kernel as -1 ids, and prompt
chunks that stream experts stay kt-kernel's. Layers with hot experts, experts the GPU owns (kt-kernel holds the others,
renumbered), deferred experts, and layers loaded from kt-kernel's own files (kt_weight_path, or a kt_weight_cache
written with the kernel off), which leave no weights the kernel reads, stay on kt-kernel; a kt_weight_cache keeps
the kernel's AMXINT8 / AMXINT4 form beside kt-kernel's files, so a load from it serves as the load that wrote it.
Rows of adapters with expert LoRA reach the base kernel as expert-less rows whichever kernel serves
(engines/lora/cpu_experts.py).
"""
from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from engines.kt.experts.cpuinfer import IDLE_SPIN_NICE, pool_threads, yield_idle_spin
from engines.kt.experts.methods import memory_available

if TYPE_CHECKING:
    from engines.kt.experts.cpu import RoutedExpertsCPU
    from engines.kt.experts.decode_kernel import DecodeLayer, DecodePool

log = logging.getLogger("ktserve.engine.kt")

SETTING = "kt_decode_kernel"
CHOICES = ("auto", "on", "off")
# the kernel's format per experts method (LLAMAFILE: per ggml type of its blocks, `kernel_format`)
FORMATS = {"MXFP4": "mxfp4", "FP8": "fp8", "RAWINT4": "int4", "AMXINT8": "int8", "AMXINT4": "int4"}
# calls of up to this many rows go to the kernel: it was at least as fast as kt-kernel at every count measured.
# MXFP4, INT8 and INT4 up to 128 rows (H200 machine's host, 14 threads, AMX build; python -m bench.decode_kernel
# --formats mxfp4,int8,int4 --threads 14 --tokens 1,16,32,64,128, bench/results/nvidia-h200-2026-12-02-decode-rows:
# ms a call at 16 / 32 / 64 / 128 tokens, MXFP4 11.2 / 22.6 / 36.7 / 53.6 against AMXFP4_KGroup_MOE's
# 47.3 / 101 / 178 / 318, INT8 5.5 / 7.9 / 11.8 / 21.8 against AMXInt8_MOE's 8.6 / 11.7 / 23.4 / 62.1, INT4
# 2.9 / 3.9 / 6.0 / 11.1 against AMXInt4_MOE's 5.3 / 7.7 / 14.6 / 30.1), so a V4 prompt's tail under the streaming
# threshold and a step of many decoding clients stay on the kernel too; kt-kernel's matrix kernels take the
# prompt chunks beyond. FP8 and the ggml formats were measured up to 16 only (q8_0 and q4_0 against kt-kernel's
# LLAMAFILE on the same blocks: 64 experts, top-6, 2048 x 1536,
# one thread, on a 2-core box under load 3, so only the order of things: at 1 / 4 / 16 tokens Q8_0 10.5 / 19.8 / 47.1
# ms a layer against 22.9 / 72.9 / 85.4, Q4_0 4.1 / 12.6 / 36.3 against 5.6 / 22.0 / 48.9)
# (q4_k and q6_k on the integer path, avx512-vnni, against kt-kernel's LLAMAFILE on the same blocks, that box under
# load 1.0: python -m bench.decode_kernel --formats q4_k,q6_k,q4_k_m --threads 1 --tokens 1,4,16 --layers 2
# --budget 0.2, 64 experts, top-6, 2048 x 1536, at 1 / 4 / 16 tokens Q4_K 7.2 / 15.1 / 43.7 ms against
# 7.7 / 23.6 / 54.2, Q6_K 6.6 / 26.6 / 67.7 against 7.2 / 26.7 / 68.4 (both at the box's read rate, a tie but for
# one token), Q4_K gate/up + Q6_K down 5.0 / 19.6 / 55.7 against 6.9 / 25.5 / 58.8; on their float path, the same
# run's way, they had been 15.2 / 49.7 / 117, 19.7 / 66.9 / 179 and 19.0 / 62.9 / 163; AVX2 hosts not measured)
# methods whose weights the kernel quantizes its own way from the bf16 weights (kt-kernel's files hold another form)
OWN_FORM_METHODS = ("AMXINT8", "AMXINT4")
MAX_ROWS = {"mxfp4": 128, "fp8": 16, "int8": 128, "int4": 128, "q8_0": 16, "q4_0": 16, "q4_k": 16, "q6_k": 16}
MEMORY_SHARE = 0.3  # of the host memory available at the first layer's load, what auto lets the kernel's copies take
# The formats auto serves where a layer's output is on a GPU: those measured faster served there. MXFP4 (V4-Flash's
# shape, 4 layers, H200 machine, 2026-12-03, bench/results/nvidia-h200-2026-12-03-two-pass: batch-1 TPOT 8.17 ms
# against 8.15 with kt-kernel and the GPU reading 144 of 256 experts, 1-32 clients 1.2-1.7x, a cached prefix's TTFT
# half), whose kernel reads the streamer's pinned copy of the released bytes. INT4 (V2-Lite's shape, AMXINT4, H200
# machine, 2026-12-03, bench/results/nvidia-h200-2026-12-03-v2-lite-peers, one call: batch-1 decode 73.4 tok/s
# with the kernel reading every expert against 58.3 with kt-kernel and the GPU reading its 32 of 64; the kernel's
# per-32 INT4 copy, 0.5625 bytes a weight, beside kt-kernel's). INT8 once streams signalled the kernel through host
# memory (V2-Lite's shape, AMXINT8, H200 machine, 2026-12-04, bench/results/nvidia-h200-2026-12-04-stream-signals,
# one call: 49.7 tok/s with the kernel reading every expert against 41.2 with kt-kernel and the GPU's 32 of 64, for a
# second copy of the experts, 13.4 GiB at V2-Lite's size, within MEMORY_SHARE; with host functions it had been a
# tie, 40.1 against 40.0). FP8 (not measured served) keeps kt-kernel with the GPU reading its measured share.
AUTO_ON_GPU = frozenset({"mxfp4", "int4", "int8"})


def check_setting(value: Any) -> str:
    """The setting as one of CHOICES; ValueError naming the key otherwise."""
    text = str(value).strip().lower() if value is not None else ""
    if text not in CHOICES:
        raise ValueError(f"{SETTING} must be one of {', '.join(CHOICES)}, got {value!r}")
    return text


def kernel_format(layer: "RoutedExpertsCPU") -> str | None:
    """The kernel's format for `layer`'s experts as loaded, or None where it has none: LLAMAFILE layers by their
    blocks' ggml types (gate and up of one type decode_kernel.GGML_FORMATS names, down of one too), as
    "q4_k/q6_k" (gate/up's, down's) where down's differs."""
    if layer.method != "LLAMAFILE":
        return FORMATS.get(layer.method)
    from engines.kt.experts.decode_kernel import GGML_FORMATS

    gate, up, down = layer.ggml_types
    if gate != up or gate not in GGML_FORMATS or down not in GGML_FORMATS:
        return None
    fmt, down_fmt = GGML_FORMATS[gate], GGML_FORMATS[down]
    return fmt if fmt == down_fmt else f"{fmt}/{down_fmt}"


def _max_rows(fmt: str) -> int:
    """MAX_ROWS of a kernel format, the lesser of gate/up's and down's for a layer of two."""
    return min(MAX_ROWS[f] for f in fmt.split("/"))


def _ggml_types_text(layer: "RoutedExpertsCPU") -> str:
    """A served LLAMAFILE layer's ggml types (gate's and up's are one): "Q8_0", or "Q4_K gate/up, Q6_K down"."""
    gate, _, down = layer.ggml_types
    return gate if gate == down else f"{gate} gate/up, {down} down"


def _served_as(layer: "RoutedExpertsCPU") -> str:
    """What the details call a served layer's experts: the method (LLAMAFILE with its blocks' types)."""
    return f"LLAMAFILE {_ggml_types_text(layer)}" if layer.method == "LLAMAFILE" else layer.method


def kt_worker_cpus() -> list[int] | None:
    """The CPUs kt-kernel's workers are pinned to (one each; it names them numa_<node>_...), or None."""
    cpus: set[int] = set()
    try:
        tasks = list(os.scandir(f"/proc/{os.getpid()}/task"))
    except OSError:
        return None
    for entry in tasks:
        try:
            with open(f"{entry.path}/comm") as f:
                name = f.read().strip()
            allowed = os.sched_getaffinity(int(entry.name))
        except OSError:
            continue
        if name.startswith("numa_") and len(allowed) == 1:
            cpus |= allowed
    return sorted(cpus) or None


@dataclass(slots=True)
class DecodeCalls:
    """One layer's experts as the decode kernel reads them, and the calls it takes: at most `max_rows` rows."""

    kernel: "DecodeLayer"
    pool: "DecodePool"
    max_rows: int
    extra_bytes: int  # host memory its weights take beside kt-kernel's
    own_form: bool = False  # weights in the kernel's own INT8 / INT4 form (a weight cache keeps them too)

    def covers(self, tokens: int) -> bool:
        return 0 < tokens <= self.max_rows

    def submit(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Start the call on the kernel's pool; returns what must stay alive until `wait`, the output [T, H]
        (float32) last."""
        out = torch.empty(hidden.shape[0], self.kernel.hidden, dtype=torch.float32)
        return self.kernel.submit(hidden, ids, weights, self.pool, out)

    def wait(self) -> None:
        self.pool.wait()

    def stream_task(self, tokens: torch.Tensor, top_k: int, x: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor, out: torch.Tensor) -> Any:
        """A call over fixed pinned buffers, started and awaited from a CUDA stream (decode_kernel.StreamTask):
        the row count read from the int32 cell `tokens` when the stream reaches it."""
        return self.kernel.task(self.pool, tokens, top_k, x, ids, weights, out)

    def describe(self) -> str:
        from engines.kt.experts import decode_kernel

        return f"ktserve {decode_kernel.isa()} for calls <= {self.max_rows} rows"


@dataclass(slots=True)
class DecodeKernelPolicy:
    """`kt_decode_kernel` for one model's layers (OperatorOptions.decode_kernel): auto, on or off, the memory the
    kernel's copies have taken so far, and what each layer got (for the engine details)."""

    setting: str = "off"
    budget: int | None = None  # bytes auto lets the copies take (MEMORY_SHARE of the memory available at first use)
    charged: int = 0
    outcomes: dict[int, str] = field(default_factory=dict)  # layer -> "MXFP4" (served) or why not
    formats: dict[int, str] = field(default_factory=dict)  # the served layers -> the kernel's format
    layers: list = field(default_factory=list)  # weak references to the layers built, for `finish`
    niced: int = 0  # kt-kernel's workers given the lowest priority at `finish` (cpuinfer.yield_idle_spin)

    def __post_init__(self) -> None:
        self.setting = check_setting(self.setting)

    def build(self, layer: "RoutedExpertsCPU", *, floats: tuple[torch.Tensor, ...] | None = None,
              prepared: dict[str, Any] | None = None, packed: dict[str, torch.Tensor] | None = None,
              quantized: Callable[[], dict[str, torch.Tensor] | None] | None = None) -> DecodeCalls | None:
        """The decode calls of `layer`, from the forms it was just loaded from (`quantized`: reads the kernel's own
        INT8 / INT4 form as a weight cache kept it, called only where the kernel takes the layer), or None (the reason
        recorded)."""
        self.layers.append(weakref.ref(layer))
        self.formats.pop(layer.layer_idx, None)
        why = self._structural_reason(layer)
        fmt = kernel_format(layer)
        kernel = None
        if why is None:
            kernel = _kernel_layer(layer, fmt, floats=floats, prepared=prepared, packed=packed, quantized=quantized)
            if kernel is None:
                why = f"layer loaded from kt-kernel's own files: no {layer.method} weights for the kernel"
        if why is None:
            extra = _extra_bytes(kernel, layer)
            why = self._charge(extra)
        if why is not None:
            self.outcomes[layer.layer_idx] = why
            if self.setting == "on":
                log.info("layer %d: %s=on, but kt-kernel serves its decode calls: %s", layer.layer_idx, SETTING, why)
            return None
        from engines.kt.experts import decode_kernel

        pool = decode_kernel.shared_pool(pool_threads() or layer.threads or 1, kt_worker_cpus())
        if _gpu_output(layer):  # how its streams will start the calls, asked now: never first inside a capture
            from engines.kt.experts.decode_kernel.streams import signals

            signals(layer.out_device)
        self.outcomes[layer.layer_idx] = _served_as(layer)
        self.formats[layer.layer_idx] = fmt
        return DecodeCalls(kernel, pool, _max_rows(fmt), extra, own_form=layer.method in OWN_FORM_METHODS)

    def _structural_reason(self, layer: "RoutedExpertsCPU") -> str | None:
        if self.setting == "off":
            return f"{SETTING}=off"
        from engines.kt.experts import decode_kernel

        missing = decode_kernel.unavailable_reason()
        if missing is not None:
            if self.setting == "on":
                raise ValueError(f"{SETTING}=on: {missing}")
            return missing
        fmt = kernel_format(layer)
        if fmt is None:
            if layer.method == "LLAMAFILE":
                from engines.kt.experts.decode_kernel import GGML_FORMATS

                known = ", ".join(GGML_FORMATS)
                gate, up, down = layer.ggml_types
                other = sorted({t for t in (gate, up, down) if t not in GGML_FORMATS})
                if other:
                    return (f"the kernel does not compute LLAMAFILE experts of ggml type {'/'.join(other)} (it reads "
                            f"{known} blocks)")
                return (f"the LLAMAFILE experts' gate and up are of two ggml types ({gate}, {up}); the kernel reads "
                        "one for both")
            return f"the kernel does not compute {layer.method} experts"
        if layer.hidden_size % 32 or layer.intermediate_size % 32:
            return "sizes not multiples of 32"
        from engines.kt.experts.decode_kernel import block_values

        gate_up_fmt, down_fmt = fmt.split("/")[0], fmt.split("/")[-1]
        for what, size, f in (("hidden", layer.hidden_size, gate_up_fmt),
                              ("intermediate", layer.intermediate_size, down_fmt)):
            if size % block_values(f):  # ggml's super-blocks are 256 wide: no file holds such rows
                return (f"{f.upper()} rows of {size} values ({what} size) are not whole blocks of "
                        f"{block_values(f)}; the kernel refuses them")
        out = layer.out_device
        if self.setting == "auto" and out is not None and out.type == "cuda" and fmt not in AUTO_ON_GPU:
            return (f"auto leaves {fmt.upper()} layers whose output is on a GPU to kt-kernel (the kernel's gain there "
                    f"was measured for {', '.join(sorted(f.upper() for f in AUTO_ON_GPU))}; {SETTING}=on takes "
                    "these too)")
        # a layer whose output is on a GPU queues the kernel on the CUDA stream (cpu.py: the stream-ordered
        # path); where the GPU reads a share of each decode call's experts from their host copies, the kernel
        # skips that share as kt-kernel does (its ids -1), and prompt chunks that stream experts are kt-kernel's
        return ("hot experts are kept (gpu_experts)" if layer.gpu_experts else
                "the GPU owns some of the experts (kt-kernel holds the others, renumbered)" if layer.owned else
                "experts are deferred (n_deferred_experts)" if layer.deferred else None)

    def _charge(self, extra: int) -> str | None:
        if self.setting == "auto" and extra:
            if self.budget is None:
                available = memory_available()
                self.budget = int(MEMORY_SHARE * available) if available is not None else 0
            if self.charged + extra > self.budget:
                return (f"its copy ({extra / 2**20:.0f} MiB) would take the kernel's copies past {MEMORY_SHARE} of "
                        f"the host memory available at load ({self.budget / 2**30:.1f} GiB)")
        self.charged += extra
        return None

    def finish(self) -> dict[str, str]:
        """Once the model is loaded: under auto, the kernel serves every CPU-expert layer or none (a step that
        mixes the two kernels runs ours on cores where kt-kernel's idle workers still spin, ~50 ms after their last
        task: bench/results/nvidia-h200-2026-12-02-decode-kernel-served); returns what the engine details say."""
        layers = [layer for ref in self.layers if (layer := ref()) is not None]
        served = [layer for layer in layers if layer.decode_calls is not None]
        if self.setting == "auto" and served and len(served) < len(layers):
            others = sorted({self.outcomes[layer.layer_idx] for layer in layers if layer.decode_calls is None})
            why = (f"kt-kernel serves {len(layers) - len(served)} of the {len(layers)} layers ({'; '.join(others)}), "
                   "and a step must not mix the two")
            for layer in served:
                layer.decode_calls = None
                self.outcomes[layer.layer_idx] = why
                self.formats.pop(layer.layer_idx, None)
            self.charged = 0
            log.info("%s=auto: off, %s", SETTING, why)
        if any(layer.decode_calls is not None for layer in layers):
            self.niced = yield_idle_spin()
        return self.details()

    def details(self) -> dict[str, str]:
        """What the engine details say: which layers' decode calls the kernel computes, or why none."""
        if not self.outcomes:
            return {}
        served = sorted(self.formats)
        if not served:
            reasons = sorted(set(self.outcomes.values()))
            return {"decode_kernel": f"off ({'; '.join(reasons)}): kt-kernel serves every call"}
        from engines.kt.experts import decode_kernel

        methods = sorted({self.outcomes[layer] for layer in served})
        rows = max(_max_rows(self.formats[layer]) for layer in served)
        text = f"ktserve {decode_kernel.isa()} for calls <= {rows} rows ({', '.join(methods)})"
        others = len(self.outcomes) - len(served)
        if others:
            reasons = sorted({what for layer, what in self.outcomes.items() if layer not in self.formats})
            text += f"; kt-kernel in {others} of {len(self.outcomes)} layers ({'; '.join(reasons)})"
        if self.charged:
            text += f"; {self.charged / 2**30:.2f} GiB of host memory beside kt-kernel's"
        if self.niced:
            workers = f"{self.niced} worker" + ("s" if self.niced != 1 else "")
            text += f"; kt-kernel's {workers} at nice {IDLE_SPIN_NICE}, their idle spin yielding to it"
        gpu = next((layer.out_device for ref in self.layers if (layer := ref()) is not None
                    and layer.layer_idx in self.formats and _gpu_output(layer)), None)
        if gpu is not None:
            from engines.kt.experts.decode_kernel.streams import signals

            text += f"; CUDA streams start and await its calls through {signals(gpu)}"
        return {"decode_kernel": text}


def _gpu_output(layer: "RoutedExpertsCPU") -> bool:
    return layer.out_device is not None and layer.out_device.type == "cuda"


def _kernel_layer(layer: "RoutedExpertsCPU", fmt: str, *, floats: tuple[torch.Tensor, ...] | None,
                  prepared: dict[str, Any] | None, packed: dict[str, torch.Tensor] | None,
                  quantized: Callable[[], dict[str, torch.Tensor] | None] | None = None) -> "DecodeLayer | None":
    from engines.kt.experts.decode_kernel import DecodeLayer

    limit = layer.swiglu_limit
    kept = quantized() if layer.method in OWN_FORM_METHODS and quantized is not None else None
    if kept is not None:  # the kernel's form, from a weight cache
        return DecodeLayer(fmt, layer.hidden_size, layer.intermediate_size, kept, swiglu_limit=limit)
    if fmt == "mxfp4" and packed is not None:  # each expert's block as it lies (a streamer's copy: views)
        return DecodeLayer.mxfp4({k: v if v[0].is_contiguous() else v.contiguous() for k, v in packed.items()},
                                 swiglu_limit=limit)
    if fmt == "mxfp4" and prepared is not None and "gate_scale" in prepared:  # converted: bf16 powers of two
        return DecodeLayer.mxfp4({k: (_ue8m0_of(v) if k.endswith("_scale") else v) for k, v in prepared.items()},
                                 swiglu_limit=limit)
    if fmt == "fp8" and prepared is not None and "gate_scale" in prepared:
        return DecodeLayer.fp8(prepared, swiglu_limit=limit)
    if layer.method == "RAWINT4" and prepared is not None and "gate_scale" in prepared:
        tensors = {k: v.contiguous() for k, v in prepared.items()}
        return DecodeLayer("int4", layer.hidden_size, layer.intermediate_size, tensors, swiglu_limit=limit)
    if fmt in ("int8", "int4") and floats is not None:
        return DecodeLayer.quantize(fmt, *floats, swiglu_limit=limit)
    if layer.method == "LLAMAFILE" and prepared is not None:  # the blocks kt-kernel reads, read in place too
        return DecodeLayer.ggml({m: prepared[m] for m in ("gate", "up", "down")}, tuple(layer.ggml_types),
                                swiglu_limit=limit)
    return None


def _ue8m0_of(scales: torch.Tensor) -> torch.Tensor:
    """bf16 powers of two (mxfp4.scales_as_bf16) -> their UE8M0 exponent codes, exactly (code 0 is a bf16
    subnormal whose exponent field reads 0 too)."""
    bits = scales.contiguous().view(torch.int16).to(torch.int32)
    return ((bits >> 7) & 0xFF).to(torch.uint8).contiguous()


def _extra_bytes(kernel: "DecodeLayer", layer: "RoutedExpertsCPU") -> int:
    """Bytes of the kernel's tensors that kt-kernel does not hold as well (those it reads in place)."""
    shared = {t.untyped_storage().data_ptr() for t in layer._kernel_weights if isinstance(t, torch.Tensor)}
    streamer = layer.streamer
    host = streamer.layers.get(layer.layer_idx) if streamer is not None else None
    if host is not None:  # the GPU side's copies, which the kernel may read too (cpu.py: load_packed)
        shared |= {t.untyped_storage().data_ptr() for t in host.tensors()}
    return sum(t.nbytes for t in kernel.tensors.values() if t.untyped_storage().data_ptr() not in shared)
