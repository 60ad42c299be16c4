"""python -m bench.shared_prefix: a batch of prompts that share a long preamble, against a running server.

    python -m bench.shared_prefix --url http://127.0.0.1:8000 [--prompts 16] [--repeats 40] [--trials 3]

Batch evaluation sends many prompts at once that differ only after a few-shot preamble. Each trial sends one
/v1/completions request with `--prompts` prompts (a preamble of `--repeats` sentences, new for each trial and run
so nothing is cached before it, then a different question each) and one output token, and prints, as JSON: the
request's wall time, its prompt tokens and how many of them the prefix cache served (from /metrics), against
the share that could be served (every prompt but the first reusing the preamble's full pages)."""
from __future__ import annotations

import argparse
import json
import secrets
import time

import httpx

SENTENCE = ("Read the passage and answer with one word. The river begins in the mountains, turns the mills of the "
            "valley and slows down in the plain, where farmers dug canals. ")
HIT_COUNTER = "ktserve_prefix_cache_hit_tokens_total"


def hit_tokens(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(HIT_COUNTER):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"/metrics has no {HIT_COUNTER}")


def trial(client: httpx.Client, model: str, args: argparse.Namespace, index: int) -> dict:
    preamble = f"Batch {index} {secrets.token_hex(4)}. " + SENTENCE * args.repeats  # never cached before
    prompts = [preamble + f" Question {i}: why?" for i in range(args.prompts)]
    before = hit_tokens(client)
    started = time.perf_counter()
    reply = client.post("/v1/completions", json={"model": model, "prompt": prompts, "max_tokens": 1,
                                                 "temperature": 0})
    wall = time.perf_counter() - started
    reply.raise_for_status()
    preamble_tokens = len(client.post("/tokenize", json={"model": model, "prompt": preamble}).json()["tokens"])
    return {"wall_s": round(wall, 3), "prompts": args.prompts, "prompt_tokens": reply.json()["usage"]["prompt_tokens"],
            "reused_tokens": hit_tokens(client) - before,
            "reusable_tokens": (args.prompts - 1) * (preamble_tokens // args.page * args.page)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.shared_prefix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="default: the server's first model")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--repeats", type=int, default=40, help="sentences of preamble (about 30 tokens each)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--page", type=int, default=64, help="the KV cache's page size in tokens")
    args = p.parse_args(argv)
    with httpx.Client(base_url=args.url, timeout=600) as client:
        model = args.model or client.get("/v1/models").json()["data"][0]["id"]
        for index in range(args.trials):
            print(json.dumps(trial(client, model, args, index)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
