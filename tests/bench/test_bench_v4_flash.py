"""bench/v4_flash.py's phases: which run, in what order, which are skipped for the budget or the context and why,
what each reports and the targets block, against an engine that answers at once on a simulated clock (no model)."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench.v4_flash import (CONTEXTS, DECODE_TOKENS, SCHEDULE, TARGETS, Sizes, V4Phases, decision, derived,
                            expected_prefill_s, select_phases, write_results)
from engines.base import EngineStats, GenerationOutput


def test_phases_are_picked_by_name_or_group_and_run_in_the_schedules_order():
    assert select_phases(None) == SCHEDULE and select_phases(" ") == SCHEDULE
    assert select_phases("ctx128k,decode") == ("decode", "ctx128k")
    assert select_phases("ttft") == ("ctx2k", "ctx8k", "ctx32k", "ctx128k")
    assert select_phases("tpot,clients") == ("ctx1k", "ctx8k", "clients", "ctx32k", "ctx128k")
    with pytest.raises(ValueError, match="ctx64k"):
        select_phases("decode,ctx64k")


@pytest.mark.parametrize("argv, message", [(["--v4-phases", "decode,bogus"], "--v4-phases: unknown phase(s) bogus"),
                                           (["--chunk-size", "0"], "--chunk-size: 0 is not a positive number")])
def test_bench_run_refuses_v4_phases_it_does_not_know_and_chunks_of_no_tokens(argv, message, capsys):
    from bench.run import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--shape", "v4-flash", *argv])
    assert message in capsys.readouterr().err
    args = parse_args(["--shape", "v4-flash", "--v4-phases", "cached,decode", "--chunk-size", "16384"])
    assert args.v4_phases == ("decode", "cached") and args.chunk_size == 16384


def test_a_prefill_is_expected_linearly_or_on_the_curve_through_the_two_longest_prompts():
    assert expected_prefill_s([], 1024) is None
    assert expected_prefill_s([(2048, 1.0)], 8192) == pytest.approx(4.0)
    # sublinear growth (a fixed cost): the longest prompt's time scaled
    assert expected_prefill_s([(1024, 1.0), (8192, 2.0)], 32768) == pytest.approx(8.0)
    # t = 1e-4 n + 1e-9 n^2 through 8k and 32k: 128k exactly on it, above the linear guess
    t = lambda n: 1e-4 * n + 1e-9 * n * n  # noqa: E731
    points = [(1024, t(1024)), (8192, t(8192)), (32768, t(32768))]
    assert expected_prefill_s(points, 131072) == pytest.approx(t(131072))
    assert t(131072) > t(32768) * 4


def test_a_phase_is_skipped_when_the_budget_left_does_not_hold_its_expected_time():
    assert decision(100.0, None) is None and decision(100.0, 50.0) is None
    assert decision(0.0, None) == "the budget ended before it"
    assert "expected ~90 s" in decision(100.0, 90.0)  # 90 s x the 1.2 margin is past the 100 left


def test_the_engine_serves_128k_and_the_decoded_tokens_within_v4s_cache_budget():
    """The bench's max_model_len (128k, the decoded tokens and room) at 32 sequences: V4's cache budget
    (kv_cache_tokens' default) holds one sequence that long, so the engine does not shorten the context."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    from bench.v4_flash import flash_config
    from engines.kt.families.base import LoadContext
    from engines.kt.families.deepseek_v4.family import _cache_budget
    from engines.kt.options import KTOptions

    sizes = Sizes.of(quick=False)
    assert sizes.max_model_len() >= CONTEXTS["128k"] + DECODE_TOKENS + 1
    for layers in (4, 43):
        context = LoadContext(model_path=Path("."), config=DeepseekV4Config(**flash_config(layers)), rule_file=Path("."),
                              rules=[], max_model_len=sizes.max_model_len(), max_concurrent=max(sizes.levels),
                              chunk_size=None, dtype_setting=None, options=KTOptions())
        budget, served = _cache_budget(context, torch.bfloat16, drafting=False)
        assert served == sizes.max_model_len(), layers
        assert budget.sizes.at(CONTEXTS["128k"] + DECODE_TOKENS + 1) <= budget.capacity


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """Answers each request at once, advancing the clock by the prompt's prefill (1e-4 s a token + 1e-9 s per
    token squared) and a decode step a token, a step shared by the requests decoding together (a batched step
    costs what one does); prompts longer than `fails_past` end in an engine error."""

    def __init__(self, clock: Clock, max_model_len: int = 200_000, fails_past: int | None = None):
        self.clock, self.steps, self.fails_past, self.decoding = clock, 0, fails_past, 0
        self.info = SimpleNamespace(max_model_len=max_model_len)
        self.config = SimpleNamespace(chunk_size=2048)
        self.prompts: list[int] = []

    def prefill_s(self, n: int) -> float:
        return 1e-4 * n + 1e-9 * n * n

    def stats(self) -> EngineStats:
        return EngineStats(steps=self.steps)

    def submit(self, request):
        return FakeHandle(self, request)


class FakeHandle:
    def __init__(self, engine: FakeEngine, request):
        self.engine, self.request = engine, request

    def cancel(self) -> None:
        pass

    def __aiter__(self):
        return self._outputs()

    async def _outputs(self):
        engine, n = self.engine, len(self.request.prompt_token_ids)
        engine.prompts.append(n)
        await asyncio.sleep(0)
        if engine.fails_past is not None and n > engine.fails_past:
            yield GenerationOutput(request_id="r", finish_reason="error", error="CUDA out of memory")
            return
        engine.clock.now += engine.prefill_s(n)
        tokens = self.request.sampling.max_tokens
        engine.decoding += 1
        for i in range(tokens):
            if i:  # a decode step, longer at long contexts, its share of it
                engine.clock.now += 0.001 * (1 + n / 1e6) / engine.decoding
            engine.steps += 1
            await asyncio.sleep(0)
            yield GenerationOutput(request_id="r", token_ids=[101], finish_reason="length" if i == tokens - 1 else None)
        engine.decoding -= 1


def phases(monkeypatch, engine: FakeEngine, budget: float, selected=SCHEDULE, writes: list | None = None) -> V4Phases:
    monkeypatch.setattr(time, "perf_counter", engine.clock)
    written = writes if writes is not None else []
    return V4Phases(engine, {}, sizes=Sizes.of(quick=False), selected=selected, layers=4, vocab=32000,
                    deadline=engine.clock() + budget, write=lambda r: written.append(json.loads(json.dumps(r))),
                    ceiling=lambda rate: {"read_bandwidth": {"value": 100.0, "unit": "GB/s"}, "ceiling_tok_s": 100.0,
                                          "fraction_of_ceiling": rate / 100.0 if rate else None})


def test_every_phase_reports_its_figures_and_the_targets_block_sets_each_against_the_issues(monkeypatch):
    writes: list = []
    engine = FakeEngine(Clock())
    results = phases(monkeypatch, engine, budget=1000.0, writes=writes).run()
    assert list(results["phases"]) == list(SCHEDULE)
    assert all(p["status"] == "ok" for p in results["phases"].values()), results["phases"]
    assert results["decode_batch1"]["decoded_tokens"] == DECODE_TOKENS
    assert results["read_ceiling"]["fraction_of_ceiling"] == pytest.approx(10.0, rel=1e-3)  # the fake ceiling: rate / 100
    contexts = results["contexts"]
    assert list(contexts) == ["1k", "2k", "8k", "32k", "128k"]  # in the order they ran
    for name, c in contexts.items():
        assert c["prompt_tokens"] == CONTEXTS[name] and c["decoded_tokens"] == DECODE_TOKENS
        assert c["ttft_s"] == pytest.approx(engine.prefill_s(CONTEXTS[name]))
        assert c["ttft_s_43_layers"] == pytest.approx(c["ttft_s"] * 43 / 4)
        assert c["prompt_tok_s"] == pytest.approx(CONTEXTS[name] / c["ttft_s"])
    assert results["tpot_128k_over_1k"] == pytest.approx((1 + 131072 / 1e6) / (1 + 1024 / 1e6))
    assert [t["context"] for t in results["ttft_scaled_to_43_layers_s"]] == ["2k", "8k", "32k", "128k"]
    assert [c["clients"] for c in results["clients"]] == [1, 4, 16, 32]
    assert [c["ratio_to_batch1"] for c in results["clients"]] == pytest.approx([1, 4, 16, 32], rel=0.05)
    assert results["targets"]["clients_32_over_batch1"]["met"] is True
    cached = results["cached_prefix"]
    assert cached["prompt_tokens"] == 30_064 and cached["cached_tokens"] == 0
    assert results["warm_up"]["prompt_tokens"] == 2048  # one chunk before the first context
    assert set(results["targets"]) == {name for name, _, _ in TARGETS}
    for target in results["targets"].values():
        assert target["value"] is not None and isinstance(target["met"], bool)
    assert results["targets"]["ttft_2k_s_43_layers"]["met"] == (contexts["2k"]["ttft_s_43_layers"] <= 2.5)
    # written after every phase and every client level, the figures so far each time
    assert len(writes) == len(SCHEDULE) + len(results["clients"])
    assert list(writes[0]["phases"]) == ["decode"] and "targets" in writes[0]


def test_a_budget_that_does_not_hold_the_longest_prompt_skips_it_with_why_and_runs_the_rest(monkeypatch):
    engine = FakeEngine(Clock())
    results = phases(monkeypatch, engine, budget=40.0).run()
    skipped = {name: p for name, p in results["phases"].items() if p["status"] == "skipped"}
    assert list(skipped) == ["ctx128k"], results["phases"]
    # expected from the 8k and 32k prompts' curve: what the fake takes, and the decode after it
    assert skipped["ctx128k"]["expected_s"] == pytest.approx(engine.prefill_s(131072), rel=0.01)
    assert "more than the" in skipped["ctx128k"]["reason"]
    assert CONTEXTS["128k"] not in engine.prompts
    assert results["targets"]["tpot_128k_over_1k"] == {"value": None, "target": 1.2, "compare": "<=", "met": None}


def test_phases_past_the_served_context_are_skipped_and_a_failing_one_leaves_the_others(monkeypatch):
    engine = FakeEngine(Clock(), max_model_len=40_000, fails_past=20_000)
    results = phases(monkeypatch, engine, budget=1000.0, selected=("ctx8k", "ctx32k", "cached", "ctx128k")).run()
    p = results["phases"]
    assert p["ctx8k"]["status"] == "ok"
    assert p["ctx32k"]["status"] == "failed" and "CUDA out of memory" in p["ctx32k"]["reason"]
    assert p["cached"]["status"] == "failed"
    assert p["ctx128k"]["status"] == "skipped" and "past the 40000 the engine serves" in p["ctx128k"]["reason"]
    assert "decode_batch1" not in results and results["targets"]["ttft_32k_s_43_layers"]["met"] is None


def test_client_levels_past_the_budget_are_skipped_with_the_larger_ones_after_them(monkeypatch):
    engine = FakeEngine(Clock())
    run = phases(monkeypatch, engine, budget=1000.0, selected=("decode", "ctx8k", "clients"))
    run.level_expected = lambda level: 2000.0 if level >= 16 else 0.1  # type: ignore[method-assign]
    results = run.run()
    assert [c["clients"] for c in results["clients"]] == [1, 4]
    skipped = results["phases"]["clients"]["levels_skipped"]
    assert list(skipped) == ["16", "32"] and "expected ~2000 s" in skipped["16"]
    assert skipped["32"] == "a smaller level was skipped"
    assert results["targets"]["clients_16_over_batch1"]["met"] is None


def test_derived_figures_leave_out_a_tpot_measured_over_fewer_tokens_than_asked():
    results = {"contexts": {"1k": {"prompt_tokens": 1024, "tpot_ms": 10.0, "decoded_tokens": DECODE_TOKENS},
                            "128k": {"prompt_tokens": 131072, "tpot_ms": 11.0, "decoded_tokens": 5}}}
    out = derived(results)
    assert out["tpot_ms_by_context"] == {"1k": 10.0} and out["tpot_128k_over_1k"] is None
    results["contexts"]["128k"]["decoded_tokens"] = DECODE_TOKENS
    assert derived(results)["tpot_128k_over_1k"] == pytest.approx(1.1)
    assert derived(results)["targets"]["tpot_128k_over_1k"]["met"] is True


def test_results_are_replaced_whole_in_the_out_folder(tmp_path):
    write_results({"shape": "v4-flash", "kt_gpu_prefill_tokens": "0: no GPU", "phases": {}}, tmp_path)
    write_results({"shape": "v4-flash", "kt_gpu_prefill_tokens": "128", "phases": {"decode": {}}}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v4-flash-streamed.json", "v4-flash.json"]
    assert json.loads((tmp_path / "v4-flash-streamed.json").read_text())["phases"] == {"decode": {}}
    write_results({"shape": "v4-flash"}, None)  # no folder: nothing written


def test_v4_flash_caches_per_128k_tokens_are_what_the_architecture_implies():
    from bench.v4_flash import cache_mib_per_sequence, flash_config

    config = flash_config(4)
    sizes = cache_mib_per_sequence(config)
    # counted from V4-Flash's layout alone: per CSA layer one entry of head_dim keys and one of index_head_dim
    # indexer keys per 4 positions, per HCA layer one of head_dim per 128, per layer the window's last 127 keys
    # (two tensors on the two plain sliding-window layers), bf16
    full = flash_config(43)
    p, e, d, di = 131072, 2, full["head_dim"], full["index_head_dim"]
    ratios = full["compress_ratios"]
    implied = (sum(p // 4 * (d + di) for r in ratios if r == 4) + sum(p // 128 * d for r in ratios if r == 128)
               + 127 * d * (len(ratios) + ratios.count(0))) * e / 2**20
    assert abs(sizes["43_layers"]["128k"] - implied) / implied < 0.05, (sizes["43_layers"]["128k"], implied)
    assert sizes["layers"]["1k"] < sizes["layers"]["32k"] < sizes["layers"]["128k"]
