"""python -m bench.multi_gpu: the KT engine with a DeepSeek-V3-architecture model split over two GPUs by a rule
file, next to the same model on one GPU.

    python -m bench.multi_gpu --out results/ [--layers 20] [--experts 8] [--gpu-budget-gib 10] [--budget 300]

The model has V3's hidden sizes (7168 hidden, 128 MLA heads, q/kv LoRA ranks 1536/512, dense FFN 18432,
expert FFN 2048, 129k vocabulary) with fewer layers and routed experts, so that it builds in seconds. Its
non-expert weights (what the GPUs hold) are larger than the per-GPU budget: on two GPUs each process-wide
allocator is capped at the budget (torch.cuda.set_per_process_memory_fraction) and the layers are split so
each half fits; on one GPU the model runs uncapped, which is the reference it is compared with.

Reported per run (2 GPUs, then 1 GPU): load time, decode tok/s at batch 1 (and, on one GPU, the same with
its CUDA graphs put aside, since a split model decodes without them), TTFT at 512 and 2048 prompt tokens,
and per-GPU peak memory. Everything is bounded: counts are fixed and each phase stops at its deadline;
multi_gpu.json is rewritten after each phase."""
from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.lib.report import fig  # noqa: E402

GiB = 1024 ** 3
DECODE_PROMPT, DECODE_TOKENS = 128, 64
TTFT_PROMPTS, TTFT_TOKENS = (512, 2048), 8
# expected seconds on the nvidia-h200-x2 machine at the default size: a phase is skipped when less is left
ESTIMATES = {"build": 60, "first_load": 60, "cached_load": 30, "decode": 15, "ttft": 15}


def v3_config(layers: int, experts: int, top_k: int) -> dict:
    """DeepSeek-V3's config at its real widths, with `layers` layers (the first dense) and `experts` routed
    experts, `top_k` of them per token (one routing group)."""
    from engines.kt.families.deepseek_mla.demo_model import demo_config

    return demo_config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=layers, first_k_dense_replace=1, n_routed_experts=experts, num_experts_per_tok=top_k,
        n_shared_experts=1, n_group=1, topk_group=1, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})


def gpu_bytes(config: dict) -> dict[str, int]:
    """Bytes of what the GPUs hold (everything but the routed experts), per part: "head" (embeddings or
    final norm + LM head), "layer.N"."""
    from bench.lib.checkpoint import tensor_specs

    parts: dict[str, int] = {}
    for name, shape, init, _ in tensor_specs(config):
        if ".mlp.experts." in name:
            continue
        key = ".".join(name.split(".")[1:3]) if name.startswith("model.layers.") else "ends"
        parts[key] = parts.get(key, 0) + math.prod(shape) * (4 if init == "bias" else 2)
    return parts


def split_point(config: dict) -> tuple[int, list[int]]:
    """The first layer of the second GPU that balances the two GPUs' weights, and those bytes."""
    parts = gpu_bytes(config)
    layers = [parts[f"layers.{i}"] for i in range(config["num_hidden_layers"])]
    half_ends = parts["ends"] / 2  # embeddings on the first GPU, final norm + LM head on the second
    best = min(range(1, len(layers)), key=lambda s: max(half_ends + sum(layers[:s]), half_ends + sum(layers[s:])))
    return best, [int(half_ends + sum(layers[:best])), int(half_ends + sum(layers[best:]))]


def two_gpu_rules(config: dict, first_of_second: int) -> str:
    """A rule file in our vocabulary: embeddings + layers [0, s) on cuda:0, the rest + norm + head on cuda:1."""
    second = "|".join(str(i) for i in range(first_of_second, config["num_hidden_layers"]))
    return f"""# Written by bench/multi_gpu.py: layers 0-{first_of_second - 1} on cuda:0, the rest on cuda:1.
- match:
    name: '^$'
  replace:
    class: default
    kwargs:
      device: "cuda:0"
- match:
    name: '^model\\.layers\\.({second})$|^model\\.norm$|^lm_head$'
  replace:
    class: default
    kwargs:
      device: "cuda:1"
- match:
    name: '^model\\.layers\\.\\d+\\.mlp$'
    class: transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE
  replace:
    class: engines.kt.placement.operators.MoEWithCPUExperts
  recursive: false
- match:
    name: '^model\\.layers\\.\\d+\\.self_attn$'
    class: transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention
  replace:
    class: engines.kt.placement.operators.MLAAttention
  recursive: false
"""


def model_root(size: int) -> Path:
    """/dev/shm when it has room (nothing to flush to disk), else $KTSERVE_BENCH_DIR or /tmp."""
    for root in (Path("/dev/shm"), Path(os.environ.get("KTSERVE_BENCH_DIR") or "/tmp")):
        if root.exists() and shutil.disk_usage(root).free > 2.2 * size:  # checkpoint + quantized experts
            return root / "ktserve-bench-multi-gpu"
    return Path(os.environ.get("KTSERVE_BENCH_DIR") or "/tmp") / "ktserve-bench-multi-gpu"


def gpu_memory(gpus: int) -> dict:
    torch.cuda.synchronize()
    return {f"cuda:{i}": {"peak_allocated": fig(torch.cuda.max_memory_allocated(i) / 1e9, "GB"),
                          "peak_reserved": fig(torch.cuda.max_memory_reserved(i) / 1e9, "GB"),
                          "allocated_now": fig(torch.cuda.memory_allocated(i) / 1e9, "GB")} for i in range(gpus)}


class MultiGpuBench:
    def __init__(self, args: argparse.Namespace):
        from engines.kt.experts.cpuinfer import default_cpu_threads

        self.args = args
        self.started = time.perf_counter()
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / "multi_gpu.json"
        self.config = v3_config(args.layers, args.experts, args.top_k)
        self.threads = args.threads or default_cpu_threads()
        self.gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.data: dict = {"meta": {"gpus": self.gpus, "gpu": torch.cuda.get_device_name(0) if self.gpus else None,
                                    "kt_threads": self.threads, "method": args.method, "budget": fig(args.budget, "s"),
                                    "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")},
                           "phases": {}}
        self.vocab = self.config["vocab_size"]

    # ------------------------------------------------------------------------------------ helpers
    def remaining(self) -> float:
        return self.args.budget - (time.perf_counter() - self.started)

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)

    def phase(self, name: str, estimate: float, fn, reserve: float = 0.0) -> bool:
        """Run `fn(deadline)` when the budget has room for its estimate, with a deadline that leaves `reserve`
        seconds for what follows; record how it went."""
        left = self.remaining()
        if left < estimate:
            self.data["phases"][name] = {"status": "skipped", "reason": f"{left:.0f}s left of the budget, "
                                         f"~{estimate:.0f}s needed"}
            print(f"[multi_gpu] {name}: skipped ({left:.0f}s left)", flush=True)
            self.save()
            return False
        began = time.perf_counter()
        try:
            fn(time.perf_counter() + max(estimate, left - reserve - 5))
            status = {"status": "ok"}
        except Exception as exc:  # the figures gathered so far stay; the next run still goes
            status = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc(limit=8)}
        status["elapsed"] = fig(time.perf_counter() - began, "s")
        self.data["phases"][name] = status
        print(f"[multi_gpu] {name}: {status['status']} in {status['elapsed']['value']}s"
              + (f" ({status['error']})" if "error" in status else ""), flush=True)
        self.save()
        return status["status"] == "ok"

    # ------------------------------------------------------------------------------------ phases
    def prepare(self, deadline: float) -> None:
        from bench.lib.checkpoint import build_checkpoint, checkpoint_bytes, existing_model

        params, size = checkpoint_bytes(self.config)
        self.model_dir = model_root(size) / f"v3-{self.args.layers}l-{self.args.experts}e"
        marker = existing_model(self.model_dir, self.config)
        cost = marker or build_checkpoint(self.model_dir, self.config, shard_bytes=4 * GiB, writers=4)
        first_of_second, halves = split_point(self.config)
        self.rules = self.out / "rules-2gpu.yaml"
        self.rules.write_text(two_gpu_rules(self.config, first_of_second))
        on_gpu = sum(gpu_bytes(self.config).values())
        budget = self.args.gpu_budget_gib * GiB
        self.data["model"] = {
            "path": str(self.model_dir), "reused": marker is not None, "params": params,
            "checkpoint_size": fig(size / 1e9, "GB"), "build_time": fig(cost.get("build_s"), "s"),
            "layers": self.args.layers, "routed_experts": self.args.experts, "top_k": self.args.top_k,
            "gpu_weights": fig(on_gpu / 1e9, "GB", note="everything but the routed experts (bf16)"),
            "gpu_budget": fig(budget / 1e9, "GB", note="per GPU, torch.cuda.set_per_process_memory_fraction"),
            "fits_one_gpu_budget": on_gpu < budget,
            "split": {"cuda:0": f"embeddings + layers 0-{first_of_second - 1}",
                      "cuda:1": f"layers {first_of_second}-{self.args.layers - 1} + norm + LM head",
                      "weights_per_gpu": [fig(b / 1e9, "GB") for b in halves]},
            "rule_file": str(self.rules)}
        from transformers import AutoTokenizer

        self.vocab = min(self.vocab, len(AutoTokenizer.from_pretrained(self.model_dir)))

    def engine_config(self, rule_file: str, cuda_graph: bool):
        from engines.base import EngineConfig

        return EngineConfig(model_path=str(self.model_dir), model_name="bench-v3-multi-gpu", max_concurrent=1,
                            max_model_len=4096, settings={
                                "kt_method": self.args.method, "kt_optimize_rule": rule_file, "cpu_infer": self.threads,
                                "kv_cache_tokens": 8192, "kt_use_cuda_graph": cuda_graph,
                                "kt_weight_cache": str(self.model_dir.parent / "kt-weight-cache")})

    def run_engine(self, label: str, rule_file: str, gpus: int, deadline: float) -> None:
        from bench.lib.engine_runs import EngineRun, release_memory, ttft_points

        entry = self.data.setdefault("runs", {}).setdefault(label, {"gpus": gpus, "rule_file": rule_file})
        for i in range(self.gpus):
            torch.cuda.reset_peak_memory_stats(i)
        config = self.engine_config(rule_file, cuda_graph=True)
        cache = Path(config.settings["kt_weight_cache"])
        cached = cache.is_dir() and any(cache.rglob("*.*"))
        run = EngineRun("ktransformers", config, self.out / "engines.log")
        try:
            runner = run.engine._runner
            entry["load_time"] = fig(run.load_time, "s", note="engine start, experts read from the weight cache"
                                     if cached else "engine start, experts converted from the checkpoint")
            entry["layer_devices"] = sorted({str(d) for d in runner.layer_devices})
            entry["cache_devices"] = [str(t.device) for t in runner.cache.layers]
            entry["cuda_graphs"] = runner.graphs is not None
            entry["memory_after_load"] = gpu_memory(self.gpus)
            self.save()
            run.warm_up(self.vocab)
            entry["decode"] = run.decode(DECODE_PROMPT, DECODE_TOKENS, self.vocab, deadline, None)
            self.save()
            if runner.graphs is not None:  # the same engine without its graphs, as a split model decodes
                graphs, runner.graphs = runner.graphs, None
                try:
                    entry["decode_without_cuda_graphs"] = run.decode(DECODE_PROMPT, DECODE_TOKENS, self.vocab,
                                                                     deadline, None)
                finally:
                    runner.graphs = graphs
                self.save()
            entry["ttft"] = ttft_points(run, TTFT_PROMPTS, TTFT_TOKENS, self.vocab, deadline)
            entry["gpu_memory"] = gpu_memory(self.gpus)
        finally:
            run.close()
            release_memory()

    def run(self) -> dict:
        if self.gpus < 2:
            self.data["status"] = f"needs 2 CUDA GPUs, this machine has {self.gpus}"
            self.save()
            return self.data
        if not self.phase("model", ESTIMATES["build"], self.prepare):
            return self.data
        # The split first: it is what this benchmark is for, and its load converts the experts into the weight
        # cache that the one-GPU load then reads.
        first = ESTIMATES["first_load"] + ESTIMATES["decode"] + ESTIMATES["ttft"]
        then = ESTIMATES["cached_load"] + ESTIMATES["decode"] + ESTIMATES["ttft"]
        fraction = min(1.0, self.args.gpu_budget_gib * GiB / torch.cuda.get_device_properties(0).total_memory)
        self.data["meta"]["memory_fraction_two_gpus"] = fraction
        for i in range(2):
            torch.cuda.set_per_process_memory_fraction(fraction, i)
        self.phase("two_gpus", first, lambda deadline: self.run_engine("two_gpus", str(self.rules), 2, deadline),
                   reserve=then)
        for i in range(2):
            torch.cuda.set_per_process_memory_fraction(1.0, i)
        self.phase("one_gpu", then, lambda deadline: self.run_engine("one_gpu", "DeepSeek-V3.yaml", 1, deadline))
        self.data["total_time"] = fig(time.perf_counter() - self.started, "s")
        self.save()
        return self.data


def summary(data: dict) -> list[str]:
    def v(entry: dict, *path: str):
        for key in path:
            entry = entry.get(key, {}) if isinstance(entry, dict) else {}
        return entry.get("value") if isinstance(entry, dict) else None

    lines = []
    for label, entry in (data.get("runs") or {}).items():
        ttft = {p["prompt_tokens"]: p["ttft"]["value"] for p in entry.get("ttft", [])}
        peaks = {d: m["peak_allocated"]["value"] for d, m in (entry.get("gpu_memory") or {}).items()}
        lines.append(f"{label}: decode {v(entry, 'decode', 'decode_throughput')} tok/s"
                     f" (without graphs {v(entry, 'decode_without_cuda_graphs', 'decode_throughput')}),"
                     f" TTFT {ttft} s, peak GB {peaks}, graphs {entry.get('cuda_graphs')}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.multi_gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench/results/multi-gpu"))
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--gpu-budget-gib", type=float, default=10.0, help="per-GPU memory cap of the 2-GPU run")
    p.add_argument("--method", default="AMXINT8", help="kt-kernel experts method (replaced by the closest one "
                   "this CPU runs when it lacks it)")
    p.add_argument("--threads", type=int, help="kt-kernel CPU threads (default: physical cores - 1)")
    p.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run")
    args = p.parse_args(argv)
    data = MultiGpuBench(args).run()
    print(json.dumps({k: data[k] for k in ("model", "runs", "phases", "status") if k in data}, indent=1,
                     default=str))
    for line in summary(data):
        print("[multi_gpu]", line, flush=True)
    return 0 if all(p.get("status") == "ok" for p in data["phases"].values()) and "status" not in data else 1


if __name__ == "__main__":
    raise SystemExit(main())
