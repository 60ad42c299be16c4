"""The "ktransformers" engine: DeepSeek V2/V2-Lite/V3/R1 with the routed experts on the CPU (kt-kernel)
and everything else where the placement rules put it, usually one GPU. Every model loads through its family
(engines/kt/families/): V2/V3 are this module's MLAFamily and `load_mla`, which V3.2 reuses; V4 has its own.

Choosing a rule file: `kt_optimize_rule` when given (a path; a file name, or a path that does not exist,
is looked up by file name in kt_optimize_rules/); otherwise the CPU-only file on a machine without CUDA,
and the single-GPU file for the architecture when there is one. A rule file naming more GPUs than this
machine has is folded onto the GPUs there are (else the CPU) with one warning, unless
`kt_strict_placement` is set. The experts method each rule asks for is replaced by the closest one this
CPU runs (engines/kt/experts/methods.py), logged once and reported in the model info."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engines.base import EngineConfig, ModelInfo, engine_options
from engines.checkpoints.source import PER_EXPERT, SafetensorsSource
from engines.kt.experts.streaming import copy_bits, expert_copy_bytes, experts_within
from engines.kt.experts.methods import DEFAULT_METHOD, METHODS, default_method, normalize_method, unavailable_reason
from engines.kt.families import FAMILIES, family_architectures, family_for
from engines.kt.families.base import ExpertLayout, LoadContext, LoadedModel, ModelFamily
from engines.kt.experts.cpu import RoutedExpertsCPU
from engines.kt.attention.flashinfer_mla import attention_for
from engines.kt.attention.kv_cache import PAGE_TOKENS, LatentKVCache
from engines.kt.experts.mapped import MAX_TOKENS as MAPPED_MAX_TOKENS
from engines.kt.experts.mapped import triton_available
from engines.kt.loader import load_checkpoint, missing_tensors
from engines.kt import mtp
from engines.kt.placement.operators import OperatorOptions, fuse_rms_norms
from engines.kt.options import KTOptions
from engines.kt.gguf_checkpoint import open_gguf
from engines.kt.runner import KTModelRunner, device_scope, layer_devices, uses_cpu_experts
from engines.model_files import context_length, eos_token_ids, load_tokenizer, model_id, resolve_dtype
from engines.runtime.llm_engine import LLMEngine
from engines.runtime.model_runner import ModelRunner
from engines.runtime.speculative import SpeculativeOptions

log = logging.getLogger("ktserve.engine.kt")

RULES_DIR = Path(__file__).resolve().parents[2] / "kt_optimize_rules"
SUPPORTED_ARCHITECTURES = {"DeepseekV2ForCausalLM": "DeepseekV2Config", "DeepseekV3ForCausalLM": "DeepseekV3Config"}
CPU_RULES = "DeepSeek-CPU.yaml"
DEFAULT_KV_BUDGET_TOKENS = 65536
# Without kt_maxlen / max_model_len, serve at most this context: DeepSeek configs declare 128k-160k positions,
# and the default KV cache holds a few requests of the full context.
DEFAULT_MAX_MODEL_LEN = 16384


def architecture_config(model_path: Path) -> tuple[Any, str]:
    """transformers' config of the model, and its architecture name. A family's model_type (engines/kt/families/)
    loads its own config; otherwise the architecture decides, not `model_type`: checkpoints of a served
    architecture under a model type of their own (Kimi-K2's kimi_k2 is a DeepseekV3ForCausalLM) load as that
    architecture, without their remote code."""
    import transformers

    path = model_path / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    arch = (raw.get("architectures") or ["?"])[0]
    if raw.get("model_type") in FAMILIES:
        return transformers.AutoConfig.from_pretrained(model_path), arch
    if arch not in SUPPORTED_ARCHITECTURES:
        served = ", ".join((*SUPPORTED_ARCHITECTURES, *family_architectures()))
        raise ValueError(f"model: the ktransformers engine serves {served}; {model_path} is {arch} (use the "
                         f"huggingface engine)")
    return getattr(transformers, SUPPORTED_ARCHITECTURES[arch]).from_pretrained(model_path), arch


def default_rule_file(config: Any, family: ModelFamily | None = None) -> str:
    if family is not None:
        return family.default_rule_file(config, _gpu_count())
    if not torch.cuda.is_available():
        return CPU_RULES
    if config.model_type == "deepseek_v3":
        return "DeepSeek-V3.yaml"
    small = getattr(config, "n_routed_experts", 0) <= 64 and config.hidden_size <= 2048
    return "DeepSeek-V2-Lite.yaml" if small else "DeepSeek-V2.yaml"


def resolve_rule_file(name: str | None, config: Any, family: ModelFamily | None = None) -> Path:
    """The rule file: `name` as a path, else a shipped file of that name (LLaMA-Factory configs name theirs
    as `examples/kt_optimize_rules/<file>`), else the default for this machine and architecture."""
    name = name or default_rule_file(config, family)
    for path in (Path(name), RULES_DIR / name, RULES_DIR / Path(name).name):
        if path.is_file():
            return path
    shipped = ", ".join(sorted(p.name for p in RULES_DIR.glob("*.yaml")))
    raise ValueError(f"kt_optimize_rule: {name!r} is neither a file nor one of the shipped rules ({shipped})")


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _fold_devices(rules: list, rule_file: Path, strict: bool) -> dict[str, str]:
    """The rules' devices this machine lacks -> where they run instead (warned once; an error when strict)."""
    from engines.kt.placement.rules import device_folding

    gpus = _gpu_count()
    fold = device_folding(rules, gpus)
    if fold:
        mapping = ", ".join(f"{a} -> {b}" for a, b in fold.items())
        have = f"{gpus} GPU(s)" if gpus else "no CUDA GPU"
        if strict:
            raise ValueError(f"kt_optimize_rule {rule_file.name} places modules on {', '.join(fold)}, but this "
                             f"machine has {have} (kt_strict_placement is set; unset it to run them on {mapping})")
        log.warning("kt_optimize_rule %s names devices this machine lacks (%s); running them as %s", rule_file.name,
                    have, mapping)
    return fold


def expert_methods_for(placement: Any, explicit: str | None, rule_file: Path, config: Any,
                       default: str = DEFAULT_METHOD, gguf: Any = None) -> dict[str, Any]:
    """For each experts method the rules ask for (`default` where a rule names none): the MethodChoice that
    serves it (logged once each). A GGUF checkpoint's experts run as its blocks allow, whatever the rules ask
    (`choose_gguf_method`)."""
    from engines.kt.placement.aliases import EXPERT_OPERATORS
    from engines.kt.experts.methods import (ExpertShape, choose_gguf_method, choose_method, cpu_variant,
                                           normalize_method)

    layers = [kwargs for rule, kwargs in placement.replacements.values() if rule.replace in EXPERT_OPERATORS]
    asked = {normalize_method(kwargs.get("method") or default, "method") for kwargs in layers}
    experts = getattr(config, "n_routed_experts", None) or config.num_experts
    shape = ExpertShape(config.hidden_size, config.moe_intermediate_size,
                        len(layers) * experts * 3 * config.hidden_size * config.moe_intermediate_size)
    if gguf is not None:
        choice = choose_gguf_method(set(gguf.expert_types()), explicit=explicit, shape=shape)
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
    from engines.kt.experts.cpuinfer import physical_cores, resolve_thread_count

    return 1 if gpu else max(1, physical_cores() - resolve_thread_count(cpu_infer))


class KTEngine(LLMEngine):
    name = "ktransformers"

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.options = engine_options(KTOptions, config.settings)

    def _load(self) -> tuple[ModelRunner, Any, ModelInfo]:
        from engines.kt.placement.rules import load_rules

        cfg, kt = self.config, self.options
        started = time.perf_counter()
        model_path = Path(cfg.model_path)
        gguf = open_gguf(model_path, kt.gguf_path)  # None: safetensors in model_path
        if gguf is not None:
            config = gguf.config()
            arch = (config.architectures or ["?"])[0]
            if arch not in SUPPORTED_ARCHITECTURES:
                raise ValueError(f"model: the ktransformers engine serves {', '.join(SUPPORTED_ARCHITECTURES)} "
                                 f"from GGUF files; {model_path} is {arch}")
            family, tokenizer = MLAFamily(arch), gguf.tokenizer(cfg.template)
        else:
            config, arch = architecture_config(model_path)
            family = family_for(config) or MLAFamily(arch)  # V2 / V3: the MLA generation served by load_mla
            tokenizer = load_tokenizer(str(model_path), cfg.template, cfg.trust_remote_code, config)
        max_len = context_length(config, tokenizer, cfg.max_model_len)
        if cfg.max_model_len is None and max_len > DEFAULT_MAX_MODEL_LEN:
            log.info("serving a context of %d tokens (the model allows %d; raise it with kt_maxlen)",
                     DEFAULT_MAX_MODEL_LEN, max_len)
            max_len = DEFAULT_MAX_MODEL_LEN
        rule_file = resolve_rule_file(kt.kt_optimize_rule, config, family)
        rules = load_rules(rule_file)
        context = LoadContext(model_path=model_path, config=config, rule_file=rule_file, rules=rules,
                              max_model_len=max_len, max_concurrent=cfg.max_concurrent, chunk_size=cfg.chunk_size,
                              dtype_setting=cfg.dtype, options=kt,
                              fold=_fold_devices(rules, rule_file, kt.kt_strict_placement),
                              speculative=engine_options(SpeculativeOptions, cfg.settings), gguf=gguf)
        loaded = family.load(context)
        encoder = family.chat_encoder(model_path, allow_checkpoint_code=cfg.trust_remote_code)
        if encoder is not None and cfg.template is None:
            family.install_chat_encoder(tokenizer, encoder)
        if loaded.torch_threads is not None:
            self.torch_threads = loaded.torch_threads
            torch.set_num_threads(loaded.torch_threads)
        log.info("loaded %s (%s family) with %s in %.1fs", model_path.name, family.name, rule_file.name,
                 time.perf_counter() - started)
        details = {"kt_optimize_rule": rule_file.name, "model_family": family.name, **loaded.details}
        name = (cfg.model_name or gguf.name) if gguf else model_id(cfg)
        info = ModelInfo(id=name, max_model_len=loaded.max_model_len or max_len,
                         architecture=family.architectures[0], engine=self.name, created=int(time.time()),
                         eos_token_ids=eos_token_ids(config, tokenizer, model_path),
                         vocab_size=config.vocab_size, details=details, checkpoint=loaded.checkpoint)
        if loaded.checkpoint is not None:
            log.info("checkpoint: %s; %s", loaded.checkpoint.format, loaded.checkpoint.summary())
        return loaded.runner, tokenizer, info


@dataclass(frozen=True, slots=True)
class MLAVariant:
    """What a generation of the MLA architecture changes in how load_mla loads it (V2 / V3: nothing): the cache
    it attends over (`make_cache(config, **LatentKVCache's arguments)`), whether FlashInfer's dense paged MLA
    may attend, and whether its MTP layer can draft (`speculative: mtp`)."""

    make_cache: Callable = lambda config, **kwargs: LatentKVCache(**kwargs)
    flashinfer: bool = True
    drafts: bool = True


class MLAFamily(ModelFamily):
    """DeepSeek V2 / V2-Lite / V3 / R1 (and checkpoints of those architectures under their own model_type, e.g.
    Kimi-K2) behind engines/kt/families/base.py's interface, loaded by load_mla; the base of the MLA generations
    that add to it (V3.2)."""

    name = "deepseek_mla"
    model_types = ("deepseek_v2", "deepseek_v3")
    architectures = tuple(SUPPORTED_ARCHITECTURES)
    expert_layout = ExpertLayout(pattern=PER_EXPERT, projections={"gate_proj": "gate", "up_proj": "up",
                                                                  "down_proj": "down"}, format="bf16")

    def __init__(self, architecture: str | None = None):
        if architecture is not None:  # the one this checkpoint names, for the model info
            self.architectures = (architecture,)

    def default_rule_file(self, config: Any, gpus: int) -> str:
        return default_rule_file(config)

    def build_model(self, config: Any) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)

    def checkpoint_name(self, name: str) -> str | None:
        return name

    def load(self, context: LoadContext) -> LoadedModel:
        return load_mla(self, context)


def load_mla(family: ModelFamily, context: LoadContext, variant: MLAVariant = MLAVariant()) -> LoadedModel:
    """Build `family`'s model on the meta device, place it by the rules, stream the checkpoint in (FP8 releases
    through SafetensorsSource) and return the KT runner over it, with the MTP layer as a draft head when
    speculative decoding asks for it: the load path of every MLA generation (V2, V3, V3.2)."""
    from engines.kt.placement.rules import apply_placement, plan_placement

    kt, config, rule_file, model_path = context.options, context.config, context.rule_file, context.model_path
    chunk_size, max_concurrent = context.chunk_size, context.max_concurrent
    draft_layer, no_draft = _draft_layer(family, context, variant)
    # the MTP layer is read only to draft with; then its copies of the embedding and LM head are not
    source = context.gguf or SafetensorsSource(model_path, config.num_hidden_layers + (draft_layer is not None),
                                               skip=mtp.SHARED_COPIES if draft_layer is not None else None)
    converted, explicit = _converted_experts(kt, config)
    model = family.build_model(config)
    if draft_layer is not None:
        with torch.device("meta"):
            mtp.add_layer(model, config)  # placed and loaded as one more decoder layer, then taken out
    placement = plan_placement(model, context.rules, default_device="cpu", fold=context.fold)
    default = default_method(source.experts_form)
    choices = expert_methods_for(placement, explicit, rule_file, config, default, context.gguf)
    bits = max((copy_bits(METHODS[c.method].bits) for c in choices.values()), default=8)  # none: torch experts
    stream_experts = _streamed_expert_count(kt, model, config, bits)
    options = OperatorOptions(max_tokens=chunk_size + max_concurrent, cpu_threads=kt.cpu_infer,
                              methods={m: c.method for m, c in choices.items()}, checkpoint=str(source.path),
                              default_method=default,
                              gpu_prefill_tokens=kt.kt_gpu_prefill_tokens if stream_experts != 0 else 0,
                              gpu_prefill_experts=stream_experts, expert_pad_from=kt.kt_expert_pad_from,
                              # kt-kernel holds every expert of a pre-converted layer: none is the GPU's own
                              gpu_read_experts=0 if converted else kt.kt_gpu_read_experts,
                              gpu_resident_experts=0 if converted else kt.kt_gpu_resident_experts)
    apply_placement(model, placement, config, options)
    gpu = any(d.startswith("cuda") for d in placement.devices.values())
    dtype = resolve_dtype(context.dtype_setting, torch.device("cuda" if gpu else "cpu"))
    storage = load_checkpoint(model, source, placement.device_of_param, dtype,
                              getattr(config, "n_routed_experts", None) or config.num_experts,
                              weight_cache=_weight_cache_dir(kt, source.path), converted=converted)
    _finish_model(model, config, placement)
    fused = fuse_rms_norms(model)
    if fused:
        log.info("%d RMSNorms on the GPU run as one fused kernel each", fused)
    model.eval()
    head = mtp.MTPHead.take(model, device_scope) if draft_layer is not None else None
    devices = layer_devices(model)
    max_len = context.max_model_len
    kv_tokens = _kv_tokens(context)
    if kv_tokens < max_len:  # a request longer than the cache could never finish
        log.info("serving a context of %d tokens: the KV cache (kv_cache_tokens) holds no more", kv_tokens)
        max_len = kv_tokens
    cache_devices = devices + ([head.device] if head is not None else [])  # the draft head's own KV layer
    # one page more than asked for: the runner's scratch page, which no request uses
    cache = variant.make_cache(config, layer_devices=cache_devices, num_tokens=kv_tokens + PAGE_TOKENS,
                               latent_dim=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim, dtype=dtype,
                               prefix_cache=kt.prefix_cache)
    backend = kt.attention_backend if variant.flashinfer else _dense_only(kt.attention_backend, family)
    flash = attention_for(backend, model.model.layers[0].self_attn, cache_devices, cache)
    runner = KTModelRunner(model, devices, cache, max_len, flash=flash, draft_head=head,
                           draft_unavailable=no_draft)
    loaded = LoadedModel(runner, checkpoint=storage, max_model_len=max_len)
    cpu_experts, all_on_gpus = uses_cpu_experts(model), all(d.type == "cuda" for d in devices)
    if cpu_experts:  # set here, before the warm-up and graph capture below, and recorded by the engine
        loaded.torch_threads = torch_thread_count(kt.cpu_infer, all_on_gpus)
        torch.set_num_threads(loaded.torch_threads)
    for streamer in options.streamers.active():
        if streamer.mapped is not None:
            streamer.mapped.warm_up()
    if kt.kt_use_cuda_graph:
        if gpu:
            runner.capture_decode_graphs(_graph_rows(context, head is not None))
        else:
            log.info("kt_use_cuda_graph: no GPU in the placement; decode runs without CUDA graphs")
    _log_streamed_experts(options, options.gpu_prefill_tokens, chunk_size)
    mapped, resident = _log_read_experts(model, kt.kt_gpu_read_experts, kt.kt_gpu_resident_experts)
    if cpu_experts and all_on_gpus:
        # every thread but kt-kernel's workers is GPU-side work (launching, sampling, the stream callbacks)
        if kt.kt_isolate_workers:
            log.info("kt_isolate_workers: %s", runner.isolation.apply())
        else:
            log.info("kt_isolate_workers off: other threads may run on kt-kernel's worker cores")
    padded = sorted({(r.start, r.stop) for m in model.modules() if isinstance(m, RoutedExpertsCPU)
                     for r in [m.padded_tokens()] if r})
    if padded:
        log.info("expert calls of %s tokens go padded to %s rows, where kt-kernel's matrix kernels take them "
                 "(kt_expert_pad_from)", "/".join(f"{a}-{b - 1}" for a, b in padded),
                 "/".join(str(b) for _, b in padded))
    if runner.deferring:
        counts = sorted({layer.deferred for layer in runner.deferring})
        log.info("expert deferral: in decode steps of up to %d sequences, %s of each token's %d experts in %d "
                 "layers run one layer late, overlapping the next layer (n_deferred_experts in %s)",
                 runner.defer_max_batch, "/".join(map(str, counts)), runner.deferring[0].top_k,
                 len(runner.deferring), rule_file.name)
    log.info("%s: %s, experts on the CPU: %s", model_path.name, dtype, cpu_experts)
    details = loaded.details
    details["attention_backend"] = "torch" if flash is None else "flashinfer"
    streaming = options.streamers.active()
    if streaming and kt.kt_gpu_prefill_tokens:
        details["gpu_prefill_tokens"] = str(kt.kt_gpu_prefill_tokens)
        details["gpu_prefill_copy_gbps"] = f"{min(s.pcie_bytes_per_s for s in streaming) / 1e9:.1f}"
        details["gpu_prefill_experts"] = str(min(h.held for s in streaming for h in s.layers.values()))
    details["gpu_read_experts"] = str(mapped)
    details["gpu_resident_experts"] = str(resident)
    if runner.isolation.spare:
        details["server_thread_cores"] = ",".join(map(str, sorted(runner.isolation.spare)))
    if padded:
        details["expert_pad_from"] = str(min(a for a, _ in padded))
    if runner.deferring:
        details["experts_deferred"] = str(max(layer.deferred for layer in runner.deferring))
    if head is not None:
        details["speculative"] = f"mtp (model.layers.{draft_layer})"
    for choice in choices.values():
        details.update(choice.describe())
    return loaded


def _dense_only(requested: str, family: ModelFamily) -> str:
    """The attention backend for a family whose attention FlashInfer's dense paged MLA cannot compute."""
    if requested == "flashinfer":
        raise ValueError(f"attention_backend: flashinfer computes dense MLA; {family.name} attends sparsely "
                         "(use auto or torch)")
    log.info("MLA attention of %s: torch (FlashInfer's paged MLA attends densely)", family.name)
    return "torch"


def _draft_layer(family: ModelFamily, context: LoadContext, variant: MLAVariant) -> tuple[int | None, str | None]:
    """The MTP layer to draft with when speculative decoding asks for it, else None and, when it asked, why
    there is none (the runtime logs it and serves without drafting)."""
    if context.speculative is None or context.speculative.speculative != "mtp":
        return None, None
    if not variant.drafts:
        return None, f"{family.name} models do not draft with their MTP layer yet"
    if context.gguf is not None:
        return None, (f"{context.gguf.path.name} is a GGUF checkpoint, whose multi-token-prediction layer ktserve "
                      "does not read")
    config = context.config
    index = mtp.mtp_layer_index(context.model_path, config)
    if index is None:
        return None, (f"{context.model_path.name} has no multi-token-prediction layer (model.layers."
                      f"{config.num_hidden_layers}.eh_proj.weight is not in the checkpoint)")
    return index, None


def _graph_rows(context: LoadContext, drafting: bool) -> int:
    """The most rows a decode step feeds: one per sequence, and a drafted sequence's draft tokens."""
    rows = context.max_concurrent
    if drafting:
        spec = context.speculative
        rows = max(rows, min(rows, spec.speculative_max_batch) * (1 + spec.num_speculative_tokens))
    return rows


def _kv_tokens(context: LoadContext) -> int:
    """KV capacity: as configured, else room for a few full-length requests within a fixed budget
    (64k positions: 2 GB for V2-Lite's 27 layers x 576 bf16 values), never less than one request."""
    if context.options.kv_cache_tokens:
        return context.options.kv_cache_tokens
    max_len = context.max_model_len
    return max(max_len, min(max_len * min(context.max_concurrent, 4), DEFAULT_KV_BUDGET_TOKENS))


def _converted_experts(kt: KTOptions, config: Any) -> tuple[Any, str | None]:
    """kt-kernel's pre-converted experts (kt_weight_path) when given, and the experts method every layer must
    then run (theirs; kt_method otherwise)."""
    from engines.kt.experts.cache import ConvertedExperts

    if not kt.kt_weight_path:
        return None, kt.kt_method
    converted = ConvertedExperts.open(kt.kt_weight_path, config.hidden_size, config.moe_intermediate_size)
    if kt.kt_method and normalize_method(kt.kt_method, "kt_method") != converted.method:
        raise ValueError(f"kt_method {kt.kt_method} disagrees with kt_weight_path {kt.kt_weight_path}, which holds "
                         f"{converted.method} experts (unset kt_method, or kt_weight_path to convert at load)")
    reason = unavailable_reason(converted.method)
    if reason is not None:
        raise ValueError(f"kt_weight_path {kt.kt_weight_path} holds {converted.method} experts, but {reason} "
                         f"(unset kt_weight_path to convert the checkpoint's experts at load)")
    log.info("kt_weight_path: %s experts of %d layers from %s", converted.method, len(converted.layers),
             converted.root)
    return converted, converted.method


def _weight_cache_dir(kt: KTOptions, model_path: Path) -> Path | None:
    """Pre-quantized experts live under the cache root, one folder per model and expert method."""
    if not kt.kt_weight_cache:
        return None
    method = (kt.kt_method or "rules").upper()
    return Path(kt.kt_weight_cache) / f"{model_path.resolve().name}-{method}"


def _finish_model(model: Any, config: Any, placement: Any) -> None:
    """What the checkpoint does not carry: the rotary tables (computed) and a tied LM head."""
    rotary = model.model.rotary_emb
    device = placement.device_of_param("model.rotary_emb.inv_freq")
    with torch.device(device):
        model.model.rotary_emb = type(rotary)(config=config)
    if getattr(config, "tie_word_embeddings", False) and model.lm_head.weight.is_meta:
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = missing_tensors(model)
    if missing:
        raise ValueError(f"model: the checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:5])}")


def _streamed_expert_count(kt: KTOptions, model: Any, config: Any, bits: int = 8) -> int | None:
    """How many of each layer's experts keep streamed copies (`bits`-bit ones): as many as kt_gpu_prefill_memory
    holds over the model's expert layers (0: none, streaming off, said why), None: every expert (no budget)."""
    if kt.kt_gpu_prefill_memory is None:
        return None
    if not kt.kt_gpu_prefill_tokens:
        log.warning("kt_gpu_prefill_memory=%g GB does nothing without kt_gpu_prefill_tokens", kt.kt_gpu_prefill_memory)
        return None
    layers = sum(1 for name, _ in model.named_modules() if name.endswith(".mlp.experts"))
    num_experts = getattr(config, "n_routed_experts", None) or config.num_experts
    count = experts_within(kt.kt_gpu_prefill_memory * 1e9, layers, num_experts, config.hidden_size,
                           config.moe_intermediate_size, bits)
    if count == 0:
        log.warning("kt_gpu_prefill_memory=%g GB holds no expert's copy for each of %d layers (one takes %.1f MB a "
                    "layer): every expert stays on the CPU", kt.kt_gpu_prefill_memory, layers,
                    expert_copy_bytes(config.hidden_size, config.moe_intermediate_size, bits) / 1e6)
    return count


def _log_read_experts(model: torch.nn.Module, setting: int | None, resident_setting: int = 0) -> tuple[int, int]:
    """Say how many of each expert layer's experts the GPU computes in decode steps, where they lie, and why none
    where it computes none (kt_gpu_read_experts, kt_gpu_resident_experts); the fewest of any layer, and of those
    the fewest in GPU memory."""
    layers = [m for m in model.modules() if isinstance(m, RoutedExpertsCPU)]
    on_gpu = [m for m in layers if m.gpu_device.type == "cuda"]
    shares = [m.mapped_experts(1) for m in on_gpu if m.streamer is not None]
    if not on_gpu:
        if resident_setting:
            log.warning("kt_gpu_resident_experts=%d: no CPU-expert layer sends its output to a GPU here, so every "
                        "expert stays with kt-kernel", resident_setting)
        return 0, 0
    resident = min(m.resident for m in on_gpu)
    if shares and max(shares) > 0:
        owned = sorted({m.owned for m in on_gpu})
        forms = "/".join(sorted({f"int{m.copy_bits}" for m in on_gpu if m.streamer is not None}))
        how = (f"they live only as {forms} copies, kt-kernel holds the others" if owned != [0]
               else "from the streamed copies (kt_gpu_prefill_tokens)")
        where = "them straight from host memory"
        if resident:
            size = _resident_bytes(on_gpu)
            size_text = f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.0f} MB"
            where = f"experts [0, {resident}) from GPU memory ({size_text}, kt_gpu_resident_experts)"
            if min(shares) > resident:
                where += ", the others straight from host memory"
        log.info("decode steps of up to %d sequences: the GPU computes experts [0, %s) of each MoE layer reading %s "
                 "while kt-kernel computes the rest; %s (kt_gpu_read_experts)",
                 MAPPED_MAX_TOKENS, "/".join(map(str, sorted(set(shares)))), where, how)
        if resident_setting and not resident:
            log.warning("kt_gpu_resident_experts=%d: none kept in GPU memory beside duplicate copies "
                        "(kt_gpu_prefill_tokens)", resident_setting)
        coarser = sorted({m.method for m in on_gpu if m.owned and METHODS[m.method].bits > 8})
        if coarser:
            log.info("the experts the GPU owns are int8 copies, coarser than the %s weights kt-kernel computes the "
                     "others from", "/".join(coarser))
        return min(shares), resident
    if setting == 0 and not resident_setting:
        why = "kt_gpu_read_experts=0"
    elif not triton_available():
        why = "Triton is not installed"
    elif setting is None and not resident_setting:
        why = "by default the GPU takes experts of 8- and 4-bit methods only (kt_gpu_read_experts=N asks anyway)"
    else:
        why = "the layers keep hot experts, defer experts, or run RAWINT4 or LLAMAFILE"
    (log.warning if resident_setting else log.info)("decode steps compute every routed expert with kt-kernel: %s", why)
    return 0, 0


def _resident_bytes(layers: list[RoutedExpertsCPU]) -> int:
    """GPU memory the layers' resident experts take (kt_gpu_resident_experts)."""
    return sum(m.streamer.resident[m.layer_idx].nbytes for m in layers
               if m.streamer is not None and m.layer_idx in m.streamer.resident)


def _log_streamed_experts(options: OperatorOptions, tokens: int, chunk_size: int) -> None:
    """Say what kt_gpu_prefill_tokens does on this placement (it needs expert layers whose output is on a GPU)."""
    if not tokens:
        return
    streamers = options.streamers.active()
    if not streamers:
        log.warning("kt_gpu_prefill_tokens=%d: no CPU-expert layer sends its output to a GPU here, so every "
                    "prompt chunk and decode step computes its experts on the CPU", tokens)
        return
    for s in streamers:
        pinned = sum(h.nbytes for h in s.layers.values())
        held = sorted({h.held for h in s.layers.values()})
        forms = "/".join(sorted({f"int{h.bits}" for h in s.layers.values()}))
        log.info("prompt chunks of >= %d tokens and decode steps of >= %d sequences compute part of the routed "
                 "experts of %d layers on %s (at most the first %s of each layer's, whose copies are kept), streamed "
                 "at %.1f GB/s from %.1f GB of pinned %s copies; a long chunk copies them all, %.2f s, once per "
                 "chunk of up to chunk_size=%d tokens (larger chunks amortize it: docs/performance.md)", tokens,
                 tokens, len(s.layers), s.device, "/".join(map(str, held)), s.pcie_bytes_per_s / 1e9, pinned / 1e9,
                 forms, pinned / s.pcie_bytes_per_s, chunk_size)
