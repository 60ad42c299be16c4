"""Host memory of one KT engine alone: smaps_rollup before and after `malloc_trim`, and the heap's mappings.

    python -m bench.probes.host_memory MODEL_DIR AMXINT8

(bench/results/nvidia-h200-2026-11-27/: what the engine holds beside its experts.)"""
from __future__ import annotations

import asyncio
import collections
import ctypes
import json
import re
import sys


def smaps() -> dict[str, list[float]]:
    """The 20 largest mappings by name: resident / anonymous / locked GB."""
    rows: list[dict] = []
    cur: dict = {}
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                parts = line.split()
                cur = {"name": parts[5] if len(parts) > 5 else "[anon]", "rss": 0, "anon": 0, "locked": 0}
                rows.append(cur)
            elif line.startswith(("Rss:", "Anonymous:", "Locked:")):
                key = {"Rss:": "rss", "Anonymous:": "anon", "Locked:": "locked"}[line.split()[0]]
                cur[key] = int(line.split()[1])
    by: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for r in rows:
        b = by[r["name"].rsplit("/", 1)[-1]]
        b[0] += r["rss"]
        b[1] += r["anon"]
        b[2] += r["locked"]
    top = sorted(by.items(), key=lambda kv: -kv[1][0])[:20]
    return {k: [round(x / 1e6, 3) for x in v] for k, v in top}


def rollup() -> dict[str, float]:
    with open("/proc/self/smaps_rollup") as f:
        return {line.split(":")[0]: int(line.split()[1]) / 1e6 for line in f if line.split()[-1] == "kB"}


async def decode(engine) -> None:
    from engines.base import GenerationRequest, SamplingParams
    handle = engine.submit(GenerationRequest(prompt_token_ids=[100 + j for j in range(512)],
                                             sampling=SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)))
    async for _ in handle:
        pass


def main(argv: list[str]) -> int:
    from engines.base import EngineConfig
    from engines.kt.engine import KTEngine

    model_dir, method = argv
    engine = KTEngine(EngineConfig(model_path=model_dir, max_concurrent=32, max_model_len=8448,
                                   settings={"kt_method": method}))
    engine.start()
    try:
        asyncio.run(decode(engine))
        before = rollup()
        trimmed = ctypes.CDLL("libc.so.6").malloc_trim(0)
        after = rollup()
        keys = ("Rss", "Anonymous", "Private_Clean")
        print(json.dumps({"method": method, "before": {k: before[k] for k in keys}, "trimmed": trimmed,
                          "after": {k: after[k] for k in keys}, "heap_after": smaps().get("[heap]")}))
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
