"""The "ktransformers" engine: DeepSeek MoE models with the routed experts on the CPU (kt-kernel) and everything
else where the placement rules put it, usually one GPU. Every model loads through its family
(engines/kt/families/: deepseek_mla/ for V2/V3, whose load path V3.2's deepseek_v32/ reuses; deepseek_v4/); this
module holds what they share: choosing the config, family, rule file and experts methods, and the engine.

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
from typing import Any

import torch

from engines.base import EngineConfig, ModelInfo, engine_options
from engines.checkpoints.formats import open_source
from engines.checkpoints.source import SafetensorsSource
from engines.kt.experts.methods import DEFAULT_METHOD
from engines.kt.families import FAMILIES, family_architectures, family_for
from engines.kt.families.base import LoadContext, ModelFamily
from engines.kt.families.deepseek_mla.family import SUPPORTED_ARCHITECTURES, MLAFamily
from engines.kt.options import KTOptions
from engines.model_files import context_length, eos_token_ids, load_tokenizer, model_id
from engines.runtime.batch_invariance import check_policy
from engines.runtime.llm_engine import LLMEngine
from engines.runtime.model_runner import ModelRunner
from engines.runtime.speculative import SpeculativeOptions

log = logging.getLogger("ktserve.engine.kt")

RULES_DIR = Path(__file__).resolve().parents[2] / "kt_optimize_rules"
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


def resolve_rule_file(name: str | None, config: Any, family: ModelFamily | None = None) -> Path:
    """The rule file: `name` as a path, else a shipped file of that name (LLaMA-Factory configs name theirs
    as `examples/kt_optimize_rules/<file>`), else the family's default for this machine and architecture."""
    name = name or (family or MLAFamily()).default_rule_file(config, _gpu_count())
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
                       default: str = DEFAULT_METHOD, source: Any = None) -> dict[str, Any]:
    """For each experts method the rules ask for (`default` where a rule names none): the MethodChoice that
    serves it (logged once each). A GGUF checkpoint's experts (`source`) run as its blocks allow, whatever the
    rules ask (`choose_gguf_method`)."""
    from engines.kt.placement.aliases import EXPERT_OPERATORS
    from engines.kt.experts.methods import (ExpertShape, choose_gguf_method, choose_method, cpu_variant,
                                           normalize_method)

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
        source = open_source(model_path, kt.gguf_path)
        gguf = None if isinstance(source, SafetensorsSource) else source  # a GGUF brings its config and tokenizer
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
                              speculative=engine_options(SpeculativeOptions, cfg.settings), source=source)
        loaded = family.load(context)
        loaded.runner.batch_invariance = check_policy(kt.batch_invariant)
        if cfg.chunk_size is None:
            cfg.chunk_size = loaded.chunk_size
        encoder = family.chat_encoder(model_path, allow_checkpoint_code=cfg.trust_remote_code)
        if encoder is not None and cfg.template is None:
            family.install_chat_encoder(tokenizer, encoder)
        if loaded.torch_threads is not None:
            self.torch_threads = loaded.torch_threads
            torch.set_num_threads(loaded.torch_threads)
        log.info("loaded %s (%s family) with %s in %.1fs", model_path.name, family.name, rule_file.name,
                 time.perf_counter() - started)
        details = {"kt_optimize_rule": rule_file.name, "model_family": family.name, **loaded.details,
                   "batch_invariant": kt.batch_invariant}
        if gguf is not None and gguf.routing_note:  # what the GGUF's metadata lacked of the routing (gguf/routing.py)
            details["gguf_routing"] = gguf.routing_note
        name = (cfg.model_name or gguf.name) if gguf else model_id(cfg)
        info = ModelInfo(id=name, max_model_len=loaded.max_model_len or max_len,
                         architecture=family.architectures[0], engine=self.name, created=int(time.time()),
                         eos_token_ids=eos_token_ids(config, tokenizer, model_path),
                         vocab_size=config.vocab_size, details=details, checkpoint=loaded.checkpoint)
        if loaded.checkpoint is not None:
            log.info("checkpoint: %s; %s", loaded.checkpoint.format, loaded.checkpoint.summary())
        return loaded.runner, tokenizer, info
