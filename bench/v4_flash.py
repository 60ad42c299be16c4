"""`python -m bench.run --shape v4-flash`: DeepSeek-V4-Flash-shaped random checkpoint in the released layout
(hidden 4096, 256 MXFP4 experts top-6, FP8 + UE8M0 projections, V4-Flash's attention schedule), as many of its
43 layers as this host's disk and memory hold; then the KT engine (default rule file: V4-Flash.yaml on a GPU)
measures batch-1 decode, TTFT at 2k / 8k / 32k, 1 / 4 / 16 concurrent clients and host / GPU memory, and
scales the per-layer figures to 43 layers. Prints one JSON object (also written to --out).

The routed experts are random bytes (valid E2M1 codes, one UE8M0 scale per 32): the format is real, the
values meaningless, which costs nothing in speed."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import time
from pathlib import Path

import torch

FLASH_LAYERS = 43
FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4]  # 43 layers: V4-Flash's schedule (two sliding-window layers first)


def flash_config(layers: int) -> dict:
    from engines.demo_model_v4 import demo_config_v4

    return demo_config_v4(hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=layers,
                          num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8,
                          o_lora_rank=1024, n_routed_experts=256, num_experts_per_tok=6, num_hash_layers=3,
                          compress_ratios=FLASH_RATIOS[:layers], sliding_window=128, index_n_heads=64,
                          index_head_dim=128, index_topk=512)


def layer_bytes(config: dict) -> int:
    """On disk, one layer: MXFP4 experts (half a byte a weight plus a scale per 32) and ~0.35 GB of the rest."""
    experts = config["n_routed_experts"] * 3 * config["hidden_size"] * config["moe_intermediate_size"]
    return int(experts * (0.5 + 1 / 32)) + 350_000_000


def expert_bytes_per_token(config: dict) -> int:
    """Host-memory bytes one decoded token reads from the routed experts: top-k MXFP4 experts (half a byte a
    weight and a UE8M0 scale per 32) of every layer (V4's layers are all MoE, hash-routed ones too)."""
    weights = config["num_experts_per_tok"] * 3 * config["hidden_size"] * config["moe_intermediate_size"]
    return int(config["num_hidden_layers"] * weights * (0.5 + 1 / 32))


def layers_that_fit(out: Path) -> int:
    from engines.kt.experts.methods import memory_available

    per_layer = layer_bytes(flash_config(1))
    disk = shutil.disk_usage(out.parent if not out.exists() else out).free
    memory = memory_available() or disk
    return max(1, min(FLASH_LAYERS, int(0.7 * min(disk, memory) / per_layer)))


class RandomExpertsV4:
    """V4Weights with the routed experts drawn as random packed bytes, written shard by shard (one per layer)."""

    def __init__(self, config: dict, out: Path):
        from engines.demo_model_v4 import V4Weights

        self.config, self.out = config, out
        self.weights = V4Weights(config, seed=0)
        self.weights.moe = self._moe  # type: ignore[method-assign]
        self.map: dict[str, str] = {}

    def _moe(self, p: str, hashed: bool) -> None:
        c, w = self.config, self.weights
        hidden, inter, experts = c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"]
        w.plain(f"{p}.gate.weight", w.normal(experts, hidden, std=hidden ** -0.5), torch.bfloat16)
        if hashed:
            w.plain(f"{p}.gate.tid2eid", torch.randint(0, experts, (c["vocab_size"], c["num_experts_per_tok"]),
                                                       generator=w.gen), torch.int32)
        else:
            w.plain(f"{p}.gate.bias", torch.zeros(experts))
        for e in range(experts):
            for proj, (n, k) in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
                w.out[f"{p}.experts.{e}.{proj}.weight"] = torch.randint(-128, 128, (n, k // 2), dtype=torch.int8,
                                                                        generator=w.gen)
                w.out[f"{p}.experts.{e}.{proj}.scale"] = torch.full((n, k // 32), 120, dtype=torch.uint8).view(
                    torch.float8_e8m0fnu)
        w.fp8(f"{p}.shared_experts.w1", inter, hidden)
        w.fp8(f"{p}.shared_experts.w3", inter, hidden)
        w.fp8(f"{p}.shared_experts.w2", hidden, inter)

    def _flush(self, name: str) -> None:
        from safetensors.torch import save_file

        save_file(self.weights.out, str(self.out / name), metadata={"format": "pt"})
        self.map.update(dict.fromkeys(self.weights.out, name))
        self.weights.out = {}

    def write(self) -> None:
        from engines.demo_model import _write_json, _write_tokenizer

        c, w = self.config, self.weights
        self.out.mkdir(parents=True, exist_ok=True)
        _write_json(self.out / "config.json", c)
        _write_tokenizer(self.out)
        hidden, vocab = c["hidden_size"], c["vocab_size"]
        w.plain("embed.weight", w.normal(vocab, hidden, std=1.0), torch.bfloat16)
        w.plain("norm.weight", torch.ones(hidden))
        w.hyper_head("hc_head")
        w.plain("head.weight", w.normal(vocab, hidden, std=8.0 / math.sqrt(hidden)), torch.bfloat16)
        self._flush("model-head.safetensors")
        for i in range(c["num_hidden_layers"]):
            w.block(f"layers.{i}", i)
            self._flush(f"model-layer-{i:03d}.safetensors")
        _write_json(self.out / "model.safetensors.index.json", {"metadata": {}, "weight_map": self.map})


def _checkpoint(args: argparse.Namespace) -> tuple[Path, dict, float]:
    """The benchmark checkpoint (written unless one of the same config is there), its config, the seconds writing
    it took. `--quick`: the tiny demo V4's dimensions on Flash's schedule of attention kinds, 4 layers (a CPU check
    of the phases, not a measurement)."""
    from engines.demo_model_v4 import demo_config_v4

    name = "v4-flash-quick" if args.quick else "v4-flash"
    root = Path(args.model_dir) if args.model_dir else Path("/tmp/ktserve-bench") / name
    if args.quick:
        layers = args.v4_layers or 4
        config = demo_config_v4(num_hidden_layers=layers, compress_ratios=FLASH_RATIOS[:layers])
    else:
        config = flash_config(args.v4_layers or layers_that_fit(root))
    marker = root / "config.json"
    # the index is written last: a build cut short (a timeout) leaves none and is written again
    done = (root / "model.safetensors.index.json").is_file()
    if done and marker.is_file() and json.loads(marker.read_text()) == config:
        return root, config, 0.0
    shutil.rmtree(root, ignore_errors=True)
    for variant in root.parent.glob(f"{root.name}-mtp-*"):  # MTP variants link the old shards (bench/mtp.py)
        shutil.rmtree(variant, ignore_errors=True)
    started = time.perf_counter()
    RandomExpertsV4(config, root).write()
    return root, config, time.perf_counter() - started


def _memory() -> dict:
    import resource

    out = {"host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}
    if torch.cuda.is_available():
        out["gpu_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return out


def run(args: argparse.Namespace) -> dict:
    from bench.lib.engine_runs import generate, step_breakdown
    from bench.lib.shapes import prompt_ids
    from engines.base import EngineConfig
    from engines.kt.engine import KTEngine
    from engines.kt.experts.cpuinfer import default_cpu_threads

    root, config, built = _checkpoint(args)
    layers = config["num_hidden_layers"]
    if args.only and "mtp" in args.phases:  # speculative decoding with the MTP layer only (bench/mtp.py)
        from bench.mtp import measure_v4

        out = Path(args.out) if args.out else root.parent / "results"
        return {"build_s": built, "mtp": measure_v4(root, config, args.threads, out,
                                                    time.perf_counter() + (args.budget or 1800))}
    engine = KTEngine(EngineConfig(model_path=str(root), model_name="bench-v4-flash", max_concurrent=16,
                                   max_model_len=33000, chunk_size=2048,
                                   settings={"kt_use_cuda_graph": getattr(args, "cuda_graph", True),
                                             **({"cpu_infer": args.threads} if args.threads else {}),
                                             # --gpu-prefill-tokens N: prompt chunks stream the experts to the GPU
                                             # (0: never; None: the engine's default)
                                             "kt_gpu_prefill_tokens": getattr(args, "gpu_prefill_tokens", None),
                                             **getattr(args, "settings", {})}))
    started = time.perf_counter()
    engine.start()
    load_s = time.perf_counter() - started
    vocab, deadline = config["vocab_size"], time.perf_counter() + (args.budget or 1800)
    results: dict = {"shape": "v4-flash", "layers": layers, "build_s": built, "load_s": load_s,
                     # what the engine runs with: N, or "0: why not"
                     "kt_gpu_prefill_tokens": engine.info.details.get("gpu_prefill_tokens"),
                     "engine_details": dict(engine.info.details),
                     "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}

    def once(prompt_len: int, tokens: int, clients: int = 1) -> dict:
        async def many():
            return await asyncio.gather(*(generate(engine, prompt_ids(prompt_len, vocab, seed=prompt_len + i),
                                                   tokens, deadline) for i in range(clients)))
        gens = asyncio.run(many())
        def value(figure: dict | None) -> float | None:
            """A bench figure in seconds (they come in s or ms)."""
            if not isinstance(figure, dict) or figure.get("value") is None:
                return None
            return figure["value"] / (1000.0 if figure.get("unit") == "ms" else 1.0)

        after = engine.stats()
        figures = [g.figures() for g in gens]
        decode = [1.0 / value(f["tpot_median"]) for f in figures if value(f.get("tpot_median"))]
        out = {"clients": clients, "prompt_tokens": prompt_len, "ttft_s": value(figures[0]["ttft"]),
               "decode_tok_s_per_client": sum(decode) / len(decode) if decode else None,
               "decode_tok_s_total": sum(decode) if decode else None}
        if clients == 1 and gens[0].stats_at_first_token is not None:
            # the decode steps' wall time and what came after the forward (sampling, delivery); the V4 runner does
            # not time its GPU and expert parts (`python -m bench.v4_trace` does)
            steps = step_breakdown(gens[0].stats_at_first_token, after).get("step_breakdown", {})
            out["step_breakdown"] = {k: steps[k] for k in ("steps", "step", "after_forward") if k in steps}
        return out

    results["decode_batch1"] = once(64, 32)
    results["ttft"] = [once(n, 2) for n in (2048, 8192) if time.perf_counter() < deadline]
    results["clients"] = [once(256, 32, n) for n in (1, 4, 16) if time.perf_counter() < deadline]
    # the 32k prompt last, and only where the budget holds it: prefill time grows with the prompt, so it is
    # expected at the 8k prompt's time x 4 (on an H200 at 4 layers that was 135 s, which used to leave the
    # client rounds no time)
    longest = next((t for t in reversed(results["ttft"]) if t["ttft_s"]), None)
    expected = longest["ttft_s"] * 32768 / longest["prompt_tokens"] if longest else None
    if expected is not None and time.perf_counter() + expected < deadline:
        results["ttft"].append(once(32768, 2))
    else:
        results["skipped"] = {"ttft_32768": "budget" if expected is None else
                              f"expected ~{expected:.0f} s, more than the budget's remaining time"}
    results["memory"] = _memory()
    results["read_ceiling"] = read_ceiling(config, args.threads or default_cpu_threads(),
                                           results["decode_batch1"]["decode_tok_s_per_client"],
                                           nbytes=(64 << 20) if args.quick else (2 << 30))
    per_token = results["decode_batch1"]["decode_tok_s_per_client"]
    if per_token:  # decode time grows with layers: scale the time per token, not the rate
        results["decode_batch1_scaled_to_43_layers_tok_s"] = per_token * layers / FLASH_LAYERS
    results["ttft_scaled_to_43_layers_s"] = [{"prompt_tokens": p["prompt_tokens"],
                                              "ttft_s": p["ttft_s"] * FLASH_LAYERS / layers if p["ttft_s"] else None}
                                             for p in results["ttft"]]
    graphs = engine._runner.graphs
    results["steps_from_cuda_graphs"] = graphs.replayed if graphs is not None else 0
    engine.stop()
    return results


def read_ceiling(config: dict, threads: int, decode_tok_s: float | None, nbytes: int = 2 << 30) -> dict:
    """Batch-1 decode against the host's read-bandwidth ceiling for the expert bytes a token reads (the issue's
    target: >= 85%); the same figures for all 43 of V4-Flash's layers."""
    from bench.lib.bandwidth import measure_host_bandwidth

    bandwidth = measure_host_bandwidth(threads, nbytes)
    read = bandwidth["read_bandwidth"]["value"] * 1e9
    per_token = expert_bytes_per_token(config)
    ceiling = read / per_token
    flash = expert_bytes_per_token({**config, "num_hidden_layers": FLASH_LAYERS})
    return {**bandwidth, "expert_bytes_per_token_gb": per_token / 1e9, "ceiling_tok_s": ceiling,
            "fraction_of_ceiling": decode_tok_s / ceiling if decode_tok_s else None,
            "expert_bytes_per_token_gb_43_layers": flash / 1e9, "ceiling_tok_s_43_layers": read / flash}


def _streams(detail: str | None) -> bool:
    """Whether the engine detail gpu_prefill_tokens ("N", or "0: why not") says prompt chunks stream experts."""
    return (detail or "0").split(":")[0].strip() != "0"


def main(args: argparse.Namespace) -> int:
    from bench.lib.report import print_and_write

    results = run(args)
    name = ("v4-flash-mtp" if "mtp" in results else
            "v4-flash-streamed" if _streams(results.get("kt_gpu_prefill_tokens")) else "v4-flash")
    print_and_write(results, args.out, f"{name}.json")
    return 0
