"""What batch-invariant requests cost (engines/runtime/batch_invariance.py): the same work served with
`batch_invariant: off` and with the default `scores`, one server each, on the demo model unless `--model` says:
  1. scoring: `--prompts` echoed prompts (`max_tokens: 0`, `logprobs: 1`, lm-eval's loglikelihood request) sent by
     `--clients` concurrent clients: prompt tokens scored a second;
  2. decoding: `--clients` concurrent completions with `logprobs: 0`, `--max-tokens` tokens each (`ignore_eos`):
     output tokens a second.
Prints one JSON object: each phase's figures per setting and scores / off.

    python -m bench.batch_invariance [--prompts 64] [--clients 16] [--max-tokens 32] [--engine-args ...]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from tests.load.server import ServerOptions, ServerProcess

TEXT = ("Question {i}: the river begins in the mountains, where snow melts each spring and feeds a hundred small "
        "streams. How many mills does it turn before the plain? Answer: {i}.")


async def run_all(url: str, bodies: list[dict], clients: int) -> tuple[float, list[dict]]:
    """Send `bodies` to /v1/completions from `clients` concurrent clients; (seconds, responses)."""
    queue = list(enumerate(bodies))
    replies: list[dict] = [{}] * len(bodies)

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            i, body = queue.pop(0)
            r = await http.post("/v1/completions", json=body)
            r.raise_for_status()
            replies[i] = r.json()

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await asyncio.wait_for(asyncio.gather(*(client(http) for _ in range(clients))), 3600)
    return time.perf_counter() - started, replies


def measure(options: ServerOptions, log: Path, prompts: int, clients: int, max_tokens: int) -> dict:
    with ServerProcess(options, log) as server:
        model = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        scoring = [{"model": model, "prompt": TEXT.format(i=i), "max_tokens": 0, "echo": True, "logprobs": 1}
                   for i in range(prompts)]
        decoding = [{"model": model, "prompt": TEXT.format(i=i), "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True, "logprobs": 0} for i in range(clients)]
        asyncio.run(run_all(server.base_url, scoring[:2], 2))  # warm-up
        seconds, replies = asyncio.run(run_all(server.base_url, scoring, clients))
        scored = sum(r["usage"]["prompt_tokens"] for r in replies)
        decode_s, decoded = asyncio.run(run_all(server.base_url, decoding, clients))
        generated = sum(r["usage"]["completion_tokens"] for r in decoded)
    return {"scoring": {"prompts": prompts, "seconds": round(seconds, 3),
                        "prompt_tokens_per_s": round(scored / seconds, 1)},
            "decoding": {"clients": clients, "seconds": round(decode_s, 3),
                         "output_tokens_per_s": round(generated / decode_s, 1)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--engine-args", nargs=argparse.REMAINDER, default=[],
                        help="more `ktserve serve` arguments (e.g. --model DIR --kt-method AMXINT8)")
    args = parser.parse_args()
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in ("off", "scores"):
            options = ServerOptions(engine="ktransformers", max_concurrent=args.clients,
                                    extra_args=("--batch-invariant", policy, *args.engine_args))
            results[policy] = measure(options, Path(tmp) / f"{policy}.log", args.prompts, args.clients,
                                      args.max_tokens)
    results["scores_over_off"] = {
        "scoring": round(results["scores"]["scoring"]["prompt_tokens_per_s"]
                         / results["off"]["scoring"]["prompt_tokens_per_s"], 3),
        "decoding": round(results["scores"]["decoding"]["output_tokens_per_s"]
                          / results["off"]["decoding"]["output_tokens_per_s"], 3)}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
