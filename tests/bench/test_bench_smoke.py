"""The benchmark suite (bench/) runs end to end on the tiny shape and writes its figures with units.

The smoke run builds a tiny V2-Lite-architecture checkpoint, loads the KT engine three times (AMXINT8,
AMXINT4, BF16) and serves one of them over HTTP to streaming clients: about 50 s on 2 cores, hence `slow`
(excluded from the default run; `pytest -m slow tests/bench/test_bench_smoke.py` runs it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import require_kt_kernel

REPO = Path(__file__).resolve().parents[2]
SMOKE_TIMEOUT = 90


def test_v2_lite_checkpoint_has_the_published_size():
    from bench.lib.checkpoint import checkpoint_bytes, tensor_specs
    from bench.lib.shapes import SHAPES

    shape = SHAPES["v2-lite"]
    params, size = checkpoint_bytes(shape.config)
    names = [spec[0] for spec in tensor_specs(shape.config)]
    assert round(params / 1e9, 1) == 15.7 and size == 2 * params
    assert "model.layers.26.mlp.experts.63.down_proj.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight" in names and not any("q_a_proj" in n for n in names)
    # BASELINES.md: 1.35 GB of INT8 expert weights per decoded token
    assert round(shape.routed_expert_bytes_per_token(1.0) / 1e9, 2) == 1.35
    assert round(shape.routed_expert_bytes(1.0) / 1e9, 2) == 14.39  # all 26 x 64 experts in INT8



def test_a_decode_step_reads_each_expert_its_tokens_chose_once():
    from bench.lib.shapes import SHAPES

    shape = SHAPES["v2-lite"]
    assert shape.routed_expert_bytes_per_step(1.0, 1) == shape.routed_expert_bytes_per_token(1.0)
    # 16 tokens choosing 6 of 64 uniformly: 64 * (1 - (58/64)^16) = 50.7 distinct experts a layer
    share = shape.routed_expert_bytes_per_step(1.0, 16) / shape.routed_expert_bytes(1.0)
    assert share == pytest.approx(50.74 / 64, abs=1e-3)
    assert shape.routed_expert_bytes_per_step(1.0, 1000) == pytest.approx(shape.routed_expert_bytes(1.0))


def test_streaming_rounds_show_their_decode_rate_beside_the_bandwidth_ceiling():
    from bench.lib.bandwidth import with_decode_ceiling
    from bench.lib.shapes import SHAPES

    shape = SHAPES["v2-lite"]
    bandwidth = {"copy_bandwidth": {"value": 55.9, "unit": "GB/s"}}
    (one, many) = with_decode_ceiling([{"concurrency": 1, "tpot_median": {"value": 30.0, "unit": "ms"}},
                                       {"concurrency": 32, "tpot_median": {"value": 320.0, "unit": "ms"}}],
                                      shape, bandwidth, "AMXINT8")
    assert one["decode_rate"]["value"] == pytest.approx(1000 / 30, rel=1e-4) and many["decode_rate"]["value"] == 100.0
    assert one["decode_ceiling"]["value"] == pytest.approx(55.9e9 / shape.routed_expert_bytes_per_token(1.0), rel=1e-4)
    # 32 sequences share experts: more tokens per byte read than one sequence, fewer than 32x
    assert 3 * one["decode_ceiling"]["value"] < many["decode_ceiling"]["value"] < 32 * one["decode_ceiling"]["value"]

def test_host_memory_is_reported_from_the_fresh_process_runs_against_the_experts_bytes():
    from bench.summary import host_memory_lines

    gb = lambda v: {"value": v, "unit": "GB"}  # noqa: E731
    data = {"cpu_bandwidth": {"expert_bytes": {"AMXINT8": gb(14.39)}},
            "thread_sweep": {"method": "AMXINT8", "default_threads": 14,
                             "14": {"decode": {}, "memory": {"host_rss": gb(40.0)}},  # the shared main process
                             "12": {"memory": {"host_rss": gb(16.12)}, "child": {"exit": 0},
                                    "memory_after_load": {"host_rss_peak": gb(22.84)}}}}
    (line,) = host_memory_lines(data)
    assert "fresh process (12 threads)" in line and "16.12 GB" in line and "1.12x" in line


def test_host_memory_is_reported_for_the_decodes_that_ran_in_a_child_process():
    from bench.summary import host_memory_lines

    gb = lambda v: {"value": v, "unit": "GB"}  # noqa: E731
    data = {"cpu_bandwidth": {"expert_bytes": {"AMXINT8": gb(14.39), "AMXINT4": gb(7.20)}},
            "kt": {"AMXINT8": {"memory": {"host_rss": gb(30.0)}},  # the primary: the main process
                   "AMXINT4": {"memory": {"host_rss": gb(9.42)}, "child": {"exit": 0},
                               "memory_after_load": {"host_rss_peak": gb(15.8)}}}}
    (line,) = host_memory_lines(data)
    assert line.startswith("host memory, kt AMXINT4 alone in a fresh process (decode): 9.42 GB") and "1.31x" in line


def test_child_runs_decode_under_the_parents_rule_file(tmp_path, monkeypatch):
    from bench.lib import child_runs

    commands = []

    def child(cmd, **kwargs):  # stands in for the child process: records its command, writes its bench.json
        commands.append(cmd)
        result = {"kt": {"AMXINT8": {"decode": {"tok_s": 1.0}}}, "phases": {}, "meta": {}}
        (Path(cmd[cmd.index("--out") + 1]) / "bench.json").write_text(json.dumps(result))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(child_runs.subprocess, "run", child)
    common = dict(shape="tiny", quick=True, model_dir=tmp_path, log_path=tmp_path / "children.log", method="AMXINT8",
                  threads=4, cuda_graph=False, deadline=float("inf"))
    child_runs.child_decode(rules="DeepSeek-V2-Lite-defer.yaml", **common)
    child_runs.child_decode(rules=None, **common)
    deferred, default = commands
    assert deferred[deferred.index("--rules") + 1] == "DeepSeek-V2-Lite-defer.yaml"
    assert "--rules" not in default


def test_child_runs_decode_with_the_parents_engine_settings(tmp_path, monkeypatch):
    from bench.lib import child_runs
    from bench.run import parse_args

    commands = []

    def child(cmd, **kwargs):
        commands.append(cmd)
        result = {"kt": {"AMXINT4": {"decode": {"tok_s": 1.0}}}, "phases": {}, "meta": {}}
        (Path(cmd[cmd.index("--out") + 1]) / "bench.json").write_text(json.dumps(result))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(child_runs.subprocess, "run", child)
    settings = {"kt_gpu_read_experts": 38, "kt_isolate_workers": False, "attention_backend": "torch"}
    child_runs.child_decode(shape="tiny", quick=True, model_dir=tmp_path, log_path=tmp_path / "children.log",
                            method="AMXINT4", threads=None, cuda_graph=True, rules=None, deadline=float("inf"),
                            settings=settings)
    (cmd,) = commands
    assert parse_args(cmd[cmd.index("bench.run") + 1:]).settings == settings  # what the child's engine gets


def tiny_quick_run(tmp_path: Path, phases: str, *extra: str) -> dict:
    """bench.run on the tiny shape, quick, in a subprocess (`extra`: more of its arguments); its bench.json."""
    require_kt_kernel()
    pytest.importorskip("openai")
    out = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--shape", "tiny", "--quick", "--only", phases,
         "--out", str(out), "--model-dir", str(tmp_path / "model"), *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "bench.json").read_text())


@pytest.mark.slow
def test_tiny_quick_run_writes_decode_and_http_figures_with_units(tmp_path):
    require_kt_kernel()
    from engines.kt.experts.methods import available_methods

    methods = ("AMXINT8", "AMXINT4", "BF16")
    here = [m for m in methods if m in available_methods()]  # avx2 builds have no AMX classes
    primary = here[0]
    data = tiny_quick_run(tmp_path, "decode,http", "--methods", ",".join(methods) + ",rules", "--primary", primary,
                          "--client-temperature", "0.7", "--client-top-p", "0.9")

    assert {"date", "torch", "kt_kernel", "kt_cpu_threads", "cpu"} <= set(data["meta"])
    assert {name: p["status"] for name, p in data["phases"].items()} == {
        "model": "ok", "http": "ok", "decode:rules": "ok",
        **{f"decode:{m}": "ok" if m in here else "skipped" for m in methods}}
    for method in [*here, "rules"]:
        result = data["kt"][method]
        assert result["load_time"]["unit"] == "s" and result["load_time"]["value"] > 0
        assert result["decode"]["decode_throughput"]["unit"] == "tok/s"
        assert result["decode"]["decode_throughput"]["value"] > 0
        assert result["decode"]["output_tokens"] == 8
        assert result["memory"]["host_rss_peak"]["unit"] == "GB"
        assert ("child" in result) == (method != primary)  # the others decode alone in a fresh process
    rounds = data["http"]["rounds"]
    assert [r["concurrency"] for r in rounds] == [1, 4]
    for r in rounds:
        assert r["completed"] == r["concurrency"] and not r["timed_out"]
        assert r["output_throughput"]["unit"] == "tok/s" and r["output_throughput"]["value"] > 0
        assert r["tpot_median"]["unit"] == "ms" and r["tpot_p99"]["unit"] == "ms"
        assert r["output_tokens"] == r["concurrency"] * data["http"]["max_tokens"]
    assert (data["http"]["temperature"], data["http"]["top_p"]) == (0.7, 0.9)  # what the clients sent


def test_bench_attention_refuses_a_setting_without_a_value(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "bench.attention", "--out", str(tmp_path), "--setting",
                           "kt_gpu_prefill_memory"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=SMOKE_TIMEOUT)
    assert done.returncode == 2 and "python -m bench.attention: error: --setting: expected KEY=VALUE" in done.stderr
    assert not any(tmp_path.iterdir())  # refused before anything was built


def test_bench_expert_streaming_refuses_held_counts_that_are_not_positive_whole_numbers():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "bench.expert_streaming", "--held", "4,0"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=SMOKE_TIMEOUT)
    assert done.returncode == 2 and "--held: expected positive whole numbers, got '4,0'" in done.stderr


def test_bench_mapped_experts_refuses_shares_past_the_experts_and_calls_past_the_kernels():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for args, message in ((["--shares", "0,65"], "--shares: expected 'auto' or whole numbers up to 64, got '0,65'"),
                          (["--shape", "v4-flash", "--shares", "144,257"],
                           "--shares: expected 'auto' or whole numbers up to 256, got '144,257'"),
                          (["--shape", "v4-flash", "--method", "AMXINT8"],
                           "--method: the v4-flash layers hold released MXFP4 experts, read by the MXFP4 method only"),
                          (["--tokens", "1,129"], "--tokens: calls of at most 128 tokens go through the mapped experts")):
        done = subprocess.run([sys.executable, "-m", "bench.mapped_experts", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=SMOKE_TIMEOUT)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_bench_v4_shares_refuses_configs_and_batches_it_cannot_run():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for args, message in ((["--configs", "112:128,144"], "expected share:prefill pairs of whole numbers, got '144'"),
                          (["--batches", "1,5"], "expected sequence counts of 1 to 4, got '1,5'")):
        done = subprocess.run([sys.executable, "-m", "bench.v4_shares", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=SMOKE_TIMEOUT)
        assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.parametrize("flag, value", [("--client-temperature", "-0.5"), ("--client-top-p", "0")])
def test_bench_run_refuses_client_sampling_the_api_would_refuse(flag, value):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "bench.run", "--only", "http", flag, value],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT)
    assert done.returncode == 2 and f"{flag}: " in done.stderr


def test_the_primary_method_decodes_first_and_serves_the_ttft_and_http_phases(tmp_path):
    from bench.run import Bench, parse_args

    args = parse_args(["--primary", "AMXINT4", "--only", "decode,ttft,http", "--out", str(tmp_path),
                       "--model-dir", str(tmp_path / "model")])
    bench = Bench(args, 0.0)
    assert bench.steps == ["decode:AMXINT4", "ttft", "http", "decode:AMXINT8", "decode:BF16"]
    assert bench.results["meta"]["primary"] == "AMXINT4"


def test_http_levels_replace_the_plans_rounds_and_size_the_engine_for_them(tmp_path):
    import argparse

    from bench.run import Bench, levels, parse_args

    bench = Bench(parse_args(["--only", "http", "--http-levels", "16,32", "--out", str(tmp_path),
                              "--model-dir", str(tmp_path / "model")]), 0.0)
    assert bench.plan.http_levels == (16, 32) and bench.kt_config("AMXINT8").max_concurrent == 32
    with pytest.raises(argparse.ArgumentTypeError, match="'4,0' is not a comma-separated list"):
        levels("4,0")


def test_a_method_decoded_in_a_child_is_set_against_this_runs_ceiling(tmp_path, monkeypatch):
    from bench.run import Bench, parse_args

    bench = Bench(parse_args(["--only", "baseline,decode", "--methods", "AMXINT4", "--out", str(tmp_path),
                              "--model-dir", str(tmp_path / "model"), "--setting", "kt_gpu_read_experts=38"]), 0.0)
    bench.results["cpu_bandwidth"] = {"ceiling": {"AMXINT4": {"value": 80.0, "unit": "tok/s"}}}
    asked = {}

    def child(method, threads, deadline, env=None, settings=None):
        asked.update(method=method, settings=settings)
        return {"decode": {"decode_throughput": {"value": 60.0, "unit": "tok/s"}}, "child": {"exit": 0}}

    monkeypatch.setattr(bench, "_child_decode", child)
    bench.step_decode("AMXINT4", float("inf"))
    assert asked == {"method": "AMXINT4", "settings": {"kt_gpu_read_experts": 38}}
    assert bench.results["kt"]["AMXINT4"]["decode"]["fraction_of_ceiling"]["value"] == 0.75


def test_bench_run_refuses_a_primary_method_it_does_not_know(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "bench.run", "--primary", "INT3", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT)
    assert done.returncode == 2 and "argument --primary: invalid choice: 'INT3'" in done.stderr
    assert not any(tmp_path.iterdir())  # refused before anything was built


@pytest.mark.slow
def test_tiny_quick_attention_phase_times_a_cached_prefix_and_a_round_per_backend(tmp_path):
    backends = tiny_quick_run(tmp_path, "attention")["attention"]["backends"]
    assert set(backends) == {"flashinfer", "torch"}
    torch_run = backends["torch"]
    assert torch_run["cached_prefix"]["cached_tokens"] == 1920
    assert torch_run["cached_prefix"]["ttft_cached"]["value"] < torch_run["cached_prefix"]["ttft_cold"]["value"]
    assert torch_run["context_128"]["completed"] == 2
    assert "error" in backends["flashinfer"] or "cached_prefix" in backends["flashinfer"]


def test_the_summary_gives_each_attention_backend_its_cached_ttft_and_rounds():
    from bench.summary import attention_lines

    s = lambda v: {"value": v, "unit": "s"}  # noqa: E731
    data = {"attention": {"clients": 32, "backends": {
        "flashinfer": {"error": "ValueError: flashinfer cannot run here"},
        "torch": {"cached_prefix": {"ttft_cached": s(0.27), "ttft_cold": s(2.73)},
                  "context_512": {"output_throughput": {"value": 50.1, "unit": "tok/s"},
                                  "tpot_median": {"value": 566.0, "unit": "ms"}},
                  "context_16384": {"skipped": "deadline (3s left)"}}}}}
    failed, measured = attention_lines(data)
    assert failed == "attention flashinfer: ValueError: flashinfer cannot run here"
    assert "cached-prefix TTFT 0.270 s (cold 2.730 s)" in measured and "512: 50.1 tok/s, TPOT 566.0 ms" in measured
    assert "context_16384: deadline (3s left)" in measured


def test_slow_token_gaps_are_split_by_what_the_engine_counted_and_matched_with_garbage_collections():
    from bench.lib.engine_runs import Generation
    from engines.base import EngineStats, StepTimes

    # ten tokens 30 ms apart, but the gap after the fifth takes 60 ms: 25 of them waiting on the experts
    gaps = [0.030] * 4 + [0.060] + [0.030] * 4
    times = [1.0 + sum(gaps[:i]) for i in range(len(gaps) + 1)]
    stats, gpu, wait = [], 0.0, 0.0
    for i in range(len(times)):
        if i:
            gpu, wait = gpu + 0.006, wait + (0.045 if i == 5 else 0.020)
        stats.append(EngineStats(steps=i, times=StepTimes(gpu=gpu, expert_wait=wait)))
    gen = Generation(prompt_tokens=8, submitted=0.9, token_times=times, stats=stats,
                     gc_pauses=[(times[4] + 0.01, times[4] + 0.012, 2), (0.5, 0.6, 0)])  # the second: before decode

    slow = gen.figures()["slow_steps"]

    assert (slow["count"], slow["of"]) == (1, 9)
    assert slow["gap_mean"]["value"] == pytest.approx(60.0)
    assert slow["expert_wait_mean"]["value"] == pytest.approx(45.0)
    assert slow["gpu_mean"]["value"] == pytest.approx(6.0)
    assert slow["other_mean"]["value"] == pytest.approx(9.0)
    assert slow["with_gc"] == 1
    assert slow["gc_while_decoding"]["collections"] == 1 and slow["gc_while_decoding"]["by_generation"] == [0, 0, 1]


def test_a_decode_trace_splits_gpu_time_into_busy_short_gaps_and_expert_waits():
    from bench.decode_trace import summarize

    # one step of two MoE layers: a 10 us kernel, a 4 us gap, a 6 us copy, a 900 us wait on the experts, a 10 us
    # kernel, a 3 us gap, a 5 us kernel, a 1,000 us wait, a 20 us kernel
    acts = [(0, 10, "k"), (14, 20, "Memcpy DtoH (Device -> Pinned)"), (920, 930, "k"), (933, 938, "k"),
            (1938, 1958, "head")]
    s = summarize(acts, steps=1, moe_layers=2)
    assert s["activities_per_step"] == 5 and s["copies_per_step"] == 1 and s["activities_per_moe_layer"] == 2.5
    assert s["busy_ms_per_step"] == 0.051
    assert (s["short_gaps_per_step"], s["short_gap_ms_per_step"]) == (2, 0.007)
    assert (s["long_gaps_per_step"], s["long_gap_ms_per_step"]) == (2, 1.9)
    assert s["span_ms_per_step"] == 1.958
    assert s["top_us_per_step"][0] == ("k", 3, 25.0)


def test_padding_pays_from_the_fewest_tokens_after_which_every_padded_call_was_faster():
    from bench.expert_padding import pays_from

    def row(tokens, ms, padded):
        return {"tokens": tokens, "matrix_tokens": 43, "ms": ms, "ms_padded": padded}

    rows = [row(8, 5.2, 5.1), row(16, 7.7, 7.8), row(24, 8.5, 7.2), row(32, 9.4, 7.9), row(43, 9.0, 9.0)]
    assert pays_from(rows) == 24  # 8 was faster padded too, but 16 was not
    assert pays_from([row(32, 9.4, 9.5)]) is None


def test_the_sampling_benchmark_prints_a_step_time_per_kind_and_device():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "bench.sampling", "--rows", "2", "--vocab", "64", "--repeats", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    prompt = [line for line in lines if "prompt_positions" in line]
    assert {(line["top"], line["device"]) for line in prompt} >= {(0, "cpu"), (5, "cpu")}
    assert all(line["prompt_positions"] == 2048 and line["ms"] > 0 for line in prompt)
    lines = [line for line in lines if line not in prompt]
    cpu = {line["kind"]: line for line in lines if line["device"] == "cpu"}
    assert set(cpu) == {"greedy", "temperature", "top_p", "top_k", "logprobs", "penalties", "json"}
    assert all(line["ms"] > 0 for line in lines)
    assert cpu["temperature"]["multinomial_ms"] > 0


def test_the_sampling_benchmark_names_the_kinds_it_does_not_know():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "bench.sampling", "--kinds", "greedy,beam"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT)
    assert done.returncode == 2 and "--kinds: unknown beam" in done.stderr


def test_bench_refuses_an_http_max_tokens_that_is_not_positive(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "bench.run", "--out", str(tmp_path), "--http-max-tokens", "0"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=SMOKE_TIMEOUT)
    assert done.returncode == 2 and "--http-max-tokens: 0 is not a positive number of tokens" in done.stderr
    assert not any(tmp_path.iterdir())  # refused before anything was built


def test_fp8_shapes_are_written_as_deepseek_ships_its_fp8_releases(tmp_path):
    from bench.lib.checkpoint import build_checkpoint, checkpoint_bytes
    from bench.lib.shapes import SHAPES
    from engines.checkpoints.source import SafetensorsSource, StoredExperts

    config = {**SHAPES["tiny-fp8"].config, "vocab_size": 1024, "num_hidden_layers": 2}
    cost = build_checkpoint(tmp_path, config, shard_bytes=1 << 20, writers=1, device="cpu")
    assert cost["bytes"] == sum(f.stat().st_size for f in tmp_path.glob("*.safetensors")) - sum(
        8 + int.from_bytes(f.read_bytes()[:8], "little") for f in tmp_path.glob("*.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv" in index
    assert "model.layers.2.eh_proj.weight" in index  # the MTP layer
    items = list(SafetensorsSource(tmp_path, 2).items(num_experts=16))
    experts = [i for i in items if isinstance(i, StoredExperts)]
    assert [e.prefix for e in experts] == ["model.layers.1.mlp.experts"] and experts[0].stored_as == "FP8"
    assert SHAPES["v2-lite-fp8"].fp8 and checkpoint_bytes(SHAPES["v2-lite-fp8"].config)[1] < \
        checkpoint_bytes(SHAPES["v2-lite"].config)[1] * 0.6


@pytest.mark.slow
def test_bench_v4_batch_prints_each_levels_aggregate_decode_and_one_expert_call_a_step(tmp_path):
    require_kt_kernel()
    done = subprocess.run([sys.executable, "-m", "bench.v4_batch", "--model-dir", str(tmp_path / "v4-small"),
                           "--layers", "2", "--clients", "1,3", "--prompt", "16", "--tokens", "6",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=SMOKE_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "v4-batch.json").read_text())
    assert [level["clients"] for level in data["levels"]] == [1, 3]
    for level in data["levels"]:
        assert level["decode_tok_s_total"] > 0 and level["wall_tok_s"] > 0
    assert data["levels"][1]["expert_calls_per_step"] < 1.5  # three sequences' rows in one call, not three


@pytest.mark.parametrize("kind, projected", [("off", False), ("random", True), ("last-layer", True),
                                             ("random-adaptive", False)])
def test_mtp_projects_a_trained_layers_speed_only_from_runs_that_draft_every_step(kind, projected):
    """bench/mtp.py: the speed at a trained MTP layer's acceptance is projected from a drafted step's time, so only
    runs drafting in every step give it; the adaptive run's median step is mostly a plain one."""
    from types import SimpleNamespace

    from bench.mtp import TRAINED_ACCEPTANCE, _decode

    stats = iter([SimpleNamespace(draft_tokens=0, accepted_draft_tokens=0, draft_paused=False, draft_paused_steps=0),
                  SimpleNamespace(draft_tokens=30, accepted_draft_tokens=3, draft_paused=True, draft_paused_steps=96)])
    run = SimpleNamespace(warm_up=lambda vocab: None, load_time=1.0, close=lambda: None,
                          decode=lambda *args: {"step_breakdown": {"step": {"value": 20.0, "unit": "ms"}}},
                          engine=SimpleNamespace(stats=lambda: next(stats), info=SimpleNamespace(details={})))
    entry = _decode(run, kind, 64, 32, 1000, float("inf"))["decode"]
    assert ("projected_decode_throughput" in entry) == projected
    if projected:
        assert entry["projected_decode_throughput"]["value"] == pytest.approx((1 + TRAINED_ACCEPTANCE) / 0.02)
    assert ("draft_paused_steps" in entry) == (kind == "random-adaptive")
