"""python -m bench.attention: FlashInfer against torch MLA attention, and prefix caching, on the GPU machine.

    python -m bench.attention --out results/ [--shape v2-lite] [--contexts 512,4096,16384] [--clients 32]
                              [--gpu-prefill-tokens N] [--chunk-size N] [--setting KEY=VALUE ...]

For each attention backend (flashinfer, torch) one KT engine (AMXINT8 experts, CUDA graphs when there is a
GPU) serves, through uvicorn and streaming openai clients in a separate process:

    contexts   `--clients` concurrent requests at each context length, every prompt the same but for its
               last 64 tokens: the shared part is prefilled once (prefix caching), so the round measures
               decode at that context (each request still attends over its whole context) instead of
               32 CPU-expert prefills; output throughput and TPOT per context
    cached     time to first token of a 2,048-token prompt whose first 1,920 tokens (30 pages) were sent
               before (the second such prompt; the first is `ttft_cached_first`), next to a prompt of the
               same length with nothing cached

Results go to <out>/attention.json and are printed as they come. The checkpoint is bench.run's (built when
missing)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TAIL = 64  # tokens of each prompt that differ between the clients
CACHED_PROMPT, CACHED_PREFIX = 2048, 1920


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", default="v2-lite")
    p.add_argument("--contexts", default="512,4096,16384")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--backends", default="flashinfer,torch")
    p.add_argument("--method", default="AMXINT8", help="the experts' kt-kernel method")
    p.add_argument("--round-timeout", type=float, default=240.0)
    p.add_argument("--gpu-prefill-tokens", type=int, default=0, metavar="N",
                   help="the engines' kt_gpu_prefill_tokens (streamed experts for chunks of N tokens or more)")
    p.add_argument("--chunk-size", type=int, default=2048, metavar="N", help="the engines' prefill chunk size")
    p.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                   help="a further KT engine setting for every backend, as bench.run takes it "
                        "(e.g. kt_gpu_prefill_memory=2.5); repeatable")
    args = p.parse_args(argv)
    from bench.run import engine_settings

    engine_settings(p, args.setting)  # a malformed one is this command's usage error, naming the flag
    return args


@dataclasses.dataclass(frozen=True)
class Rounds:
    """What one backend is measured on."""

    contexts: tuple[int, ...]
    clients: int
    tokens: int  # output tokens per request (ignore_eos)
    round_timeout: float
    method: str = "AMXINT8"


def engine_config(bench, backend: str, rounds: Rounds):
    longest = max(rounds.contexts + (CACHED_PROMPT,)) + rounds.tokens + 64
    return dataclasses.replace(bench.kt_config(rounds.method, attention_backend=backend,
                                               kv_cache_tokens=rounds.clients * longest + 4096, prefix_cache=True),
                               max_concurrent=rounds.clients, max_model_len=longest)


def contexts_round(url: str, model: str, vocab: int, context: int, rounds: Rounds, time_left: float) -> dict:
    timeout = min(rounds.round_timeout, max(5.0, time_left))
    cmd = [sys.executable, "-m", "bench.lib.http_client", "--base-url", url, "--model", model,
           "--levels", str(rounds.clients), "--prompt-tokens", str(context), "--shared-prefix", str(context - TAIL),
           "--max-tokens", str(rounds.tokens), "--vocab", str(vocab), "--round-timeout", str(timeout),
           "--time-left", str(timeout + 10)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout + 60, check=False, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"the HTTP client exited with {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])["rounds"][0]


def cached_ttft(run, vocab: int) -> dict:
    from bench.lib.engine_runs import generate
    from bench.lib.report import fig
    from bench.lib.shapes import prompt_ids

    prefix = prompt_ids(CACHED_PREFIX, vocab, seed=11)
    tail = CACHED_PROMPT - CACHED_PREFIX
    run.run(generate(run.engine, prefix + prompt_ids(tail, vocab, seed=12), 2, float("inf")))
    first = run.run(generate(run.engine, prefix + prompt_ids(tail, vocab, seed=13), 2, float("inf")))
    before = run.engine.stats().cached_prompt_tokens
    warm = run.run(generate(run.engine, prefix + prompt_ids(tail, vocab, seed=15), 2, float("inf")))
    reused = run.engine.stats().cached_prompt_tokens - before
    cold = run.run(generate(run.engine, prompt_ids(CACHED_PROMPT, vocab, seed=14), 2, float("inf")))
    return {"prompt_tokens": CACHED_PROMPT, "cached_tokens": reused,
            "ttft_cached": fig(warm.ttft, "s", note="the second such prompt"),
            "ttft_cached_first": fig(first.ttft, "s", note="the first prompt that found the prefix cached"),
            "ttft_cold": fig(cold.ttft, "s", note="same length, nothing cached")}


def measure_backend(bench, backend: str, rounds: Rounds, deadline: float, report=lambda entry: None) -> dict:
    """One backend's figures: the cached-prefix TTFT, then a round per context until `deadline`; `report` is
    called with the entry after each. An engine that cannot start (e.g. flashinfer missing) is an `error`."""
    from bench.lib.engine_runs import EngineRun
    from bench.lib.http_load import serving

    entry: dict = {}
    try:
        run = EngineRun("ktransformers", engine_config(bench, backend, rounds), bench.log_path, label=backend)
    except Exception as exc:  # say so, measure the other backend
        entry["error"] = f"{type(exc).__name__}: {exc}"
        return entry
    try:
        run.warm_up(bench.vocab)
        entry["cuda_graphs"] = run.engine.options.kt_use_cuda_graph
        entry["cached_prefix"] = cached_ttft(run, bench.vocab)
        report(entry)
        with serving(run.engine, str(bench.model_dir)) as url:
            for context in rounds.contexts:
                left = deadline - time.perf_counter()
                if left < 10:
                    entry[f"context_{context}"] = {"skipped": f"deadline ({left:.0f}s left)"}
                    continue
                entry[f"context_{context}"] = contexts_round(url, run.engine.info.id, bench.vocab, context, rounds,
                                                             left)
                report(entry)
    finally:
        run.close()
    return entry


def main(argv: list[str] | None = None) -> int:
    from bench.lib.checkpoint import existing_model
    from bench.run import Bench, parse_args as bench_args

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(bench_args(["--out", str(args.out), "--shape", args.shape, "--only", "decode",
                              "--gpu-prefill-tokens", str(args.gpu_prefill_tokens),
                              "--chunk-size", str(args.chunk_size),
                              *(a for setting in args.setting for a in ("--setting", setting))]), time.perf_counter())
    bench.prepare_model(existing_model(bench.model_dir, bench.shape.config) is None)
    rounds = Rounds(tuple(int(c) for c in args.contexts.split(",") if c), args.clients, args.tokens,
                    args.round_timeout, args.method)
    results: dict = {"clients": args.clients, "output_tokens": args.tokens, "shared_tail_tokens": TAIL,
                     "gpu_prefill_tokens": args.gpu_prefill_tokens, "chunk_size": args.chunk_size,
                     "settings": bench.args.settings, "backends": {}}
    path = args.out / "attention.json"

    for backend in [b for b in args.backends.split(",") if b]:
        def report(entry: dict, backend: str = backend) -> None:
            results["backends"][backend] = entry
            print(json.dumps({backend: entry}), flush=True)
            path.write_text(json.dumps(results, indent=2))

        report(measure_backend(bench, backend, rounds, float("inf"), report))
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
