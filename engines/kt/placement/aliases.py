"""How rule files written for KTransformers / LLaMA-Factory map onto our operators.

KTransformers rule files name their own operator classes (``ktransformers.operators...``), their own
modeling classes (``ktransformers.models.modeling_deepseek...``) and their own kwargs
(``generate_device``, ``backend: AMXInt8`` ...). We do not install KTransformers; instead every such
name is translated here, in one place, so a user's existing rule file loads unchanged or fails with a
message naming the rule and the key we cannot honour.

The three tables:

- ``CLASS_ALIASES``: ``replace.class`` values -> ``default`` or one of our operators.
- ``MATCH_CLASS_ALIASES``: ``match.class`` values -> the transformers classes they stand for.
- ``KWARG_ALIASES``: ``replace.kwargs`` keys -> what we do with them (plus ``OPS`` and ``BACKENDS``
  for the values of ``generate_op``/``prefill_op`` and ``backend``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT = "default"
MLA_ATTENTION = "engines.kt.placement.operators.MLAAttention"
INDEXED_MLA_ATTENTION = "engines.kt.placement.operators.IndexedMLAAttention"
MOE_WITH_CPU_EXPERTS = "engines.kt.placement.operators.MoEWithCPUExperts"
ROUTED_EXPERTS_CPU = "engines.kt.placement.operators.RoutedExpertsCPU"
OPERATORS = frozenset({MLA_ATTENTION, INDEXED_MLA_ATTENTION, MOE_WITH_CPU_EXPERTS, ROUTED_EXPERTS_CPU})
EXPERT_OPERATORS = frozenset({MOE_WITH_CPU_EXPERTS, ROUTED_EXPERTS_CPU})
# operators a family implements, by the name rule files give them -> where the class lives (the others live in
# engines/kt/placement/operators.py, as named): placement imports no family
OPERATOR_CLASSES = {MLA_ATTENTION: "engines.kt.families.deepseek_mla.attention.MLAAttention",
                    INDEXED_MLA_ATTENTION: "engines.kt.families.deepseek_v32.attention.IndexedMLAAttention"}

# kt-kernel weight formats, as our operators spell them.
METHODS = frozenset({"AMXINT8", "AMXINT4", "BF16", "LLAMAFILE", "FP8", "MXFP4"})


@dataclass(frozen=True, slots=True)
class Alias:
    """One row of an alias table: what a KTransformers name becomes here, and why."""

    target: str
    why: str


_EXPERTS = "ktransformers.operators.experts."
_ROPE = "ktransformers.operators.RoPE."

CLASS_ALIASES: dict[str, Alias] = {
    _EXPERTS + "KTransformersExperts": Alias(
        ROUTED_EXPERTS_CPU, "routed experts in kt-kernel on the CPU, output to `device` (out_device); below a "
                            "KDeepseek*MoE rule its kwargs fold into that MoEWithCPUExperts"),
    _EXPERTS + "KTransformersExpertsV2": Alias(
        ROUTED_EXPERTS_CPU, "the balance-serve variant of KTransformersExperts; same placement"),
    _EXPERTS + "KDeepseekV2MoE": Alias(
        MOE_WITH_CPU_EXPERTS, "whole MoE block: router + shared experts on `device`, routed experts on the CPU"),
    _EXPERTS + "KDeepseekV3MoE": Alias(MOE_WITH_CPU_EXPERTS, "as KDeepseekV2MoE, with V3's grouped routing"),
    _EXPERTS + "KDeepseekV3MoEV2": Alias(MOE_WITH_CPU_EXPERTS, "the balance-serve variant of KDeepseekV3MoE"),
    _EXPERTS + "DeepseekV2MoEInjected": Alias(MOE_WITH_CPU_EXPERTS, "the first-generation name of KDeepseekV2MoE"),
    _EXPERTS + "KTransformersMLPExpert": Alias(
        ROUTED_EXPERTS_CPU, "the first-generation name of KTransformersExperts (ops as prefill/generate_mlp_type)"),
    "ktransformers.operators.attention.KDeepseekV2Attention": Alias(
        MLA_ATTENTION, "MLA with the compressed latent KV cache on `device`"),
    "ktransformers.operators.attention.KDeepseekV3Attention": Alias(
        MLA_ATTENTION, "KTransformers' V3 multi-GPU files name MLA this way; same operator"),
    "ktransformers.operators.attention.DeepseekV2AttentionInjected": Alias(
        MLA_ATTENTION, "the first-generation name of KDeepseekV2Attention"),
    "ktransformers.operators.balance_serve_attention.flashinfer_attn": Alias(
        MLA_ATTENTION, "the -serve files' batched MLA over a paged cache: our MLAAttention over the paged latent "
                       "cache, with FlashInfer where --attention-backend picks it"),
    "ktransformers.operators.attention.flashinfer_attn": Alias(
        MLA_ATTENTION, "older module path of balance_serve_attention.flashinfer_attn"),
    "ktransformers.operators.linear.KTransformersLinear": Alias(
        DEFAULT, "the torch nn.Linear is kept on `device`; KTransformers' Marlin/FP8 kernels are not used, "
                 "so the weights keep the checkpoint's dtype (more GPU memory than a Marlin INT4 file)"),
    "ktransformers.operators.linear.KTransformerLinear": Alias(
        DEFAULT, "the first-generation name of KTransformersLinear; same treatment"),
    "ktransformers.operators.layernorm.RMSNorm": Alias(
        DEFAULT, "the -serve files' fused RMSNorm: transformers' RMSNorm computes the same on `device`"),
    "ktransformers.operators.mlp.kDeepseekV3MLP": Alias(
        DEFAULT, "the -serve files' dense MLP (batch-size aware for their CUDA graphs): transformers' MLP"),
    "ktransformers.operators.mlp.KDeepseekV3MLP": Alias(DEFAULT, "a later spelling of kDeepseekV3MLP"),
    _ROPE + "YarnRotaryEmbedding": Alias(DEFAULT, "transformers' rotary embedding already implements YaRN"),
    _ROPE + "YarnRotaryEmbeddingV3": Alias(DEFAULT, "as YarnRotaryEmbedding"),
    _ROPE + "RotaryEmbedding": Alias(DEFAULT, "as YarnRotaryEmbedding"),
    _ROPE + "RotaryEmbeddingV3": Alias(DEFAULT, "as YarnRotaryEmbedding"),
    "ktransformers.operators.gate.KMoEGate": Alias(
        DEFAULT, "the router stays the transformers module on `device`; MoE operators call it there"),
    "ktransformers.operators.gate.KMoEGateDeepSeekV3": Alias(DEFAULT, "as KMoEGate"),
    "ktransformers.operators.models.KDeepseekV2Model": Alias(
        DEFAULT, "the transformers model is kept; its `transfer_map` becomes Placement.transfer_map"),
    "ktransformers.operators.layer_wise_prefill.KDeepseekV2Model": Alias(
        DEFAULT, "older module path of the same class (KTransformers' V2 4-GPU file)"),
    "ktransformers.operators.layer_wise_prefill.DeepseekV2ModelPerLayerPrefill": Alias(
        DEFAULT, "first-generation name of the model wrapper; layer-wise prefill is off (threshold 0)"),
    "ktransformers.operators.layer_wise_prefill.DeepseekV2ModelKTransformers": Alias(
        DEFAULT, "first-generation name of the model wrapper"),
}
"""``replace.class`` rows. Anything neither here, nor ``default``, nor in ``OPERATORS`` is a RuleError."""


def _deepseek(role: str) -> tuple[str, ...]:
    return (f"transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2{role}",
            f"transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3{role}")


_MOE = ("transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe",  # sic: "Moe" in V2
        "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE")

# KTransformers loaded V3 checkpoints with its V2 modeling file for a long time, so its own V3 rule
# files match V3 modules by V2 class names. A KTransformers class name therefore names a *role*, and
# matches the transformers class of that role in both generations.
_ROLES: dict[str, tuple[str, ...]] = {
    "DeepseekV2Attention": _deepseek("Attention"),
    "DeepseekV3Attention": _deepseek("Attention"),
    "DeepseekV2MoE": _MOE,
    "DeepseekV3MoE": _MOE,
    "DeepseekV2MLP": _deepseek("MLP"),
    "DeepseekV3MLP": _deepseek("MLP"),
    "MoEGate": _deepseek("TopkRouter"),
    "DeepseekV2RMSNorm": _deepseek("RMSNorm"),
    "DeepseekV3RMSNorm": _deepseek("RMSNorm"),
    "DeepseekV2DecoderLayer": _deepseek("DecoderLayer"),
    "DeepseekV3DecoderLayer": _deepseek("DecoderLayer"),
    "DeepseekV2Model": _deepseek("Model"),
    "DeepseekV3Model": _deepseek("Model"),
    "DeepseekV2ForCausalLM": _deepseek("ForCausalLM"),
    "DeepseekV3ForCausalLM": _deepseek("ForCausalLM"),
    "DeepseekV2RotaryEmbedding": _deepseek("RotaryEmbedding"),
    "DeepseekV3RotaryEmbedding": _deepseek("RotaryEmbedding"),
    "DeepseekV2YarnRotaryEmbedding": _deepseek("RotaryEmbedding"),
    "DeepseekV3YarnRotaryEmbedding": _deepseek("RotaryEmbedding"),
}
_KT_MODELING = ("ktransformers.models.modeling_deepseek", "ktransformers.models.modeling_deepseek_v3",
                "ktransformers.models.modeling_deepseekv3")

MATCH_CLASS_ALIASES: dict[str, tuple[str, ...]] = {
    f"{module}.{name}": classes for module in _KT_MODELING for name, classes in _ROLES.items()
}
"""``match.class`` rows: every KTransformers DeepSeek modeling module (three spellings appear in its rule
files) x every class name it matches on -> the transformers classes of that role (V2 and V3).
Other ``match.class`` values (``torch.nn.Linear``, ``transformers...``) are imported as written."""


@dataclass(frozen=True, slots=True)
class KwargAlias:
    """One KTransformers kwarg: ``kind`` says how it is translated, ``harmless`` the only value we accept
    for a knob we do not implement (``kind == "ignore"``)."""

    kind: str  # device | op | method | transfer_map | ignore (only `harmless` accepted) | reject
    why: str
    harmless: object = None


KWARG_ALIASES: dict[str, KwargAlias] = {
    "generate_device": KwargAlias(
        "device", "our operators run prefill and decode on one device; decode placement decides, so it wins"),
    "prefill_device": KwargAlias("device", "used only when generate_device is absent (a difference is logged)"),
    "out_device": KwargAlias(
        "device", "experts: where their output goes; it wins over generate_device, which for experts names "
                  "where they compute - always the CPU in kt-kernel"),
    "generate_op": KwargAlias("op", "checked against OPS, then dropped: the op follows from the operator"),
    "prefill_op": KwargAlias("op", "as generate_op"),
    "generate_mlp_type": KwargAlias("op", "the first-generation spelling of generate_op"),
    "prefill_mlp_type": KwargAlias("op", "the first-generation spelling of prefill_op"),
    "backend": KwargAlias("method", "kt-kernel weight format, spelled the way our operators spell it"),
    "transfer_map": KwargAlias(
        "transfer_map", "{layer: device} on the model rule; checked against the layer placement the rules give"),
    "per_layer_prefill_intput_threshold": KwargAlias(
        "ignore", "layer-wise prefill; 0 (every shipped KTransformers file) turns it off, which is what we do",
        harmless=0),
    "absorb_for_prefill": KwargAlias(
        "ignore", "False is KTransformers' default; for absorbed MLA use our MLAAttention `absorb` kwarg",
        harmless=False),
    "chunck_size": KwargAlias("reject", "per-operator prefill chunking is not implemented; set chunk_size in the "
                                        "server config"),
}
"""``replace.kwargs`` rows for KTransformers' names. Our own kwargs (``device``, ``method``, ``absorb``,
``gpu_experts``, ``threads``) and the KTransformers names we implement as they are (``n_deferred_experts``:
engines/kt/experts/deferral.py) pass through; the operator's ``KWARGS`` decides whether it accepts them."""

OPS: dict[str, str] = {
    "KExpertsCPU": "experts",      # kt-kernel on the CPU: exactly our routed experts
    "KExpertsTorch": "experts",    # torch experts on the GPU -> still kt-kernel on the CPU; keep hot ones
    "KExpertsMarlin": "experts",   # with `gpu_experts` instead
    "KSFTExpertsCPU": "experts",   # LLaMA-Factory's SFT files: the fine-tuning form of KExpertsCPU; serving needs
                                   # only its forward, which is KExpertsCPU's (expert LoRA: engines/lora/cpu_experts)
    "KSFTRouteExpertsCPU": "experts",  # kt-sft's routed-experts variant of KSFTExpertsCPU; same forward
    "KLinearTorch": "linear",      # every linear op -> the plain torch nn.Linear on its device
    "KLinearMarlin": "linear",
    "VLinearMarlin": "linear",
    "KLinearFP8": "linear",
    "KLinearQ8": "linear",         # the rocm files' int8 torch linear: bf16 weights here
    "KLinearCPUInfer": "linear",   # a GGUF linear on the CPU: the torch linear on the device the rule names
    "QuantizedLinearMarlin": "linear",  # first-generation names of KLinearMarlin / KLinearTorch
    "QuantizedLinearTorch": "linear",
    "MLPCPUExperts": "experts",    # first-generation names of KExpertsCPU / KExpertsTorch
    "MLPExpertsTorch": "experts",
}
"""``generate_op`` / ``prefill_op`` values and the operator family they belong to."""

BACKENDS: dict[str, str] = {"AMXInt8": "AMXINT8", "AMXInt4": "AMXINT4", "AMXBF16": "BF16", "llamafile": "LLAMAFILE"}
"""``backend`` values -> ``method``. Without ``backend`` the operator's own default method applies."""


class KwargError(ValueError):
    """A kwarg we cannot translate; the rule loader adds the file and rule index."""

    def __init__(self, key: str, problem: str):
        super().__init__(problem)
        self.key = key


def resolve_replace_class(name: str) -> str:
    """``replace.class`` as written -> ``default`` or one of ``OPERATORS``."""
    if name == DEFAULT or name in OPERATORS:
        return name
    if name in CLASS_ALIASES:
        return CLASS_ALIASES[name].target
    raise KwargError("replace.class", f"unknown operator class {name!r}; use 'default', one of "
                                      f"{sorted(OPERATORS)}, or a KTransformers class listed in "
                                      "engines.kt.placement.aliases.CLASS_ALIASES")


UNSUPPORTED_DEVICES = {
    "xpu": "Intel GPUs: ktserve runs on the CPU and CUDA GPUs",
    "npu": "Ascend NPUs: ktserve runs on the CPU and CUDA GPUs",
    "meta": "'meta' is not a placement",
}
"""Device types KTransformers' rule files use that we refuse, with why. ROCm GPUs appear as cuda in torch,
so KTransformers' rocm files (which name cuda devices) load."""


def normalize_device(value: object, key: str) -> str:
    """``"cuda"`` -> ``"cuda:0"`` so devices compare equal however a file spells them."""
    kind = str(value).partition(":")[0]
    if kind in UNSUPPORTED_DEVICES:
        raise KwargError(key, f"{value!r}: this device is not supported ({UNSUPPORTED_DEVICES[kind]})")
    try:
        device = torch.device(str(value))
    except RuntimeError as e:
        raise KwargError(key, f"{value!r} is not a device ({e})") from None
    if device.type not in ("cpu", "cuda"):
        raise KwargError(key, f"{value!r}: this device is not supported (ktserve runs on the CPU and CUDA GPUs)")
    if device.type == "cpu":
        return "cpu"
    return f"{device.type}:{device.index or 0}"


def translate_kwargs(raw: dict, target: str) -> tuple[dict, list[str]]:
    """KTransformers kwargs -> ours for a ``target`` (``default`` or an operator path).

    Returns the translated kwargs and notes worth logging; raises KwargError naming the offending key."""
    kwargs, notes, devices = {}, [], {}
    for key, value in raw.items():
        alias = KWARG_ALIASES.get(key)
        if key == "device" or (alias and alias.kind == "device"):
            devices[key] = normalize_device(value, key)
        elif key == "method":
            if value not in METHODS:
                raise KwargError(key, f"unknown method {value!r}; known: {sorted(METHODS)}")
            kwargs["method"] = value
        elif alias is None:
            kwargs[key] = value  # ours; the operator's KWARGS decides
        elif alias.kind == "op":
            _check_op(key, value, target)
        elif alias.kind == "method":
            if value not in BACKENDS:
                raise KwargError(key, f"unknown backend {value!r}; known: {sorted(BACKENDS)}")
            kwargs["method"] = BACKENDS[value]
        elif alias.kind == "transfer_map":
            kwargs["transfer_map"] = _transfer_map(value)
        elif alias.kind == "ignore" and value != alias.harmless:
            raise KwargError(key, f"unsupported value {value!r} (only {alias.harmless!r} is accepted): {alias.why}")
        elif alias.kind == "reject":
            raise KwargError(key, f"unsupported kwarg: {alias.why}")
    device = _pick_device(devices, notes)
    if device is not None:
        kwargs["device"] = device
    return kwargs, notes


def _check_op(key: str, value: object, target: str) -> None:
    family = OPS.get(str(value))
    if family is None:
        raise KwargError(key, f"unknown op {value!r}; known: {sorted(OPS)}")
    expected = "experts" if target in EXPERT_OPERATORS else "linear" if target == DEFAULT else None
    if family != expected:
        raise KwargError(key, f"{value!r} is an {family} op; it does not apply to {target}")


def _pick_device(devices: dict[str, str], notes: list[str]) -> str | None:
    kt = devices.get("out_device") or devices.get("generate_device") or devices.get("prefill_device")
    if "generate_device" in devices and "prefill_device" in devices and "out_device" not in devices \
            and devices["generate_device"] != devices["prefill_device"]:
        notes.append(f"prefill_device {devices['prefill_device']} differs from generate_device "
                     f"{devices['generate_device']}; using {devices['generate_device']}")
    native = devices.get("device")
    if native is not None and kt is not None and native != kt:
        raise KwargError("device", f"device {native} disagrees with the KTransformers device kwargs ({kt})")
    return native or kt


def _transfer_map(value: object) -> dict[int, str]:
    if not isinstance(value, dict):
        raise KwargError("transfer_map", "must be a mapping {layer index: device}")
    out = {}
    for layer, device in value.items():
        try:
            index = int(layer)
        except (TypeError, ValueError):
            raise KwargError("transfer_map", f"layer {layer!r} is not an integer") from None
        out[index] = normalize_device(device, "transfer_map")
    return dict(sorted(out.items()))
