"""Where a V4 prompt's time to first token goes in the engine: the steps before its first token, the runner's
part of each, and what the generation thread was doing (its stack sampled every millisecond).

    python -m bench.probes.v4_ttft [--v4-layers 4] [--prompts 1024,2048,8192] [--setting name=value] [--quick]

Builds the engine as `python -m bench.run --shape v4-flash` does (its checkpoint and configuration), sends one
warm-up prompt, then each prompt alone (greedy, 2 tokens). Prints one JSON object: per prompt the TTFT, the
runner's `execute` time of each of its steps, and per step the functions (ktserve's and the libraries') most
often on the generation thread's stack, as a share of the samples. `--setting name=value`: engine settings."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections import Counter


class StackSampler:
    """Samples one thread's stack every `interval` seconds while on: how often each function was on it."""

    def __init__(self, thread: threading.Thread, interval: float = 0.001):
        self.ident, self.interval = thread.ident, interval
        self.counts: Counter[str] = Counter()
        self.samples = 0
        self._on = threading.Event()
        self._stop = False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop:
            if self._on.wait(0.1):
                frame = sys._current_frames().get(self.ident)
                seen = set()
                while frame is not None:
                    code = frame.f_code
                    name = f"{'/'.join(code.co_filename.rsplit('/', 2)[-2:])}:{code.co_name}"
                    if name not in seen:
                        seen.add(name)
                        self.counts[name] += 1
                    frame = frame.f_back
                self.samples += 1
                time.sleep(self.interval)

    def window(self):
        sampler = self

        class _Window:
            def __enter__(self):
                sampler.counts.clear()
                sampler.samples = 0
                sampler._on.set()

            def __exit__(self, *exc):
                sampler._on.clear()
        return _Window()

    def top(self, n: int = 40) -> list[tuple[str, float]]:
        return [(name, round(c / max(self.samples, 1), 3)) for name, c in self.counts.most_common(n)]


def _value(text: str):
    """A setting's value as the server's settings would give it: a number or a boolean where it reads as one."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.v4_ttft", description=__doc__.split("\n\n")[0])
    p.add_argument("--v4-layers", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="the tiny demo V4's dimensions (a CPU check)")
    p.add_argument("--prompts", default="1024,2048,8192")
    p.add_argument("--max-concurrent", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=131360)
    p.add_argument("--chunk", type=int, default=None)
    p.add_argument("--setting", action="append", default=[], help="an engine setting, name=value (repeatable)")
    args = p.parse_args()
    settings = {name: _value(value) for name, value in (s.split("=", 1) for s in args.setting)}

    import torch

    from bench.lib.engine_runs import generate
    from bench.lib.shapes import prompt_ids
    from bench.v4_flash import _checkpoint
    from engines.base import EngineConfig
    from engines.kt.engine import KTEngine

    ns = argparse.Namespace(model_dir=None, quick=args.quick, v4_layers=args.v4_layers)
    root, config, _ = _checkpoint(ns)
    engine = KTEngine(EngineConfig(model_path=str(root), model_name="probe-v4-ttft", max_concurrent=args.max_concurrent,
                                   max_model_len=args.max_model_len, chunk_size=args.chunk, settings=settings))
    engine.start()
    runner = engine._runner
    steps: list[dict] = []
    original = runner.execute

    sampler = StackSampler(engine._thread)

    def timed(chunks):
        started = time.perf_counter()
        with sampler.window():
            out = original(chunks)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        steps.append({"rows": sum(c.end - c.start for c in chunks), "ms": round((time.perf_counter() - started) * 1e3,
                                                                                  2), "stack_share": sampler.top(25)})
        return out
    runner.execute = timed
    vocab = config["vocab_size"]
    result: dict = {"settings": settings, "layers": config["num_hidden_layers"], "chunk_size": engine.config.chunk_size,
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "prompts": {}}
    try:
        asyncio.run(generate(engine, prompt_ids(2048, vocab, seed=7), 2, float("inf")))  # the warm-up
        for n in [int(x) for x in args.prompts.split(",")]:
            steps.clear()
            gen = asyncio.run(generate(engine, prompt_ids(n, vocab, seed=n + 1), 2, float("inf")))
            result["prompts"][str(n)] = {"ttft_s": round(gen.ttft, 4), "steps": list(steps)}
            print(json.dumps({"prompt": n, **result["prompts"][str(n)]}), flush=True)
    finally:
        engine.stop()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
