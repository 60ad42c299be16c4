"""The "ktransformers" engine: DeepSeek MoE models with the routed experts on the CPU (kt-kernel) and everything
else where the placement rules put it, usually one GPU. Every model loads through its family
(engines/kt/families/: deepseek_mla/ for V2/V3, whose load path V3.2's deepseek_v32/ reuses; deepseek_v4/), found
through the registry (engines/kt/families/__init__.py) and never imported here; this module chooses the config,
family and rule file, loads the model through the one pipeline every family shares (engines/kt/build.py), and is
the engine.

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
from engines.kt.build import load_model
from engines.kt.families import ARCHITECTURES, FAMILIES, family_architectures, family_for, family_for_architecture
from engines.kt.families.base import LoadContext, ModelFamily
from engines.kt.options import KTOptions
from engines.kt.placement.rules import device_folding, load_rules
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
    import transformers  # heavy (seconds): imported when a model loads, not with this module

    path = model_path / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    arch = (raw.get("architectures") or ["?"])[0]
    if raw.get("model_type") in FAMILIES:
        return transformers.AutoConfig.from_pretrained(model_path), arch
    family = family_for_architecture(arch)
    if family is None:
        served = ", ".join(family_architectures())
        raise ValueError(f"model: the ktransformers engine serves {served}; {model_path} is {arch} (use the "
                         f"huggingface engine)")
    return family.read_config(model_path), arch


def resolve_rule_file(name: str | None, config: Any, family: ModelFamily | None = None) -> Path:
    """The rule file: `name` as a path, else a shipped file of that name (LLaMA-Factory configs name theirs
    as `examples/kt_optimize_rules/<file>`), else the family's default for this machine and architecture."""
    if not name:
        family = family or family_for(config)
        if family is None:
            raise ValueError(f"kt_optimize_rule: no family serves {getattr(config, 'model_type', None)!r} to choose "
                             "a default rule file for; name one")
        name = family.default_rule_file(config, _gpu_count())
    for path in (Path(name), RULES_DIR / name, RULES_DIR / Path(name).name):
        if path.is_file():
            return path
    shipped = ", ".join(sorted(p.name for p in RULES_DIR.glob("*.yaml")))
    raise ValueError(f"kt_optimize_rule: {name!r} is neither a file nor one of the shipped rules ({shipped})")


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _fold_devices(rules: list, rule_file: Path, strict: bool) -> dict[str, str]:
    """The rules' devices this machine lacks -> where they run instead (warned once; an error when strict)."""
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


class KTEngine(LLMEngine):
    name = "ktransformers"

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.options = engine_options(KTOptions, config.settings)

    def _load(self) -> tuple[ModelRunner, Any, ModelInfo]:
        cfg, kt = self.config, self.options
        started = time.perf_counter()
        model_path = Path(cfg.model_path)
        source = open_source(model_path, kt.gguf_path)
        gguf = None if isinstance(source, SafetensorsSource) else source  # a GGUF brings its config and tokenizer
        if gguf is not None:
            config = gguf.config()
            arch = (config.architectures or ["?"])[0]
            family = family_for_architecture(arch)  # a GGUF's deepseek2 is V2 / V3 (ARCHITECTURES)
            if family is None:
                raise ValueError(f"model: the ktransformers engine serves {', '.join(ARCHITECTURES)} "
                                 f"from GGUF files; {model_path} is {arch}")
            tokenizer = gguf.tokenizer(cfg.template)
        else:
            config, arch = architecture_config(model_path)
            family = family_for(config, arch)
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
        loaded = load_model(family, context)
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
