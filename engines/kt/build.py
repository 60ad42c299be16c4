"""The one load pipeline of the KT engine (`load_model`): every family's model is built, placed, loaded and wrapped
in its runner by the same steps in the same order; a family supplies only what is its own through the hooks of
engines/kt/families/base.py (`ModelFamily`), each handed the load's `Build` so far:

 1. the draft layer speculative decoding asks for (`draft_layer`), the checkpoint as the family reads it
    (`checkpoint_source`) and kt-kernel's pre-converted experts where the family takes them (`converted_experts`);
 2. the model on the meta device (`build_model`; its draft layer added as one more layer, `add_draft_layer`);
 3. the placement by the rules, the experts method of each rule's layers (`expert_methods_for`), whether prompt
    chunks stream the experts to the GPU (experts/notes.py: `streamed_prefill`),
    the operators' options, the placement applied;
 4. the dtype, the weights (`load_weights`), what the family fuses or installs once the weights are in
    (`finish_model`), eval mode, the draft head taken out of the model (`take_draft_head`);
 5. torch's threads beside kt-kernel's workers (`torch_thread_count`), the GPU read kernels warmed
    (experts/notes.py: `decode_reads`);
 6. the runner over the family's caches (`make_runner`), then what needs the runner: CUDA graphs and the family's
    runner extras (`finish_runner`);
 7. the engine details every family shares: each experts method's choice, streaming, decode reads, the decode
    kernel, torch's threads."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engines.kt.experts.cpuinfer import physical_cores, resolve_thread_count
from engines.kt.experts.decode_calls import DecodeKernelPolicy
from engines.kt.experts.methods import (DEFAULT_METHOD, ExpertShape, choose_gguf_method, choose_method, cpu_variant,
                                       default_method, normalize_method)
from engines.kt.layers import attention_devices
from engines.kt.experts.notes import StreamedPrefill, decode_reads, streamed_prefill, streaming_details
from engines.kt.families.base import LoadContext, LoadedModel, ModelFamily
from engines.kt.placement.aliases import EXPERT_OPERATORS
from engines.kt.placement.operators import OperatorOptions, uses_cpu_experts
from engines.kt.placement.rules import Placement, apply_placement, plan_placement
from engines.model_files import resolve_dtype

log = logging.getLogger("ktserve.engine.kt")


@dataclass(slots=True)
class Build:
    """One load as the pipeline fills it in, step by step (the module docstring's numbers); what a family's hooks
    read and add to."""

    family: ModelFamily
    context: LoadContext
    draft_layer: int | None = None  # the MTP layer's index where it drafts
    no_draft: str | None = None  # why there is no draft head, where speculative decoding asked for one
    source: Any = None  # the checkpoint as the family reads it (engines/checkpoints/source.py)
    converted: Any = None  # kt-kernel's pre-converted experts (kt_weight_path), or None
    explicit_method: str | None = None  # the experts method every layer must run (kt_method, or the converted one)
    model: torch.nn.Module | None = None
    placement: Placement | None = None
    default_method: str = DEFAULT_METHOD  # what a rule naming no method asks for
    choices: dict[str, Any] = field(default_factory=dict)  # asked method -> MethodChoice
    prefill: StreamedPrefill | None = None
    options: OperatorOptions | None = None
    dtype: torch.dtype | None = None
    draft_head: Any = None  # the draft module taken out of the model
    details: dict[str, str] = field(default_factory=dict)  # the engine details, in the order they are learnt

    @property
    def config(self) -> Any:
        return self.context.config

    @property
    def kt(self) -> Any:
        return self.context.options

    @property
    def gpu(self) -> bool:
        """Whether the placement puts anything on a GPU."""
        return self.placement.uses_gpu


def load_model(family: ModelFamily, context: LoadContext) -> LoadedModel:
    """Build, place and load `family`'s model as the context asks and return its runner (module docstring)."""
    b = Build(family, context)
    kt, config = context.options, context.config
    b.draft_layer, b.no_draft = family.draft_layer(context)
    b.source = family.checkpoint_source(context, b.draft_layer)
    b.converted, b.explicit_method = family.converted_experts(context)

    b.model = family.build_model(config)
    if b.draft_layer is not None:
        with torch.device("meta"):
            family.add_draft_layer(b.model, config)  # placed and loaded as one more layer, then taken out
    b.placement = plan_placement(b.model, context.rules, default_device="cpu", fold=context.fold)
    b.default_method = family.expert_layout.native_method or default_method(getattr(b.source, "experts_form", ""))
    b.choices = expert_methods_for(b.placement, b.explicit_method, context.rule_file, config, b.default_method,
                                   b.source)
    methods = {c.method for c in b.choices.values()}
    b.prefill = streamed_prefill(kt, b.model, config, methods, b.gpu, context.chunk_size)
    b.options = OperatorOptions(
        max_tokens=b.prefill.chunk_size + context.max_concurrent, cpu_threads=kt.cpu_infer,
        methods={m: c.method for m, c in b.choices.items()},
        checkpoint=str(getattr(b.source, "path", None) or context.model_path), default_method=b.default_method,
        gpu_prefill_tokens=b.prefill.tokens, gpu_prefill_experts=b.prefill.experts,
        expert_pad_from=kt.kt_expert_pad_from,
        # kt-kernel holds every expert of a pre-converted layer: none is the GPU's own
        gpu_read_experts=0 if b.converted else kt.kt_gpu_read_experts,
        gpu_resident_experts=0 if b.converted else kt.kt_gpu_resident_experts,
        decode_kernel=DecodeKernelPolicy(kt.kt_decode_kernel))
    apply_placement(b.model, b.placement, config, b.options)

    b.dtype = resolve_dtype(context.dtype_setting, torch.device("cuda" if b.gpu else "cpu"))
    checkpoint = family.load_weights(b)
    family.finish_model(b)
    b.model.eval()
    b.draft_head = family.take_draft_head(b) if b.draft_layer is not None else None

    threads = None
    if uses_cpu_experts(b.model):  # set before the runner's warm-up and graph capture, and recorded by the engine
        threads = torch_thread_count(kt.cpu_infer, all(d.type == "cuda" for d in attention_devices(b.model)))
        torch.set_num_threads(threads)
    # which layers' decode calls our kernel computes, settled before the GPU's share of them is said and read
    kernel = b.options.decode_kernel.finish()
    reads = decode_reads(b.model, kt, b.options)  # before any graph capture, which replays the read kernels

    runner, max_len = family.make_runner(b)
    family.finish_runner(b, runner)

    details = b.details
    for choice in b.choices.values():
        details.update(choice.describe())
    details.update(streaming_details(b.options, b.prefill))
    details.update(reads)
    details.update(kernel)
    return LoadedModel(runner, details=details, torch_threads=threads, checkpoint=checkpoint,
                       max_model_len=max_len, chunk_size=b.prefill.chunk_size)


def expert_methods_for(placement: Any, explicit: str | None, rule_file: Path, config: Any,
                       default: str = DEFAULT_METHOD, source: Any = None) -> dict[str, Any]:
    """For each experts method the rules ask for (`default` where a rule names none): the MethodChoice that
    serves it (logged once each). A GGUF checkpoint's experts (`source`) run as its blocks allow, whatever the
    rules ask (`choose_gguf_method`)."""
    layers = [kwargs for rule, kwargs in placement.replacements.values() if rule.replace in EXPERT_OPERATORS]
    asked = {normalize_method(kwargs.get("method") or default, "method") for kwargs in layers}
    experts = getattr(config, "n_routed_experts", None) or config.num_experts
    shape = ExpertShape(config.hidden_size, config.moe_intermediate_size,
                        len(layers) * experts * 3 * config.hidden_size * config.moe_intermediate_size)
    if source is not None and source.experts_form == "ggml":
        choice = choose_gguf_method(set(source.expert_types()), explicit=explicit, shape=shape)
        choices = dict.fromkeys(sorted(asked), choice)
    else:
        choices = {m: choose_method(m, explicit=explicit, source=f"rule file {rule_file.name}", shape=shape)
                   for m in sorted(asked)}
    for choice in dict.fromkeys(choices.values()):  # each once (a GGUF's serves every rule)
        if choice.reason:
            log.warning("experts: %s (kt-kernel build %s)", choice.reason, cpu_variant())
        else:
            log.info("experts: %s on kt-kernel's %s build", choice.method, cpu_variant())
    return choices


def torch_thread_count(cpu_infer: int | None, gpu: bool) -> int:
    """torch's own CPU thread pool spins (OpenMP keeps idle threads busy ~200 ms) on the cores kt-kernel's
    workers run on: small torch ops took 10 ms instead of 0.15 ms on the CPU box, and decode steps on the
    H200 box took a flat 216 ms instead of 34 ms. Without a GPU, torch gets the cores kt-kernel leaves.
    With every decoder layer on a GPU, the generation thread's CPU work is only sampling, and the cores
    kt-kernel leaves are taken by that thread and the CUDA thread that runs kt-kernel's stream callbacks;
    a second torch thread, spinning after every sampling op, would make one busy thread more than there are
    cores: torch gets 1."""
    return 1 if gpu else max(1, physical_cores() - resolve_thread_count(cpu_infer))
