"""The tiny DeepSeek-V4 of the tests and its reference: transformers' `DeepseekV4ForCausalLM` in float32 on the
dequantized weights, loaded here independently of the engine's loader (names mapped by kt-kernel's own
`canonical_non_expert_key`, FP8 blocks decoded by kt-kernel's `dequantize_fp8_blocks`)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

# Served logprobs vs the float32 reference: kt-kernel computes the experts with bf16 activations, and the
# served model keeps the non-expert weights in float32 on the CPU. Measured: 0.050 over 150 positions (prompt
# chunks of 50, then decode steps) on both the avx512_bf16 and avx2 builds.
V4_LOGPROB_TOLERANCE = 0.1


def v4_reference_model(model_dir: Path):
    from kt_kernel.sft.deepseek_v4 import canonical_non_expert_key, dequantize_fp8_blocks
    from transformers import AutoConfig
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4ForCausalLM, DeepseekV4RotaryEmbedding

    from engines.checkpoints.mxfp4 import dequantize

    config = AutoConfig.from_pretrained(model_dir)
    tensors = shard_tensors(model_dir)
    state: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str, int], torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.startswith("mtp.") or name.endswith(".scale"):
            continue
        parts = name.split(".")
        if ".ffn.experts." in name:
            layer, expert, proj = int(parts[1]), int(parts[4]), parts[5]
            experts[(layer, proj, expert)] = dequantize(tensor, tensors[name[:-len("weight")] + "scale"], torch.float32)
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = dequantize_fp8_blocks(tensor, tensors[name[:-len("weight")] + "scale"])
        state[canonical_non_expert_key(name)] = tensor.float() if tensor.is_floating_point() else tensor.long()
    for layer in range(config.num_hidden_layers):
        def stack(proj: str) -> torch.Tensor:
            return torch.stack([experts[(layer, proj, e)] for e in range(config.n_routed_experts)])
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([stack("w1"), stack("w3")], dim=1)
        state[f"model.layers.{layer}.mlp.experts.down_proj"] = stack("w2")
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise AssertionError(f"reference load: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for path, module in list(model.named_modules()):
        if isinstance(module, DeepseekV4RotaryEmbedding):
            model.set_submodule(path, DeepseekV4RotaryEmbedding(config=config))
    return model.float().eval()


def shard_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint, by its name as stored."""
    from safetensors.torch import load_file

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(model_dir / shard)))
    return out


def reference_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log-softmax of one full forward pass: row i predicts token i + 1."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def load_v4_runner(model_dir: Path, max_concurrent: int = 2):
    """The KT engine's V4 runner for `model_dir`, loaded as the engine loads it, with the CPU rule file."""
    from transformers import AutoConfig

    from engines.kt.engine import RULES_DIR
    from engines.kt.families import family_for
    from engines.kt.families.base import LoadContext
    from engines.kt.options import KTOptions
    from engines.kt.placement.rules import load_rules

    config = AutoConfig.from_pretrained(model_dir)
    rule_file = RULES_DIR / "DeepSeek-V4-CPU.yaml"
    context = LoadContext(model_path=model_dir, config=config, rule_file=rule_file, rules=load_rules(rule_file),
                          max_model_len=1024, max_concurrent=max_concurrent, chunk_size=256, dtype_setting="auto",
                          options=KTOptions(cpu_infer=1))
    return family_for(config).load(context).runner


def runner_sequence(token_ids: list[int], adapter: str | None = None) -> SimpleNamespace:
    """What a runner reads of a scheduled sequence: its tokens, its request's adapter, its runner state."""
    return SimpleNamespace(token_ids=token_ids, runner_state=None, request=SimpleNamespace(adapter=adapter))


def served_logprobs(model_dir: Path, token_ids: list[int], chunks: list[int], adapter: Path | None = None
                    ) -> torch.Tensor:
    """log-softmax of the KT engine's V4 runner fed `token_ids` in prompt chunks of `chunks` tokens, then one
    token a step (as decoding feeds it): row i predicts token i + 1. Loads the model as the engine does, with
    the CPU rule file; with `adapter`, that adapter directory is installed and applied."""
    from engines.runtime.model_runner import ScheduledChunk

    runner = load_v4_runner(model_dir)
    if adapter is not None:
        from engines.lora import read_adapter

        runner.lora.install("adapter", runner.lora.prepare(read_adapter(adapter)))
    seq = runner_sequence(token_ids, None if adapter is None else "adapter")
    sizes = chunks + [1] * (len(token_ids) - sum(chunks))
    rows, start = [], 0
    for n in sizes:
        rows.append(runner.execute([ScheduledChunk(seq=seq, start=start, end=start + n, all_logits=True)])[0])
        start += n
    return torch.log_softmax(torch.cat(rows).float(), dim=-1)


def max_next_token_diff(served: torch.Tensor, reference: torch.Tensor, token_ids: list[int]) -> float:
    """The largest |served - reference| logprob of the tokens that actually follow."""
    following = torch.tensor(token_ids[1:])[:, None]
    return float((served[:-1].gather(1, following) - reference[:-1].gather(1, following)).abs().max())


if __name__ == "__main__":  # run in a child process under another kt-kernel build: prints the measured diff
    import sys

    directory, count = Path(sys.argv[1]), int(sys.argv[2])
    adapter = Path(sys.argv[3]) if len(sys.argv) > 3 else None  # a KT-SFT adapter: compared with it merged
    ids = torch.randint(100, 120000, (count,), generator=torch.Generator().manual_seed(0)).tolist()
    served = served_logprobs(directory, ids, [count // 3, count // 3], adapter)
    if adapter is None:
        reference = reference_logprobs(v4_reference_model(directory), ids)
    else:
        from v4_lora_helpers import merged_reference

        reference = reference_logprobs(merged_reference(directory, adapter), ids)
    import kt_kernel

    print(json.dumps({"variant": kt_kernel.__cpu_variant__, "max_diff": max_next_token_diff(served, reference, ids),
                      "top1_agree": float((served.argmax(-1) == reference.argmax(-1)).float().mean())}))
