"""Streaming load generator: N concurrent clients, each one streaming completion through the official
`openai` AsyncOpenAI client, for each N of `--levels`. Prints one JSON object (the rounds) on stdout.

Each request sends token ids (so prompt length is exact), asks for `--max-tokens` with ignore_eos and
greedy sampling (or `--temperature` / `--top-p`, as chat clients send them), and records when each streamed
token arrives. Per round: aggregate output tokens/s over the round's wall time, time to first token, time per
output token per request ((last - first) / (n - 1)) and the gaps between tokens across all requests, as medians
and 99th percentiles; and, read from the server's /metrics every 0.2 s, the most requests it ran at once
(`peak_running`) and how many it preempted (`preemptions`). A round cut at `--round-timeout` also gives
`output_throughput_partial`: the tokens streamed by then, the unfinished requests' included, over the time to
then, flagged partial with how many requests completed.

With `--read-tokens N` each client closes its stream after N tokens (the server then cancels the request), as
a batch evaluation's requests end well before the large max_tokens they ask for: the rounds then show how
many such requests the server runs at once when its KV cache holds far less than every request's max_tokens.

    python -m bench.lib.http_client --base-url http://127.0.0.1:8000 --model m --levels 1,4 --vocab 100000
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from bench.lib.report import fig, median, percentile
from bench.lib.shapes import prompt_ids


async def _one(client, model: str, prompt: list[int], max_tokens: int, record: dict,
               sampling: dict | None = None, read_tokens: int = 0) -> None:
    record["start"] = time.perf_counter()
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, stream=True, **(sampling or {"temperature": 0.0}),
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            record["times"].append(now)
        if chunk.usage is not None:
            record["tokens"] = chunk.usage.completion_tokens
        if read_tokens and len(record["times"]) >= read_tokens:
            await stream.close()  # the server cancels the request
            break
    record["end"] = time.perf_counter()


def _metric(text: str, name: str) -> float:
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


async def _poll(http, state: dict) -> None:
    """Read /metrics once into `state`: the most running requests seen so far, the preemption counter."""
    try:
        text = (await http.get("/metrics")).text
    except Exception:  # figures are best effort; the round itself goes on
        return
    state["peak_running"] = max(state.get("peak_running", 0), int(_metric(text, "ktserve_requests_running")))
    state["preemptions"] = _metric(text, "ktserve_preemptions_total")


async def _watch(http, state: dict) -> None:
    while True:
        await _poll(http, state)
        await asyncio.sleep(0.2)


async def _round(client, model: str, level: int, args: argparse.Namespace, timeout: float) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=args.base_url, timeout=10) as http:
        before: dict = {}
        await _poll(http, before)
        state: dict = {}
        watcher = asyncio.create_task(_watch(http, state))
        try:
            out = await _clients(client, model, level, args, timeout)
        finally:
            watcher.cancel()
        await _poll(http, state)
    out["peak_running"] = state.get("peak_running")
    out["preemptions"] = state.get("preemptions", 0) - before.get("preemptions", 0)
    return out


async def _clients(client, model: str, level: int, args: argparse.Namespace, timeout: float) -> dict:
    records = [{"times": [], "tokens": None, "end": None} for _ in range(level)]
    shared = prompt_ids(args.shared_prefix, args.vocab, seed=7 + args.prompt_tokens)  # one per prompt length
    prompts = [shared + prompt_ids(args.prompt_tokens - len(shared), args.vocab, seed=1000 * level + i)
               for i in range(level)]
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    tasks = [asyncio.create_task(_one(client, model, prompt, args.max_tokens, rec, sampling, args.read_tokens))
             for prompt, rec in zip(prompts, records)]
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    stopped = time.perf_counter()
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    errors = [repr(t.exception()) for t in tasks if not t.cancelled() and t.exception() is not None]
    return _figures(level, records, bool(pending), errors, stopped)


def _figures(level: int, records: list[dict], timed_out: bool, errors: list[str], stopped: float) -> dict:
    done = [r for r in records if r["end"] is not None and r["times"]]
    started = [r for r in records if "start" in r]
    tokens = sum(r["tokens"] or len(r["times"]) for r in done)
    end = max((r["end"] for r in done), default=None)
    wall = end - min(r["start"] for r in started) if done and started else None
    ttfts = [r["times"][0] - r["start"] for r in done]
    tpots = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) * 1e3 for r in done if len(r["times"]) > 1]
    gaps = [(b - a) * 1e3 for r in done for a, b in zip(r["times"], r["times"][1:])]
    out = {"concurrency": level, "requests": level, "completed": len(done), "timed_out": timed_out,
           "output_tokens": tokens, "wall": fig(wall, "s"),
           "output_throughput": fig(tokens / wall if wall else None, "tok/s",
                                    note="all output tokens / round wall time (prefills included)"),
           "ttft_median": fig(median(ttfts), "s"), "ttft_p99": fig(percentile(ttfts, 99), "s"),
           "tpot_median": fig(median(tpots), "ms", note="per request: (last - first token) / (tokens - 1)"),
           "tpot_p99": fig(percentile(tpots, 99), "ms"),
           "itl_median": fig(median(gaps), "ms", note="gaps between streamed tokens, all requests"),
           "itl_p99": fig(percentile(gaps, 99), "ms")}
    if timed_out and started:
        out["output_throughput_partial"] = _partial(records, len(done), stopped - min(r["start"] for r in started))
    if errors:
        out["errors"] = errors[:5]
    return out


def _partial(records: list[dict], completed: int, elapsed: float) -> dict:
    """A round cut at its time limit: the output tokens streamed by then (the unfinished requests' too) over the
    time from the first request to the limit. Not the round's figure (its tail, mostly decode, never ran), so it is
    flagged `partial` and tables keep it out of their ratios."""
    delivered = sum((r["tokens"] or len(r["times"])) if r["end"] is not None else len(r["times"]) for r in records)
    return fig(delivered / elapsed if elapsed > 0 else None, "tok/s", partial=True, completed=completed,
               requests=len(records), output_tokens=delivered, elapsed=round(elapsed, 3),
               note="output tokens streamed by the round's time limit / time from the first request to it")


async def _main(args: argparse.Namespace) -> dict:
    import openai

    levels = [int(x) for x in args.levels.split(",") if x]
    deadline = time.perf_counter() + args.time_left
    client = openai.AsyncOpenAI(base_url=args.base_url + "/v1", api_key="unused", max_retries=0,
                                timeout=args.round_timeout + 30)
    async with client:
        warm = {"times": [], "tokens": None, "end": None}
        await _one(client, args.model, prompt_ids(16, args.vocab, seed=7), 2, warm)
        rounds, skipped = [], []
        for level in levels:
            left = deadline - time.perf_counter()
            if left < 5:
                skipped.append(level)
                continue
            rounds.append(await _round(client, args.model, level, args, min(args.round_timeout, left)))
    return {"rounds": rounds, "skipped_levels": skipped}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lib.http_client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--levels", default="1,4,16,32")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--read-tokens", type=int, default=0,
                   help="each client closes its stream after this many tokens (default 0: reads to max_tokens)")
    p.add_argument("--vocab", type=int, default=100000, help="prompt token ids are drawn below this")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="the first this many prompt tokens are the same in every request (prefix caching)")
    p.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="the requests' top_p (default 1: off)")
    p.add_argument("--round-timeout", type=float, default=60.0)
    p.add_argument("--time-left", type=float, default=300.0, help="seconds for all rounds together")
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(_main(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
