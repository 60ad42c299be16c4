"""Host memory of one KT engine alone: smaps_rollup and the largest mappings, by kind."""
import asyncio, collections, json, re, sys

import torch


def smaps():
    rows, cur = [], None
    for line in open("/proc/self/smaps"):
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            parts = line.split()
            cur = {"name": parts[5] if len(parts) > 5 else "[anon]", "rss": 0, "anon": 0, "locked": 0}
            rows.append(cur)
        elif line.startswith("Rss:"):
            cur["rss"] = int(line.split()[1])
        elif line.startswith("Anonymous:"):
            cur["anon"] = int(line.split()[1])
        elif line.startswith("Locked:"):
            cur["locked"] = int(line.split()[1])
    by = collections.defaultdict(lambda: [0, 0, 0])
    for r in rows:
        key = r["name"]
        if "/" in key:
            key = key.rsplit("/", 1)[1]
        b = by[key]
        b[0] += r["rss"]; b[1] += r["anon"]; b[2] += r["locked"]
    top = sorted(by.items(), key=lambda kv: -kv[1][0])[:20]
    return {k: [round(x / 1e6, 3) for x in v] for k, v in top}


def rollup():
    return {l.split(":")[0]: int(l.split()[1]) / 1e6 for l in open("/proc/self/smaps_rollup") if l.split()[-1] == "kB"}


async def decode(engine):
    from engines.base import GenerationRequest, SamplingParams
    h = engine.submit(GenerationRequest(prompt_token_ids=[100 + j for j in range(512)],
                                        sampling=SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)))
    async for _ in h:
        pass


def main(model_dir, method):
    from engines.base import EngineConfig
    from engines.kt.engine import KTEngine
    engine = KTEngine(EngineConfig(model_path=model_dir, max_concurrent=32, max_model_len=8448,
                                   settings={"kt_method": method}))
    engine.start()
    asyncio.run(decode(engine))
    before = rollup()
    import ctypes
    trimmed = ctypes.CDLL("libc.so.6").malloc_trim(0)
    after = rollup()
    print(json.dumps({"method": method, "before": {k: before[k] for k in ("Rss", "Anonymous", "Private_Clean")},
                      "trimmed": trimmed, "after": {k: after[k] for k in ("Rss", "Anonymous", "Private_Clean")},
                      "heap_after": smaps().get("[heap]")}))
    engine.stop()


main(sys.argv[1], sys.argv[2])
