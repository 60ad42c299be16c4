"""KT-SFT DeepSeek-V4 adapters served per request: the folder KT-SFT writes (PEFT LoRA on the non-expert
projections, the fused routed-expert LoRA, kt_adapter_manifest.json bound to the source checkpoint; built in
tests/engines/kt/families/deepseek_v4/v4_lora_helpers.py) loaded at run time into the tiny V4 server, checked against
transformers' `DeepseekV4ForCausalLM` with the LoRA merged into the dequantized weights."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_error
from .v4_helpers import reference_logprobs, v4_reference_model
from .v4_lora_helpers import V4_LORA_MEDIAN_TOLERANCE, V4_LORA_TOLERANCE, make_kt_sft_v4_adapter, merged_reference

ROOT = Path(__file__).resolve().parents[5]
PROMPT = ("The old lighthouse keeper counted the ships that passed each night, writing their names in a "
          "leather book whose pages had turned yellow with salt and time. ") * 5
OTHER_PROMPT = "Seventeen ravens sat on the fence behind the mill, and the miller's daughter gave each a name. " * 3


def post(server, path, body):
    with server.http() as http:
        return http.post(path, json=body)


@pytest.fixture(scope="module")
def kt_adapters(v4_server, v4_model_dir, v4_adapter_root):
    """Adapters "v4-a" and "v4-b" (different random weights) loaded through /v1/load_lora_adapter."""
    for name, seed in (("v4-a", 1), ("v4-b", 2)):
        make_kt_sft_v4_adapter(v4_model_dir, v4_adapter_root / name, seed=seed)
        r = post(v4_server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(v4_adapter_root / name)})
        assert r.status_code == 200, r.text
    return v4_adapter_root


def complete(server, model, prompt, **kwargs):
    return server.openai().completions.create(model=model, prompt=prompt, temperature=0, **kwargs)


def prompt_logprobs(server, model, ids):
    reply = complete(server, model, ids, max_tokens=0, echo=True, logprobs=1)
    return reply.choices[0].logprobs.token_logprobs


def test_kt_sft_v4_adapter_logprobs_match_the_merged_reference(v4_server, v4_model_dir, kt_adapters):
    ids = v4_server.engine.tokenizer.encode(PROMPT)
    served = prompt_logprobs(v4_server, "v4-a", ids)
    merged = reference_logprobs(merged_reference(v4_model_dir, kt_adapters / "v4-a"), ids)
    base = reference_logprobs(v4_reference_model(v4_model_dir), ids)
    diffs = [abs(served[i] - float(merged[i - 1, ids[i]])) for i in range(1, len(ids))]
    moved = [abs(float(base[i - 1, ids[i]] - merged[i - 1, ids[i]])) for i in range(1, len(ids))]
    print("DIFFS", sorted(diffs)[-8:], sorted(diffs)[len(diffs)//2], len(diffs), max(moved))
    print(f"\nadapter v4-a against the merged reference: median {statistics.median(diffs):.4f} max {max(diffs):.4f}; "
          f"the adapter moves them by median {statistics.median(moved):.4f} max {max(moved):.4f}")
    assert statistics.median(diffs) < V4_LORA_MEDIAN_TOLERANCE and max(diffs) < V4_LORA_TOLERANCE
    # the adapter moves the logprobs far beyond the tolerance
    assert statistics.median(moved) > 10 * V4_LORA_MEDIAN_TOLERANCE and max(moved) > 3 * V4_LORA_TOLERANCE


def test_kt_sft_v4_adapter_card_says_where_its_expert_lora_runs(v4_server, kt_adapters):
    cards = {m["id"]: m for m in v4_server.openai().models.list().model_dump()["data"]}
    assert cards["v4-a"]["parent"] == v4_server.engine.info.id
    assert cards["v4-a"]["expert_lora"] == "kt-kernel MXFP4_SFT_MOE"  # every build has it


def test_two_kt_sft_adapters_and_the_base_in_one_batch_each_match_their_solo_runs(v4_server, kt_adapters):
    """Requests with logprobs are batch-invariant by default: text and logprobs are their solo runs' bit for bit."""
    jobs = [("v4-a", PROMPT), ("v4-b", PROMPT), (v4_server.engine.info.id, PROMPT), ("v4-b", OTHER_PROMPT)]

    def run(job):
        choice = complete(v4_server, job[0], job[1], max_tokens=6, logprobs=0).choices[0]
        return choice.text, choice.logprobs.token_logprobs

    solo = [run(job) for job in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(run, jobs))
    assert together == solo
    assert len({solo[0][0], solo[1][0], solo[2][0]}) == 3  # each adapter, and the base, writes its own text


def test_kt_sft_v4_adapter_unloads_and_reloads(v4_server, kt_adapters):
    before = complete(v4_server, "v4-b", OTHER_PROMPT, max_tokens=6).choices[0].text
    assert post(v4_server, "/v1/unload_lora_adapter", {"lora_name": "v4-b"}).status_code == 200
    assert_error(post(v4_server, "/v1/completions", {"model": "v4-b", "prompt": "Hi", "max_tokens": 1}), 404)
    r = post(v4_server, "/v1/load_lora_adapter", {"lora_name": "v4-b", "lora_path": str(kt_adapters / "v4-b")})
    assert r.status_code == 200, r.text
    assert complete(v4_server, "v4-b", OTHER_PROMPT, max_tokens=6).choices[0].text == before


def test_kt_sft_manifest_bound_to_another_checkpoint_is_refused_naming_both(v4_server, v4_model_dir,
                                                                             v4_adapter_root):
    other = v4_adapter_root.parent / "other-v4"  # the same shards (linked) under another config.json
    other.mkdir()
    for item in v4_model_dir.iterdir():  # symbolic links: a hard link would change the shards' ctime
        if item.suffix == ".safetensors":
            (other / item.name).symlink_to(item)
        elif item.is_file():
            shutil.copy(item, other)
    (other / "config.json").write_text(json.dumps({**json.loads((v4_model_dir / "config.json").read_text()),
                                                   "rope_theta": 50000.0}))
    make_kt_sft_v4_adapter(v4_model_dir, v4_adapter_root / "foreign", seed=3, base_path=other)
    r = post(v4_server, "/v1/load_lora_adapter", {"lora_name": "foreign",
                                                  "lora_path": str(v4_adapter_root / "foreign")})
    message = assert_error(r, 400, "lora_path")["message"]
    assert str(other.resolve()) in message and str(v4_model_dir) in message
    assert "foreign" not in {m.id for m in v4_server.openai().models.list().data}


def test_kt_sft_manifest_refuses_an_adapter_file_changed_after_training(v4_server, v4_model_dir, v4_adapter_root):
    changed = make_kt_sft_v4_adapter(v4_model_dir, v4_adapter_root / "changed", seed=4)
    make_kt_sft_v4_adapter(v4_model_dir, v4_adapter_root / "seed-5", seed=5)
    shutil.copy(v4_adapter_root / "seed-5" / "fused_expert_lora.safetensors", changed)
    r = post(v4_server, "/v1/load_lora_adapter", {"lora_name": "changed", "lora_path": str(changed)})
    assert "fused_expert_lora.safetensors" in assert_error(r, 400, "lora_path")["message"]


def test_kt_sft_v4_adapter_on_the_avx2_build_matches_the_merged_reference(v4_model_dir, kt_adapters):
    """kt-kernel's avx2 build in a child process: prompt chunks then decode steps, with adapter v4-a."""
    env = {**os.environ, "KT_KERNEL_CPU_VARIANT": "avx2", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "tests.engines.kt.families.deepseek_v4.v4_helpers",
                          str(v4_model_dir), "36", str(kt_adapters / "v4-a")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    measured = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    assert measured["variant"] == "avx2"
    assert measured["max_diff"] < V4_LORA_TOLERANCE


def test_kt_sft_manifest_accepts_a_copy_of_its_checkpoint_that_its_cache_manifest_vouches_for(v4_model_dir,
                                                                                              tmp_path):
    """A copy has other inodes, so kt-kernel's fingerprint differs; KT-SFT's non-expert cache manifest still
    records the portable identity (hashes, sizes, sampled payload) of the files it was trained on."""
    from engines.lora import kt_manifest

    recorded = kt_manifest.native_identity(v4_model_dir, with_files=True)
    recorded["shards"] = [{**s, "file_identity": {"device": 1, "inode": 2, "ctime_ns": 3}} for s in recorded["shards"]]
    (tmp_path / "kt_non_expert_manifest.json").write_text(json.dumps(
        {"source": {"model_name_or_path": "/elsewhere/DeepSeek-V4-Flash", "fingerprint": "f" * 64,
                    "identity": recorded}}))
    binding = kt_manifest.CheckpointBinding("kt_adapter_manifest.json", "/elsewhere/DeepSeek-V4-Flash", "f" * 64,
                                            str(tmp_path / "kt_non_expert_manifest.json"), 4, 8.0)
    kt_manifest.check(binding, v4_model_dir, "adapter")  # accepted: the same files
    recorded["config_sha256"] = "0" * 64
    (tmp_path / "kt_non_expert_manifest.json").write_text(json.dumps(
        {"source": {"fingerprint": "f" * 64, "identity": recorded}}))
    with pytest.raises(ValueError, match="/elsewhere/DeepSeek-V4-Flash"):
        kt_manifest.check(binding, v4_model_dir, "adapter")


def test_the_mxfp4_sft_kernel_keeps_none_of_the_released_bytes_it_was_loaded_from():
    """kt-kernel's MXFP4_SFT_MOE copies a layer's experts in at load (both builds), which is why the expert-LoRA
    backend frees the bytes it re-read (engines/lora/cpu_experts.py); with no LoRA it computes what the layer's
    MXFP4 kernel does."""
    from engines.lora.cpu_experts import SFTKernelBackend
    from .test_v4_streamed_experts import RELATIVE_TOLERANCE, mxfp4_layer, relative, released_layer, routing

    packed, _ = released_layer()
    layer = mxfp4_layer()
    layer.load_packed(packed)
    layer.packed_reader = lambda: packed
    kernel, config = layer.sft_kernel()
    assert kernel.__name__ == "MXFP4_SFT_MOE"
    backend = SFTKernelBackend(layer, kernel, config, rank=8)
    hidden, ids, weights = routing()
    before = backend.run(backend._zeros, hidden, ids, weights)
    assert relative(before, layer(hidden, ids, weights).float()) < RELATIVE_TOLERANCE
    for tensor in packed.values():
        tensor.zero_()
    assert backend._keep == () and torch.equal(backend.run(backend._zeros, hidden, ids, weights), before)


def test_the_mxfp4_sft_kernel_computes_lora_d_rows_as_float32_torch_does_up_to_its_bf16_products():
    """The served path (kt-kernel's MXFP4_SFT_MOE) against the float32 one it replaced (torch on the same base
    experts, V4's clamp), for a LoRA on all three projections. Measured (2026-11-28, E=20 256 x 128, rank 8, 40
    rows): per-row relative difference median 0.44% / max 0.52% on the avx512_bf16 build, 0.32% / 0.38% on avx2;
    the LoRA itself moves the rows by 87% (median)."""
    from engines.lora.cpu_experts import SFTKernelBackend, TorchBackend
    from .test_v4_streamed_experts import E, H, I, mxfp4_layer, released_layer, routing

    packed, dense = released_layer()
    layer = mxfp4_layer()
    layer.load_packed(packed)
    layer.packed_reader = lambda: packed
    layer.base_reader = lambda first=None: (dense["gate"], dense["up"], dense["down"])
    g = torch.Generator().manual_seed(7)
    updates = {p: (torch.randn(E, 8, k, generator=g) * 0.1, torch.randn(E, n, 8, generator=g) * 0.1, 1.0)
               for p, (n, k) in {"gate": (I, H), "up": (I, H), "down": (H, I)}.items()}
    sft, torch_path = SFTKernelBackend(layer, *layer.sft_kernel(), rank=8), TorchBackend(layer)
    hidden, ids, weights = routing()
    got = sft.run(sft.adopt(updates), hidden, ids, weights)
    expected = torch_path.run(torch_path.adopt(updates), hidden, ids, weights)
    base = torch_path.run({}, hidden, ids, weights)
    per_row = (got - expected).norm(dim=-1) / expected.norm(dim=-1)
    moved = (expected - base).norm(dim=-1) / base.norm(dim=-1)
    print(f"\nMXFP4_SFT_MOE against float32 torch: per-row relative median {per_row.median():.4f} max "
          f"{per_row.max():.4f}; the LoRA moves the rows by median {moved.median():.3f}")
    assert per_row.max() < 2e-2 and moved.median() > 0.1
