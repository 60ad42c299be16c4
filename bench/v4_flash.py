"""`python -m bench.run --shape v4-flash`: DeepSeek-V4-Flash-shaped random checkpoint in the released layout
(hidden 4096, 256 MXFP4 experts top-6, FP8 + UE8M0 projections, V4-Flash's attention schedule), as many of its
43 layers as this host's disk and memory hold (--v4-layers N: N); then the KT engine (default rule file:
V4-Flash.yaml on a GPU) measures, cheap phases first (SCHEDULE; --v4-phases picks):

    decode    batch-1 decode after a 64-token prompt: TPOT, the median gap of 32 decoded tokens
    ceiling   the host's read bandwidth, the ceiling it sets batch-1 decode, and decode's fraction of it
    ctx1k ... one request per context (1k, 2k, 8k, 32k, 128k tokens): its TTFT (and at 43 layers, and the prompt's
    ctx128k   tok/s) and TPOT over the 32 tokens decoded after it; TPOT(128k) / TPOT(1k)
    clients   1 / 4 / 16 / 32 clients at once: total and per-client decode tok/s, and the ratio to batch 1
    cached    a ~30k-token prefix sent once, then with a short suffix: the second's TTFT and the cached_tokens
              the engine reports for it

and host / GPU peak memory, then a `targets` block setting each figure against issue 58's target. A phase runs only
where the budget left (--budget) holds its expected time (from the prompts measured before it), else it is skipped
with the reason. Progress lines go to stderr as each phase ends; the JSON is rewritten to --out after each one (a
run killed part way leaves what it measured) and printed to stdout at the end.

The routed experts are random bytes (valid E2M1 codes, one UE8M0 scale per 32): the format is real, the
values meaningless, which costs nothing in speed."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

FLASH_LAYERS = 43
FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4]  # 43 layers: V4-Flash's schedule (two sliding-window layers first)


def flash_config(layers: int) -> dict:
    from engines.kt.families.deepseek_v4.demo_model import demo_config_v4

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
        from engines.kt.families.deepseek_v4.demo_model import V4Weights

        self.config, self.out = config, out
        self.weights = V4Weights(config, seed=0)
        self.rng = np.random.default_rng(0)  # the experts' bytes
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
                w.out[f"{p}.experts.{e}.{proj}.weight"] = self._bytes(n, k // 2)
                w.out[f"{p}.experts.{e}.{proj}.scale"] = torch.full((n, k // 32), 120, dtype=torch.uint8).view(
                    torch.float8_e8m0fnu)
        w.fp8(f"{p}.shared_experts.w1", inter, hidden)
        w.fp8(f"{p}.shared_experts.w3", inter, hidden)
        w.fp8(f"{p}.shared_experts.w2", hidden, inter)

    def _bytes(self, rows: int, cols: int) -> torch.Tensor:
        """[rows, cols] random int8 (packed E2M1 pairs) from the generator's raw 64-bit words: ~18x the rate of
        torch.randint's int8 draws (2.5 GB/s against 0.13 on a 2-core Xeon), which took most of the 86-145 s a
        4-layer checkpoint took to write on the GPU machine."""
        words = self.rng.bit_generator.random_raw(-(-rows * cols // 8))
        return torch.from_numpy(words.view(np.int8)[:rows * cols].reshape(rows, cols))

    def _flush(self, name: str) -> None:
        from safetensors.torch import save_file

        save_file(self.weights.out, str(self.out / name), metadata={"format": "pt"})
        self.map.update(dict.fromkeys(self.weights.out, name))
        self.weights.out = {}

    def write(self) -> None:
        from engines.checkpoints.model_dir import write_json, write_tokenizer

        c, w = self.config, self.weights
        self.out.mkdir(parents=True, exist_ok=True)
        write_json(self.out / "config.json", c)
        write_tokenizer(self.out)
        hidden, vocab = c["hidden_size"], c["vocab_size"]
        w.plain("embed.weight", w.normal(vocab, hidden, std=1.0), torch.bfloat16)
        w.plain("norm.weight", torch.ones(hidden))
        w.hyper_head("hc_head")
        w.plain("head.weight", w.normal(vocab, hidden, std=8.0 / math.sqrt(hidden)), torch.bfloat16)
        self._flush("model-head.safetensors")
        for i in range(c["num_hidden_layers"]):
            w.block(f"layers.{i}", i)
            self._flush(f"model-layer-{i:03d}.safetensors")
        write_json(self.out / "model.safetensors.index.json", {"metadata": {}, "weight_map": self.map})


def _checkpoint(args: argparse.Namespace) -> tuple[Path, dict, float]:
    """The benchmark checkpoint (written unless one of the same config is there), its config, the seconds writing
    it took. `--quick`: the tiny demo V4's dimensions on Flash's schedule of attention kinds, 4 layers (a CPU check
    of the phases, not a measurement)."""
    from engines.kt.families.deepseek_v4.demo_model import demo_config_v4

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


# the prompt lengths measured, by name: TTFT and TPOT (the median token gap over DECODE_TOKENS decoded tokens)
# after each; --quick divides them by QUICK_DIVISOR
CONTEXTS = {"1k": 1024, "2k": 2048, "8k": 8192, "32k": 32768, "128k": 131072}
TPOT_CONTEXTS = ("1k", "8k", "32k", "128k")
TTFT_CONTEXTS = ("2k", "8k", "32k", "128k")
DECODE_TOKENS = 32  # decoded after the first token: a TPOT is the median of these 32 token gaps
DECODE_PROMPT = 64  # the batch-1 decode's prompt
CLIENT_LEVELS = (1, 4, 16, 32)
CLIENT_PROMPT = 256
CACHED_PREFIX, CACHED_SUFFIX = 30_000, 64  # the shared prefix sent once, then again with a short suffix
QUICK_DIVISOR = 32
# the order the phases run in: cheap ones first, so that a budget running out skips the long ones (with a reason)
# rather than leaving the others no time; each context's TTFT and TPOT come from one request
SCHEDULE = ("decode", "ceiling", "ctx1k", "ctx2k", "ctx8k", "clients", "ctx32k", "cached", "ctx128k")
GROUPS = {"ttft": tuple(f"ctx{c}" for c in TTFT_CONTEXTS), "tpot": tuple(f"ctx{c}" for c in TPOT_CONTEXTS),
          "contexts": tuple(f"ctx{c}" for c in CONTEXTS)}
SAFETY = 1.2  # a phase runs when the budget left holds its expected time x this
# issue 58's targets: (name, comparison, target); the figures at 43 layers where the name says so
TARGETS = (("decode_fraction_of_read_ceiling", ">=", 0.70), ("ttft_2k_s_43_layers", "<=", 2.5),
           ("ttft_32k_s_43_layers", "<=", 25.0), ("tpot_128k_over_1k", "<=", 1.2),
           ("clients_16_over_batch1", ">=", 4.0), ("clients_32_over_batch1", ">=", 6.0),
           ("cached_prefix_ttft_s_43_layers", "<=", 1.5))


def select_phases(text: str | None) -> tuple[str, ...]:
    """--v4-phases: comma-separated phase names of SCHEDULE or GROUPS (ttft, tpot, contexts), in SCHEDULE's order;
    None or empty: all. ValueError naming the unknown ones."""
    if not text or not text.strip():
        return SCHEDULE
    asked = {x.strip() for x in text.split(",") if x.strip()}
    unknown = sorted(asked - set(SCHEDULE) - set(GROUPS))
    if unknown:
        groups = ", ".join(f"{g} ({'+'.join(p)})" for g, p in GROUPS.items())
        raise ValueError(f"unknown phase(s) {', '.join(unknown)}; known: {', '.join(SCHEDULE)} and the groups "
                         f"{groups}")
    chosen = {p for name in asked for p in GROUPS.get(name, (name,))}
    return tuple(p for p in SCHEDULE if p in chosen)


@dataclass(frozen=True)
class Sizes:
    """The prompt lengths and client counts of a run."""

    contexts: dict[str, int]
    decode_prompt: int = DECODE_PROMPT
    client_prompt: int = CLIENT_PROMPT
    levels: tuple[int, ...] = CLIENT_LEVELS
    cached_prefix: int = CACHED_PREFIX
    cached_suffix: int = CACHED_SUFFIX

    @classmethod
    def of(cls, quick: bool) -> "Sizes":
        """The issue's lengths; `quick` (the tiny demo V4 on a CPU, a check of the phases): each prompt
        QUICK_DIVISOR times shorter."""
        if not quick:
            return cls(dict(CONTEXTS))
        return cls({k: v // QUICK_DIVISOR for k, v in CONTEXTS.items()}, client_prompt=32,
                   cached_prefix=CACHED_PREFIX // QUICK_DIVISOR, cached_suffix=16)

    def max_model_len(self) -> int:
        """The context the engine must serve: the longest prompt and its decoded tokens, with room to spare."""
        longest = max(*self.contexts.values(), self.cached_prefix + self.cached_suffix, self.client_prompt,
                      self.decode_prompt)
        return longest + DECODE_TOKENS + 256


def expected_prefill_s(points: list[tuple[int, float]], tokens: int) -> float | None:
    """The expected time to first token of a `tokens`-long prompt from measured (prompt tokens, seconds): the longest
    one's time scaled linearly, or where the two longest grow faster than linearly (attention's cost grows with the
    context), the curve a*n + b*n^2 through both; None without a measurement."""
    measured = sorted({n: t for n, t in points if n > 0 and t is not None and t > 0}.items())
    if not measured:
        return None
    n2, t2 = measured[-1]
    linear = t2 * tokens / n2
    if len(measured) < 2:
        return linear
    n1, t1 = measured[-2]
    b = (t2 / n2 - t1 / n1) / (n2 - n1)
    if b <= 0:
        return linear
    a = t1 / n1 - b * n1
    return max(linear, a * tokens + b * tokens * tokens)


def decision(left: float, expected: float | None) -> str | None:
    """None: run a phase expected to take `expected` seconds (None: not known) with `left` seconds of the budget
    left; else why it is skipped."""
    if left <= 0:
        return "the budget ended before it"
    if expected is not None and SAFETY * expected > left:
        return f"expected ~{expected:.0f} s, more than the {left:.0f} s left of the budget"
    return None


def scaled(seconds: float | None, layers: int) -> float | None:
    """A time that grows with the layers (prefill, a decode step), at V4-Flash's 43."""
    return None if seconds is None else seconds * FLASH_LAYERS / layers


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def derived(results: dict) -> dict:
    """The figures computed from the phases' measurements: TPOT by context and its growth, TTFT at 43 layers, each
    client level's decode against batch 1 (set in its entry: the 1-client level's, else the batch-1 decode's), and
    the targets block (each target {value, target, compare, met}, met None where the figure was not measured)."""
    contexts = results.get("contexts", {})
    # a TPOT counts where it is the median of DECODE_TOKENS gaps (not of the few before a deadline stopped it)
    tpot = {name: c["tpot_ms"] for name, c in contexts.items()
            if name in TPOT_CONTEXTS and c.get("tpot_ms") and c.get("decoded_tokens", 0) >= DECODE_TOKENS}
    out: dict = {"tpot_ms_by_context": tpot,
                 "tpot_128k_over_1k": ratio(tpot.get("128k"), tpot.get("1k")),
                 "ttft_scaled_to_43_layers_s": [{"context": name, "prompt_tokens": c["prompt_tokens"],
                                                 "ttft_s": c.get("ttft_s_43_layers")}
                                                for name, c in contexts.items() if name in TTFT_CONTEXTS]}
    clients = {level["clients"]: level for level in results.get("clients", [])}
    one = (clients.get(1) or {}).get("decode_tok_s_total") or (results.get("decode_batch1") or {}).get("decode_tok_s")
    for level in clients.values():
        level["ratio_to_batch1"] = ratio(level.get("decode_tok_s_total"), one)
    values = {"decode_fraction_of_read_ceiling": (results.get("read_ceiling") or {}).get("fraction_of_ceiling"),
              "ttft_2k_s_43_layers": (contexts.get("2k") or {}).get("ttft_s_43_layers"),
              "ttft_32k_s_43_layers": (contexts.get("32k") or {}).get("ttft_s_43_layers"),
              "tpot_128k_over_1k": out["tpot_128k_over_1k"],
              "clients_16_over_batch1": (clients.get(16) or {}).get("ratio_to_batch1"),
              "clients_32_over_batch1": (clients.get(32) or {}).get("ratio_to_batch1"),
              "cached_prefix_ttft_s_43_layers": (results.get("cached_prefix") or {}).get("ttft_s_43_layers")}
    out["targets"] = {}
    for name, compare, target in TARGETS:
        value = values[name]
        met = None if value is None else value >= target if compare == ">=" else value <= target
        out["targets"][name] = {"value": value, "target": target, "compare": compare, "met": met}
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _figures(gen, layers: int) -> dict:
    """One request's figures: TTFT (and at 43 layers), the prompt's rate, and TPOT: the median gap between the
    tokens decoded after the first."""
    from bench.lib.report import median, percentile

    gaps = gen.gaps
    tpot, ttft = median(gaps), gen.ttft
    out = {"prompt_tokens": gen.prompt_tokens, "ttft_s": ttft, "ttft_s_43_layers": scaled(ttft, layers),
           "prompt_tok_s": ratio(gen.prompt_tokens, ttft),
           "prompt_tok_s_43_layers": ratio(gen.prompt_tokens, scaled(ttft, layers)),
           "decoded_tokens": len(gaps), "tpot_ms": _ms(tpot), "tpot_p99_ms": _ms(percentile(gaps, 99)),
           "tpot_ms_43_layers": _ms(scaled(tpot, layers)), "decode_tok_s": ratio(1.0, tpot),
           "cached_tokens": gen.cached_tokens}
    if gen.stopped_early:
        out["stopped_early"] = "the budget ended while it decoded"
    return out


def progress(message: str) -> None:
    """A progress line on stderr (stdout carries the JSON)."""
    print(f"v4-flash: {message}", file=sys.stderr, flush=True)


class V4Phases:
    """The selected phases on a started engine, in SCHEDULE's order, each only where the budget left holds its
    expected time (else skipped, with why, in `results["phases"]`); `write(results)` after each phase (and each
    client level), so that a run killed part way leaves what it measured."""

    def __init__(self, engine: Any, results: dict, *, sizes: Sizes, selected: tuple[str, ...], layers: int,
                 vocab: int, deadline: float, write: Callable[[dict], None],
                 ceiling: Callable[[float | None], dict]):
        self.engine, self.results, self.sizes, self.selected = engine, results, sizes, selected
        self.layers, self.vocab, self.deadline, self.write = layers, vocab, deadline, write
        self.measure_ceiling = ceiling
        self.warmed = False
        results.setdefault("phases", {})

    # ------------------------------------------------------------------------------------ running
    def run(self) -> dict:
        phases = self.results["phases"]
        for name in self.selected:
            expected = self.expected(name)
            why = self.beyond_context(name) or decision(self.left(), expected)
            started = time.perf_counter()
            entry: dict = {"status": "skipped", "reason": why} if why else {"status": "ok"}
            if why is None:
                try:
                    self.measure(name, entry)
                except Exception as exc:  # an engine error (e.g. out of GPU memory) fails this phase only
                    from bench.lib.engine_runs import release_memory

                    tail = traceback.format_exc().strip().splitlines()[-4:]
                    entry = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}", "traceback": tail}
                    release_memory()  # what the failed request left, for the phases after it
            entry["seconds"] = time.perf_counter() - started
            entry["expected_s"] = expected
            phases[name] = entry
            self.save()
            detail = entry.get("reason") if entry["status"] != "ok" else self.summary(name)
            progress(f"{name} {entry['status']} in {entry['seconds']:.1f} s ({detail}); "
                     f"{max(0.0, self.left()):.0f} s of the budget left")
        return self.results

    def save(self) -> None:
        self.results.update(derived(self.results))
        self.write(self.results)

    def measure(self, name: str, entry: dict) -> None:
        if name.startswith("ctx"):
            self.context(name.removeprefix("ctx"))
        else:
            getattr(self, name)(entry)

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def one(self, prompt: list[int], tokens: int):
        return self.many([prompt], tokens)[0]

    def many(self, prompts: list[list[int]], tokens: int) -> list:
        from bench.lib.engine_runs import generate

        async def together():
            return await asyncio.gather(*(generate(self.engine, p, tokens, self.deadline) for p in prompts))
        return asyncio.run(together())

    def prompt(self, length: int, seed: int) -> list[int]:
        from bench.lib.shapes import prompt_ids

        return prompt_ids(length, self.vocab, seed=seed)

    def with_steps(self, gen) -> dict:
        """The request's figures and what the engine counted of its decode steps (their wall time and what came
        after the forward: sampling, delivery; `python -m bench.v4_trace` times the rest)."""
        from bench.lib.engine_runs import step_breakdown

        out = _figures(gen, self.layers)
        if gen.stats_at_first_token is not None:
            steps = step_breakdown(gen.stats_at_first_token, self.engine.stats()).get("step_breakdown", {})
            out["step_breakdown"] = {k: steps[k] for k in ("steps", "step", "after_forward") if k in steps}
        return out

    # ------------------------------------------------------------------------------------ the phases
    def decode(self, entry: dict) -> None:
        """Batch-1 decode after a short prompt."""
        gen = self.one(self.prompt(self.sizes.decode_prompt, seed=self.sizes.decode_prompt), DECODE_TOKENS + 1)
        figures = self.results["decode_batch1"] = self.with_steps(gen)
        rate = figures["decode_tok_s"]
        # decode time grows with layers: scale the time per token, not the rate
        self.results["decode_batch1_scaled_to_43_layers_tok_s"] = (rate * self.layers / FLASH_LAYERS
                                                                    if rate else None)

    def ceiling(self, entry: dict) -> None:
        """The host's read ceiling for the expert bytes a token reads, and batch-1 decode's fraction of it."""
        rate = (self.results.get("decode_batch1") or {}).get("decode_tok_s")
        self.results["read_ceiling"] = self.measure_ceiling(rate)

    def context(self, name: str) -> None:
        """TTFT of a prompt of the context's length and TPOT over the DECODE_TOKENS tokens decoded after it."""
        if not self.warmed:
            # a first prompt chunk pays once for what a running server no longer does (kernels chosen for new
            # shapes): one chunk's worth, not measured
            length = min(self.engine.config.chunk_size or self.sizes.contexts["2k"], self.sizes.contexts["2k"])
            gen = self.one(self.prompt(length, seed=7), 2)
            self.results["warm_up"] = {"prompt_tokens": length, "ttft_s": gen.ttft}
            self.warmed = True
        n = self.sizes.contexts[name]
        gen = self.one(self.prompt(n, seed=n + 1), DECODE_TOKENS + 1)
        self.results.setdefault("contexts", {})[name] = self.with_steps(gen)

    def clients(self, entry: dict) -> None:
        """Each level's clients at once, each a CLIENT_PROMPT-token prompt then DECODE_TOKENS decoded; a level
        runs only where the budget left holds its expected time, the larger ones after it skipped too."""
        from bench.lib.report import median

        rounds = self.results["clients"] = []
        skipped: dict[str, str] = {}
        for level in self.sizes.levels:
            why = "a smaller level was skipped" if skipped else decision(self.left(), self.level_expected(level))
            if why:
                skipped[str(level)] = why
                continue
            gens = self.many([self.prompt(self.sizes.client_prompt, seed=100_000 * level + i) for i in range(level)],
                             DECODE_TOKENS + 1)
            tpots = [median(g.gaps) for g in gens]
            rates = [1.0 / t for t in tpots if t]
            rounds.append({"clients": level, "prompt_tokens": self.sizes.client_prompt,
                           "decode_tok_s_total": sum(rates) if rates else None,
                           "decode_tok_s_per_client": sum(rates) / len(rates) if rates else None,
                           "tpot_ms_median": _ms(median([t for t in tpots if t])),
                           "ttft_s_median": median([g.ttft for g in gens if g.ttft is not None]),
                           "decoded_tokens_min": min(len(g.gaps) for g in gens),
                           "stopped_early": sum(g.stopped_early for g in gens)})
            self.save()
        if skipped:
            entry["levels_skipped"] = skipped

    def cached(self, entry: dict) -> None:
        """A shared prefix sent once, then the prefix and a short suffix: the second's TTFT and the prompt tokens
        the engine says its prefix cache served for it (the request's cached_tokens, and the engine's count)."""
        p, s = self.sizes.cached_prefix, self.sizes.cached_suffix
        prefix = self.prompt(p, seed=p)
        first = self.one(prefix, 2)
        before = self.engine.stats().cached_prompt_tokens
        second = self.one(prefix + self.prompt(s, seed=p + 1), 2)
        self.results["cached_prefix"] = {
            "prefix_tokens": p, "suffix_tokens": s, "prompt_tokens": p + s,
            "ttft_s": second.ttft, "ttft_s_43_layers": scaled(second.ttft, self.layers),
            "cached_tokens": second.cached_tokens,
            "engine_cached_prompt_tokens": self.engine.stats().cached_prompt_tokens - before,
            "first_ttft_s": first.ttft, "first_ttft_s_43_layers": scaled(first.ttft, self.layers),
            "speedup_over_first": ratio(first.ttft, second.ttft)}

    # ------------------------------------------------------------------------------------ estimates
    def points(self) -> list[tuple[int, float]]:
        return [(c["prompt_tokens"], c["ttft_s"]) for c in self.results.get("contexts", {}).values()]

    def tpot_s(self) -> float | None:
        ms = (self.results.get("decode_batch1") or {}).get("tpot_ms")
        return ms / 1e3 if ms else None

    def expected(self, name: str) -> float | None:
        """The seconds a phase is expected to take, from what the earlier ones measured (None: no measurement to
        go by yet, or a short phase that always runs)."""
        if name.startswith("ctx"):
            prefill = expected_prefill_s(self.points(), self.sizes.contexts[name.removeprefix("ctx")])
            return None if prefill is None else prefill + (DECODE_TOKENS + 1) * (self.tpot_s() or 0.0)
        if name == "clients":
            return self.level_expected(self.sizes.levels[0])
        if name == "cached":  # without a prefix cache the second prompt costs what the first does
            prefill = expected_prefill_s(self.points(), self.sizes.cached_prefix + self.sizes.cached_suffix)
            return None if prefill is None else 2 * prefill
        return None

    def level_expected(self, level: int) -> float | None:
        """A client level's prompts at the per-token time of the longest measured prompt up to 8k tokens (they
        are short, so no attention growth), then its decode steps at the batch-1 step time x (1 + level / 8)
        (a guess at a batched step's growth)."""
        points = sorted(p for p in self.points() if p[1])
        short = [p for p in points if p[0] <= 8192] or points[:1]
        tpot = self.tpot_s()
        if not short and tpot is None:
            return None
        prefill = short[-1][1] / short[-1][0] * level * self.sizes.client_prompt if short else 0.0
        return prefill + (DECODE_TOKENS + 1) * (tpot or 0.0) * (1 + level / 8)

    def beyond_context(self, name: str) -> str | None:
        """Why a phase cannot run: its prompt and decoded tokens past the context the engine serves."""
        longest = getattr(self.engine.info, "max_model_len", None)
        if name.startswith("ctx"):
            need = self.sizes.contexts[name.removeprefix("ctx")] + DECODE_TOKENS + 1
        elif name == "cached":
            need = self.sizes.cached_prefix + self.sizes.cached_suffix + 2
        else:
            return None
        if longest is not None and need > longest:
            return (f"{need} tokens are past the {longest} the engine serves (max_model_len, or what V4's cache "
                    "budget, kv_cache_tokens, holds)")
        return None

    def summary(self, name: str) -> str:
        """The progress line's figures of a phase that ran (never an error: the line is not worth a run)."""
        try:
            return self._summary(name)
        except (KeyError, TypeError, ValueError) as exc:
            return f"figures in the JSON ({type(exc).__name__} reading them back)"

    def _summary(self, name: str) -> str:
        r = self.results

        def f(value: float | None, fmt: str) -> str:
            return "-" if value is None else format(value, fmt)
        if name == "decode":
            d = r["decode_batch1"]
            return f"TPOT {f(d['tpot_ms'], '.1f')} ms, {f(d['decode_tok_s'], '.1f')} tok/s"
        if name == "ceiling":
            c = r["read_ceiling"]
            return (f"read {c['read_bandwidth']['value']:.1f} GB/s, ceiling {c['ceiling_tok_s']:.1f} tok/s, "
                    f"decode at {f(c['fraction_of_ceiling'], '.2f')} of it")
        if name.startswith("ctx"):
            c = r["contexts"][name.removeprefix("ctx")]
            return (f"{c['prompt_tokens']} tokens: TTFT {f(c['ttft_s'], '.2f')} s ({f(c['ttft_s_43_layers'], '.1f')} s "
                    f"at 43 layers), TPOT {f(c['tpot_ms'], '.1f')} ms over {c['decoded_tokens']} tokens"
                    + (", stopped early: the budget ended" if c.get("stopped_early") else ""))
        if name == "clients":
            return ", ".join(f"{c['clients']}: {f(c['decode_tok_s_total'], '.1f')} tok/s "
                             f"(x{f(c.get('ratio_to_batch1'), '.2f')})" for c in r["clients"]) or "no level ran"
        c = r["cached_prefix"]
        return (f"TTFT {f(c['ttft_s'], '.2f')} s ({f(c['ttft_s_43_layers'], '.1f')} s at 43 layers), "
                f"{c['cached_tokens']} cached tokens")


def cache_mib_per_sequence(config: dict, dtype: torch.dtype = torch.bfloat16) -> dict:
    """What one sequence's V4 caches hold at 1k / 32k / 128k positions, in MiB, for `config`'s layers and for all
    43 of V4-Flash's: the runner's own accounting (engines/kt/families/deepseek_v4/budget.py: CacheBytes, exact for
    transformers' cache layers), which the budget charges and the caches allocate."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    from engines.kt.families.deepseek_v4.budget import CacheBytes

    out = {}
    for name, shape in (("layers", config), ("43_layers", flash_config(FLASH_LAYERS))):
        fields = {k: v for k, v in shape.items() if k not in ("architectures", "model_type")}
        sizes = CacheBytes.of(DeepseekV4Config(**fields), dtype)
        out[name] = {label: sizes.at(p) / 2**20 for label, p in (("1k", 1024), ("32k", 32768), ("128k", 131072))}
    return out


def _memory() -> dict:
    import resource

    out = {"host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}
    if torch.cuda.is_available():
        out["gpu_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return out


def result_name(results: dict) -> str:
    """The results file: v4-flash-mtp.json, v4-flash-streamed.json where prompt chunks stream experts, else
    v4-flash.json."""
    return ("v4-flash-mtp" if "mtp" in results else
            "v4-flash-streamed" if _streams(results.get("kt_gpu_prefill_tokens")) else "v4-flash") + ".json"


def write_results(results: dict, out: Path | None) -> None:
    """The results as they stand into `out` (a folder; nothing without one), replaced whole: a run killed while
    writing leaves the previous phase's file."""
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    path = Path(out) / result_name(results)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(partial, path)


def run(args: argparse.Namespace) -> dict:
    from engines.base import EngineConfig
    from engines.kt.engine import KTEngine
    from engines.kt.experts.cpuinfer import default_cpu_threads

    began = time.perf_counter()
    root, config, built = _checkpoint(args)
    layers = config["num_hidden_layers"]
    progress(f"checkpoint {root}, {layers} layers: " + (f"written in {built:.0f} s" if built else "reused"))
    if args.only and "mtp" in args.phases:  # speculative decoding with the MTP layer only (bench/mtp.py)
        from bench.mtp import measure_v4

        out = Path(args.out) if args.out else root.parent / "results"
        return {"build_s": built, "mtp": measure_v4(root, config, args.threads, out,
                                                    time.perf_counter() + (args.budget or 1800))}
    sizes = Sizes.of(args.quick)
    selected = getattr(args, "v4_phases", None) or SCHEDULE
    threads = args.threads or default_cpu_threads()
    engine = KTEngine(EngineConfig(model_path=str(root), model_name="bench-v4-flash", max_concurrent=max(sizes.levels),
                                   max_model_len=sizes.max_model_len(),
                                   # --chunk-size N: prompt chunks of N tokens (None: the engine's default)
                                   chunk_size=getattr(args, "chunk_size", None),
                                   settings={"kt_use_cuda_graph": getattr(args, "cuda_graph", True),
                                             **({"cpu_infer": args.threads} if args.threads else {}),
                                             # --gpu-prefill-tokens N: prompt chunks stream the experts to the GPU
                                             # (0: never; None: the engine's default)
                                             "kt_gpu_prefill_tokens": getattr(args, "gpu_prefill_tokens", None),
                                             **getattr(args, "settings", {})}))
    started = time.perf_counter()
    engine.start()
    load_s = time.perf_counter() - started
    decode_caches(engine, getattr(args, "v4_decode_caches", "paged"))
    budget = args.budget or 1800
    progress(f"engine loaded in {load_s:.0f} s; phases {', '.join(selected)} in a budget of {budget:.0f} s")
    results: dict = {"shape": "v4-flash", "quick": bool(args.quick), "layers": layers, "build_s": built,
                     "load_s": load_s, "budget_s": budget, "phases_selected": list(selected),
                     # what the engine runs with: N, or "0: why not"
                     "kt_gpu_prefill_tokens": engine.info.details.get("gpu_prefill_tokens"),
                     "v4_decode_caches": getattr(args, "v4_decode_caches", "paged"),
                     "chunk_size": engine.config.chunk_size, "max_model_len": engine.info.max_model_len,
                     "max_concurrent": engine.config.max_concurrent, "engine_details": dict(engine.info.details),
                     "cache_mib_per_sequence": cache_mib_per_sequence(config),
                     "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if args.quick:
        results["note"] = (f"--quick: the tiny demo V4 with prompts {QUICK_DIVISOR} times shorter than the names "
                           "say; a check of the phases, not a measurement")

    def write(figures: dict) -> None:
        graphs = getattr(engine._runner, "graphs", None)
        figures.update(memory=_memory(), steps_from_cuda_graphs=graphs.replayed if graphs is not None else 0,
                       elapsed_s=time.perf_counter() - began)
        if graphs is not None and getattr(graphs, "captured", False):  # whole decode steps: captured at first use
            figures["whole_decode_graphs"] = {
                "steps": graphs.whole_steps, "captures": graphs.whole_captures, "kept": len(graphs.whole),
                "capture_s": round(graphs.whole_capture_s, 3), "made_ahead": graphs.forecasts_used,
                "off": graphs.whole_off}
        write_results(figures, args.out)

    phases = V4Phases(engine, results, sizes=sizes, selected=selected, layers=layers, vocab=config["vocab_size"],
                      deadline=time.perf_counter() + budget, write=write,
                      ceiling=lambda rate: read_ceiling(config, threads, rate,
                                                        nbytes=(64 << 20) if args.quick else (2 << 30)))
    phases.save()
    try:
        phases.run()
    finally:
        write(results)
        engine.stop()
    return results


def decode_caches(engine: Any, mode: str) -> None:
    """Where a started V4 engine's decode rows attend: "paged" (its default, paged.py) or "per-sequence", each
    sequence over its transformers cache in turn, as before the paged caches (a before / after in one call)."""
    runner = engine._runner
    pools = runner.__dict__.setdefault("pools_aside", runner.paged)  # kept while off, for turning them on again
    if mode == "paged" and pools is None:
        raise ValueError("the engine's V4 runner has no paged caches (the MTP head drafts)")
    runner.paged = runner.batch.paged = pools if mode == "paged" else None


def read_ceiling(config: dict, threads: int, decode_tok_s: float | None, nbytes: int = 2 << 30) -> dict:
    """Batch-1 decode against the host's read-bandwidth ceiling for the expert bytes a token reads (issue 58's
    target: >= 0.70 of it); the same figures for all 43 of V4-Flash's layers."""
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
    results = run(args)
    print(json.dumps(results, indent=2))
    write_results(results, args.out)
    return 0
