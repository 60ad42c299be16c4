"""The DeepSeek-V4 family (V4-Flash, V4-Pro): what the KT engine's registry returns for `deepseek_v4`."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engines.base import CheckpointStorage
from engines.checkpoints.source import dtype_name
from engines.kt.experts.mapped import MAX_TOKENS as MAPPED_MAX_TOKENS
from engines.kt.experts.methods import sft_kernel_class
from engines.kt.families.base import ChatEncoder, ExpertLayout, LoadContext, ModelFamily
from engines.kt.families.deepseek_v4 import names
from engines.kt.families.deepseek_v4.budget import CacheBudget, CacheBytes
from engines.kt.families.deepseek_v4.chat import ENCODER_FILE, V4ChatFormat
from engines.kt.families.deepseek_v4.blocks import install_blocked_scorers
from engines.kt.families.deepseek_v4.hyper import install_fused_hyper_connections
from engines.kt.families.deepseek_v4.loader import load_v4_checkpoint
from engines.kt.families.deepseek_v4.mtp import MARKER, V4DraftHead, add_draft_block, has_mtp_layer
from engines.kt.families.deepseek_v4.prefixes import PAGE
from engines.kt.families.dsml_chat import choose_encoder, install
from engines.kt.placement.operators import fuse_rms_norms

log = logging.getLogger("ktserve.engine.kt")


class DeepseekV4Family(ModelFamily):
    name = "deepseek_v4"
    model_types = ("deepseek_v4",)
    architectures = ("DeepseekV4ForCausalLM",)
    expert_layout = ExpertLayout(pattern=names.EXPERT, projections=names.PROJECTIONS, format="mxfp4",
                                 native_method="MXFP4")

    def default_rule_file(self, config: Any, gpus: int) -> str:
        return "DeepSeek-V4-Flash.yaml" if gpus else "DeepSeek-V4-CPU.yaml"

    def build_model(self, config: Any) -> nn.Module:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4ForCausalLM

        with torch.device("meta"):
            return DeepseekV4ForCausalLM(config)

    def checkpoint_name(self, name: str) -> str | None:
        return None if names.EXPERT.match(name) else names.module_name(name)

    def draft_names(self, name: str) -> str | None:
        return name.removeprefix("mtp.") if names.is_draft(name) else None

    # kt_gpu_prefill_tokens: prompt chunks stream the routed experts to the GPU from copies in host memory (the
    # released MXFP4 bytes for the MXFP4 method), of the first experts kt_gpu_prefill_memory holds; by default where
    # the host holds the copies.
    # Decode steps read a share of those copies on the GPU (kt_gpu_read_experts); without streaming, the GPU owns
    # that share instead (kt-kernel no longer holds it), the first kt_gpu_resident_experts of them in its own
    # memory; by default the measured balance of the two MXFP4 readers (engines/kt/experts/mapped.py). Streamed
    # prompts go in the families' chunks of 8,192 (experts/notes.py: STREAMED_CHUNK_SIZE), which a chunk's attention
    # and indexer scores hold in blocks of queries (blocks.py): a 32k-token prompt at V4-Flash's shape, 4 layers,
    # one H200 machine, took 2.44 s in them against 5.82 s in chunks of 2,048 (2.09 s in chunks of 16,384)

    def draft_layer(self, context: LoadContext) -> tuple[int | None, str | None]:
        spec, config = context.speculative, context.config
        if spec is None or spec.speculative != "mtp":
            return None, None
        if not has_mtp_layer(context.model_path):
            return None, (f"{context.model_path.name} has no multi-token-prediction layer ({MARKER} is not in "
                          "the checkpoint)")
        return config.num_hidden_layers, None

    def add_draft_layer(self, model: nn.Module, config: Any) -> None:
        add_draft_block(model, config)

    def load_weights(self, build: Any) -> CheckpointStorage:
        """The release's FP8 projections dequantized on their device, its MXFP4 experts as kt-kernel reads them;
        the rotary tables computed."""
        model, dtype = build.model, build.dtype
        _build_rotary_tables(model, build.config, build.placement.device_of_param)
        load_v4_checkpoint(model, build.context.model_path, build.placement.device_of_param, dtype,
                           draft_layer=build.draft_layer)
        methods = sorted({c.method for c in build.choices.values()})
        experts = ", ".join(f"{m} in place" if m == self.expert_layout.native_method else f"{m} from MXFP4"
                            for m in methods)
        build.details["expert_lora"] = _expert_lora(methods)
        return CheckpointStorage("safetensors, DeepSeek-V4 release: FP8 e4m3 in 128x128 blocks (UE8M0 scales), "
                                 "MXFP4 routed experts",
                                 (("experts", experts), ("the rest", f"{dtype_name(dtype)} from FP8")))

    def finish_model(self, build: Any) -> None:
        """Before the MTP block leaves the model (its hc modules and norms go with it) and before the graphs
        capture them: the weighted norms on the GPU as torch's fused rms_norm (three kernels, not eight), scaled in
        float32; the fused hyper-connections; the indexers' scores in blocks of queries (blocks.py)."""
        norms = fuse_rms_norms(build.model, upcast=True)
        hyper = install_fused_hyper_connections(build.model, build.dtype,
                                                enabled=build.kt.kt_fused_hyper_connections)
        install_blocked_scorers(build.model)
        build.details.update({
            "attention_backend": "torch (transformers' DeepSeek-V4 modules; a long prompt chunk's attention and "
                                 "indexer scores in blocks of queries)",
            "hyper_connections": hyper,
            "rms_norms": f"{norms} on the GPU fused (torch rms_norm, float32 scale)" if norms
            else "transformers' (none on a GPU)"})

    def take_draft_head(self, build: Any) -> Any:
        build.details["speculative"] = "mtp (mtp.0: sliding-window attention over its own cache per sequence)"
        return V4DraftHead.take(build.model)

    def make_runner(self, build: Any) -> tuple[Any, int]:
        from engines.kt.families.deepseek_v4.runner import V4ModelRunner  # transformers' V4 modules

        context, head = build.context, build.draft_head
        budget, max_len = _cache_budget(context, build.dtype, drafting=head is not None)
        build.details["v4_cache_budget"] = (f"{budget.capacity / 2**20:.1f} MiB: {budget.positions} positions among "
                                            f"up to {context.max_concurrent} sequences (kv_cache_tokens)")
        build.details["v4_prefix_cache"] = _prefix_cache_state(build.kt.prefix_cache, drafting=head is not None)
        build.details.update(_cache_layout(drafting=head is not None))
        return V4ModelRunner(build.model, max_len, budget, context.model_path, head=head,
                             draft_unavailable=build.no_draft, prefix_cache=build.kt.prefix_cache), max_len

    def finish_runner(self, build: Any, runner: Any) -> None:
        build.details["cuda_graphs"] = _capture_graphs(build.context, runner, build.gpu,
                                                       drafting=build.draft_head is not None,
                                                       chunk_size=build.prefill.chunk_size)

    def chat_encoder(self, model_path: Path, allow_checkpoint_code: bool = False) -> ChatEncoder | None:
        """The release's `encoding/encoding_dsv4.py` when the user allows running the model folder's code
        (trust_remote_code), else our implementation of the same format."""
        return choose_encoder(model_path, allow_checkpoint_code, V4ChatFormat(), ENCODER_FILE, takes_effort=True)

    def install_chat_encoder(self, tokenizer: Any, encoder: ChatEncoder) -> None:
        install(tokenizer, encoder)


def _cache_layout(drafting: bool) -> dict[str, str]:
    """What /version's details say of where V4's caches live and how a step's attention reads them."""
    from engines.kt.families.deepseek_v4.paged import PAGE as ENTRIES  # transformers' V4 modules

    if drafting:  # a verified draft takes its sequence's cache back: transformers' cache layers throughout
        return {"v4_caches": "per sequence (transformers DynamicCache; not paged while the MTP head drafts)",
                "v4_steps": "batched: a step's rows together, attention's cached part per sequence"}
    return {"v4_caches": f"prompts per sequence (transformers DynamicCache), then decode rows over paged caches "
                         f"(a slot per sequence, pages of {ENTRIES} compressed entries; the pools sized to the "
                         f"cache budget, at load under CUDA graphs, else at the first decode row)",
            "v4_steps": "batched: a step's rows together; decode rows' cached attention together, a prompt "
                        "chunk's per sequence"}


def _expert_lora(methods: list[str | None]) -> str:
    """Where routed-expert LoRA runs (engines/lora/cpu_experts.py): kt-kernel's MXFP4 SFT kernel on the released
    experts where every expert layer keeps them, else torch on the LoRA'd rows."""
    if methods == ["MXFP4"] and sft_kernel_class("MXFP4") is not None:
        return "kt-kernel MXFP4_SFT_MOE on the LoRA'd rows, base experts as released"
    return "torch on the LoRA'd rows, base experts in bf16"


def _prefix_cache_state(enabled: bool, drafting: bool) -> str:
    """What /version's details say of V4's prefix cache (prefixes.py)."""
    if not enabled:
        return "off: prefix_cache is off"
    if drafting:
        return "off: the MTP head drafts (its own caches are not kept with a prefix)"
    return (f"on: whole cache states at {PAGE}-position page boundaries (a prompt's last one and the end of what it "
            "shares with a prompt seen before), within the cache budget, least recently used dropped first")


def _capture_graphs(context: LoadContext, runner: Any, gpu: bool, drafting: bool, chunk_size: int) -> str:
    """Capture the row-wise segments of V4 steps in CUDA graphs where they can be (graphs.py); what the engine
    details say of it."""
    from engines.kt.families.deepseek_v4.graphs import step_graphs  # transformers' V4 modules


    if not context.options.kt_use_cuda_graph:
        return "none: kt_use_cuda_graph is off"
    if not gpu:
        log.info("kt_use_cuda_graph: no GPU in the placement; V4 steps run without CUDA graphs")
        return "none: no GPU in the placement"
    # the experts' stream-ordered path takes calls of up to chunk_size + max_concurrent rows; where the GPU owns
    # experts, calls past its kernels' reach bring them through the copy ring, which a graph does not capture
    rows = min(context.decode_rows(drafting), chunk_size + context.max_concurrent)
    if any(getattr(m, "owned", 0) for m in runner.model.modules()):
        rows = min(rows, MAPPED_MAX_TOKENS)
    runner.graphs, described = step_graphs(runner.model, runner.batch, rows, runner.max_model_len)
    return described


def _cache_budget(context: LoadContext, dtype: torch.dtype, drafting: bool) -> tuple[Any, int]:
    """The bytes V4's caches may hold, sized as the V3 runner sizes its KV pool (kv_cache_tokens positions among
    max_concurrent sequences), and the context served: no longer than those positions, nor than one sequence's
    caches reach within the bytes."""
    positions, max_len = context.kv_cache_tokens(), context.max_model_len
    budget = CacheBudget.sized(CacheBytes.of(context.config, dtype, draft_head=drafting), positions, max_len,
                               context.max_concurrent)
    reach = budget.sizes.positions_within(budget.capacity, positions)
    if reach < max_len:  # a request longer than the caches hold could never finish
        log.info("serving a context of %d tokens: V4's cache budget (kv_cache_tokens) holds no more", reach)
        max_len = reach
    return budget, max_len


def _build_rotary_tables(model: nn.Module, config: Any, device_of: Any) -> None:
    """The rotary tables are computed, not stored: rebuild every rotary module (the model's and each
    compressor's) on its device; they were made on the meta device with the model."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    for path, module in list(model.named_modules()):
        if isinstance(module, DeepseekV4RotaryEmbedding):
            with torch.device(device_of(f"{path}.main_inv_freq")):
                model.set_submodule(path, DeepseekV4RotaryEmbedding(config=config))
