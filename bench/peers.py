"""python -m bench.peers: ktserve side by side with ik_llama.cpp and llama.cpp, same machine, same weights, one run.

    python -m bench.peers pack SDIST... [--out .peers]     # here: slim the PyPI source archives for a device call
    python -m bench.peers build [--sources .peers]         # on the GPU machine: build both (resumable)
    python -m bench.peers [bench.run options]              # = python -m bench.run --only baseline,decode,ttft,http,peers
    python -m bench.peers table B/bench.json C/bench.json [--out peers.json]   # one table from several calls

The `peers` phase of bench.run (bench/run.py) builds both engines with CUDA (bench/lib/peer_build.py, trimmed to the
GGUF types used), converts the run's random checkpoint to GGUF with llama.cpp's converter (bench/peer_gguf.py),
quantizes it to Q8_0 and Q4_0 (against ktserve's AMXINT8 and AMXINT4 experts), runs each engine's llama-bench
(decode: 128 tokens after 512 of context; prefill: 512 / 2,048 / 8,192 tokens) and llama-server under the
`http` phase's streaming clients (16 and 32, with as many slots), serves the very same GGUF files with ktserve
(its own row, e.g. "ktserve (GGUF Q8_0)", measured by the code that measures its safetensors run), then sets
ktserve's figures of the same run beside theirs: bench.json's `peers` holds `engines` (name, version, bits,
figures) and `ratios` (ktserve / the best peer at the primary method's bits), `ratios_by_bits`,
`ratios_cpu_prefill_by_bits` and `ratios_gguf_by_bits`. ktserve also gets a row with the settings its defaults
replaced on 2026-11-28, every routed expert of a prompt on the CPU (`--kt-gpu-prefill-tokens 0 --chunk-size 2048`,
"ktserve (prompts' experts on the CPU)"), at each bits. See bench/README.md."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench.lib.report import fig

QUANT_FOR = {"AMXINT8": "Q8_0", "AMXINT4": "Q4_0"}  # ktserve's experts -> the GGUF type of the same bits
BITS = {"AMXINT8": "INT8", "AMXINT4": "INT4", "Q8_0": "8-bit", "Q4_0": "4-bit"}
PREFILL = (512, 2048, 8192)
CLIENTS = (16, 32)
GGUF_ROW_SECONDS = 150  # the most one ktserve-on-GGUF row may take (load, decode, prefill, two rounds)
GGUF_ROW_MIN_SECONDS = 90  # and the least it starts with: the load alone is not bounded by the deadline
# ktserve with every routed expert of a prompt on the CPU, in chunks of 2,048 tokens: its defaults until prompt chunks
# streamed the experts to the GPU wherever the host holds the copies (docs/performance.md, "Speed history"), beside the run's own row
CPU_PREFILL = {"kt_gpu_prefill_tokens": 0, "chunk_size": 2048}
CPU_PREFILL_ROW_NAME = "ktserve (prompts' experts on the CPU)"
CPU_PREFILL_ROW_SECONDS = 120  # the most that row may take: load (~25-35 s), decode, prompts, rounds
CPU_PREFILL_ROW_MIN_SECONDS = 60
KTSERVE_ROWS = ("cpu-prefill", "gguf")  # --peers-ktserve: ktserve's rows beside its own run's
RATIOS = ("decode", "prefill_2048", "prefill_8192", "clients_16", "clients_32")
REPO = Path(__file__).resolve().parents[1]
DEFAULT_SOURCES = REPO / ".peers"
DEFAULT_WORK = Path("/tmp/ktserve-peers")
ENGINE_NAMES = ("llama.cpp", "ik_llama.cpp")  # bench/lib/peer_build.py's ENGINES
# GGUF bytes per checkpoint (bf16) byte: Q8_0 34/64, Q4_0 18/64 (blocks of 32 with an f16 scale)
GGUF_SHARE = {"bf16": 1.0, "Q8_0": 34 / 64, "Q4_0": 18 / 64}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers-sources", type=Path, default=DEFAULT_SOURCES,
                   help="folder with the peers' source archives: <engine>.tar.xz from `python -m bench.peers pack`, "
                        "or the PyPI .tar.gz files (default: .peers/ in the repository)")
    p.add_argument("--peers-work", type=Path, default=DEFAULT_WORK,
                   help="where the peers are unpacked and built; a build left unfinished there continues")
    p.add_argument("--peers-repetitions", type=int, default=2, help="llama-bench -r (default 2)")
    p.add_argument("--peers-build-budget", type=float, default=150,
                   help="seconds the phase may spend finishing the peers' builds (default 150; `python -m bench.peers "
                        "build` does them ahead); a peer still unbuilt is left out, its build recorded")
    p.add_argument("--peers-engines", type=engine_list, default=ENGINE_NAMES,
                   help=f"comma-separated peers to build and run, of: {','.join(ENGINE_NAMES)} (default: both; "
                        "llama.cpp's archive is unpacked for its GGUF converter either way)")
    p.add_argument("--peers-ktserve", type=ktserve_rows, default=KTSERVE_ROWS, metavar="ROWS",
                   help="ktserve's rows beside its run's own, comma-separated, of: cpu-prefill (every routed "
                        "expert of a prompt on the CPU, "
                        f"{' '.join(f'{k}={v}' for k, v in CPU_PREFILL.items())}, at each bits measured), gguf "
                        "(serving the peers' GGUF files); `none` for neither (default: both)")


def engine_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(set(names) - set(ENGINE_NAMES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {', '.join(unknown) or '(none)'}; known: "
                                         f"{', '.join(ENGINE_NAMES)}")
    return names


def ktserve_rows(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip() and n.strip() != "none")
    unknown = sorted(set(names) - set(KTSERVE_ROWS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown ktserve row(s) {', '.join(unknown)}; known: "
                                         f"{', '.join(KTSERVE_ROWS)}, none")
    return names


# ------------------------------------------------------------------------------------------------ the phase
def phase_estimate(bench: Any) -> float:
    """Seconds the phase should take as bench.run's args ask for it: the shape's `peers_parts` (the parts' times
    measured on one H200 machine, bench/lib/shapes.py) summed over the builds still to finish, each bits' llama-bench
    runs, ktserve rows and server rounds; the shape's `peers` figure where it has no parts."""
    from bench.lib.peer_build import built

    e = bench.plan.estimates
    parts = e.get("peers_parts")
    if not parts:
        return e["peers"]
    args = bench.args
    engines = args.peers_engines
    rows = getattr(args, "peers_ktserve", KTSERVE_ROWS)
    quants = list(dict.fromkeys(QUANT_FOR[m] for m in (bench.primary, *args.methods) if m in QUANT_FOR))
    total = parts["build"] if not all(built(args.peers_work, n) for n in engines) else 0.0
    for i, _ in enumerate(quants):
        first = i == 0
        total += len(engines) * parts["bench" if first else "bench_decode"]
        total += parts["cpu_prefill" if first else "cpu_prefill_no_clients"] * ("cpu-prefill" in rows)
        total += parts["gguf" if first else "gguf_decode"] * ("gguf" in rows)
        total += len(engines) * (parts["server_16"] + parts["server_32"]) * first
    return total


def run_peers(bench: Any, deadline: float, save: Callable[[dict], None]) -> dict:
    """The `peers` phase for bench.run's Bench: build, convert, measure; the section (also passed to `save` as it
    grows, so a run cut short keeps what it measured)."""
    import torch

    from bench.lib.peer_build import binaries, build_all, find_archives, quantizer, unpack

    args = bench.args
    methods = [m for m in (bench.primary, *args.methods) if m in QUANT_FOR]
    quants = list(dict.fromkeys(QUANT_FOR[m] for m in methods))
    section: dict = {"threads": bench.threads, "quants": quants, "engines": [], "ratios": {}}
    archives = find_archives(args.peers_sources, args.peers_engines)
    converter = find_archives(args.peers_sources, ("llama.cpp",))
    if not archives or not converter:
        raise ValueError(f"--peers-sources {args.peers_sources}: the archives of {', '.join(args.peers_engines)} and "
                         "llama.cpp's (its GGUF converter) are needed (python -m bench.peers pack)")
    work: Path = args.peers_work
    work.mkdir(parents=True, exist_ok=True)
    unpack(converter["llama.cpp"], work)
    build_deadline = min(deadline - 60, time.perf_counter() + args.peers_build_budget)
    section["build"] = build_all(archives, work, os.cpu_count() or 1, build_deadline, torch.cuda.is_available())
    save(section)
    ready = {name: binaries(work, name) for name, b in section["build"].items() if b.get("finished")}
    quantize = quantizer(work)
    if quantize is None:
        raise RuntimeError("no llama-quantize built to make the GGUF files: see peers.build")
    files = section["gguf"] = make_ggufs(bench.model_dir, work, quantize.parent, quants, bench.threads, deadline)
    save(section)
    from bench.lib.peer_runs import Peer, version_of

    peers = [Peer(name, path, version_of(path) or "?", bench.threads) for name, path in ready.items()]
    measured: dict[tuple[str, str], dict] = {}
    on_gguf: dict[str, dict] = section.setdefault("ktserve_gguf", {})
    cpu_prefill: dict[str, dict] = section.setdefault("ktserve_cpu_prefill", {})
    rows = getattr(args, "peers_ktserve", KTSERVE_ROWS)

    def refresh() -> None:
        section["engines"] = engine_entries(bench, measured, on_gguf, cpu_prefill)
        save(section)

    # the first file (the primary method's bits) gets every figure; the others decode only (ktserve's CPU-prefill row
    # its prompts too). Peers' llama-bench first, then ktserve's CPU-prefill row and ktserve on the same file, then the
    # servers, 16 clients of each peer before 32 of either
    for i, quant in enumerate(quants):
        gguf = Path(files[quant]["path"])
        for peer in peers:
            entry = measured.setdefault((peer.name, quant), {
                "name": peer.name, "version": f"{section['build'][peer.name].get('package')} ({peer.version})",
                "bits": quant, "gguf": str(gguf), "runs": []})
            measure_bench(peer, gguf, entry, args.peers_repetitions, deadline, work, decode_only=i > 0)
            refresh()
        method = next(m for m in methods if QUANT_FOR[m] == quant)
        if "cpu-prefill" in rows:
            cpu_prefill[method] = measure_ktserve_cpu_prefill(
                bench, method, min(deadline - 20, time.perf_counter() + CPU_PREFILL_ROW_SECONDS), clients=i == 0)
            refresh()
        if "gguf" in rows:
            on_gguf[quant] = measure_ktserve_gguf(bench, gguf, min(deadline - 20, time.perf_counter() +
                                                                   GGUF_ROW_SECONDS), full=i == 0)
            refresh()
        for level in CLIENTS if i == 0 else ():
            for peer in peers:
                measure_server(peer, gguf, measured[(peer.name, quant)], bench, level, deadline, work)
                refresh()
    section["engines"] = engine_entries(bench, measured, on_gguf, cpu_prefill)
    section.update(with_ratios(section["engines"], bench.primary))
    return section


def make_ggufs(model_dir: Path, work: Path, bin_dir: Path | None, quants: list[str], threads: int,
               deadline: float) -> dict:
    """The checkpoint as bf16 GGUF (llama.cpp's converter), then each of `quants` (llama-quantize in `bin_dir`) and
    the other QUANT_FOR files; files already made from this checkpoint are reused, and the bf16 file goes once
    every one of them exists. In the first folder with room: under /tmp, else /dev/shm."""
    from bench.lib.checkpoint import checkpoint_bytes

    fingerprint = json.loads((model_dir / "bench-model.json").read_text())["fingerprint"]
    size = checkpoint_bytes(json.loads((model_dir / "config.json").read_text()))[1]
    folder = _gguf_folder(size * sum(GGUF_SHARE.values()) * 1.03, fingerprint)
    (folder / "fingerprint").write_text(fingerprint)
    wanted = {q: folder / f"model-{q}.gguf" for q in quants}
    bf16, record = folder / "model-bf16.gguf", folder / "convert.json"
    if not bf16.exists() and not all(p.exists() for p in wanted.values()):
        started = time.perf_counter()
        part = folder / "model-bf16.part.gguf"
        _run([sys.executable, "-m", "bench.peer_gguf", "--llama-cpp", str(work / "src" / "llama.cpp"),
              "--model", str(model_dir), "--out", str(part), "--outtype", "bf16"], work / "convert.log", deadline)
        part.rename(bf16)
        record.write_text(json.dumps({
            "command": "python -m bench.peer_gguf --llama-cpp <llama.cpp tree> --model <checkpoint> --outtype bf16",
            "time": fig(time.perf_counter() - started, "s"), "size": fig(bf16.stat().st_size / 1e9, "GB")}))
    out: dict = {"folder": str(folder), "convert": json.loads(record.read_text()) if record.exists() else None}
    every = {q: folder / f"model-{q}.gguf" for q in QUANT_FOR.values()}
    # `quants` first; while the bf16 file is there the other bits' files too, so that it can go (a call measuring
    # 8 bits after a build call that made only Q8_0 leaves no bf16 file for the 4-bit call to lack)
    for quant, path in {**wanted, **every}.items():
        if not path.exists():
            if bin_dir is None or not bf16.exists():
                continue
            started = time.perf_counter()
            part = path.with_suffix(".part")
            _run([str(bin_dir / "llama-quantize"), str(bf16), str(part), quant, str(threads)], work / "quantize.log",
                 deadline)
            part.rename(path)
            path.with_suffix(".json").write_text(json.dumps({
                "command": f"llama-quantize model-bf16.gguf model-{quant}.gguf {quant} {threads}",
                "time": fig(time.perf_counter() - started, "s")}))
        if quant in wanted:
            made = path.with_suffix(".json")
            out[quant] = {"path": str(path), "size": fig(path.stat().st_size / 1e9, "GB"),
                          **(json.loads(made.read_text()) if made.exists() else {})}
    if all(p.exists() for p in every.values()):
        bf16.unlink(missing_ok=True)
    missing = [q for q in quants if q not in out]
    if missing and bin_dir is not None:
        raise RuntimeError(f"no {'/'.join(missing)} GGUF file in {folder} and no bf16 file to quantize it from")
    return out


def _gguf_folder(need: float, fingerprint: str) -> Path:
    candidates = [Path(os.environ.get("KTSERVE_BENCH_DIR") or "/tmp/ktserve-bench") / "gguf",
                  Path("/dev/shm/ktserve-bench/gguf")]
    for folder in candidates:  # files of another checkpoint are removed first
        stamp = folder / "fingerprint"
        if folder.exists() and (not stamp.exists() or stamp.read_text() != fingerprint):
            shutil.rmtree(folder, ignore_errors=True)
    for folder in candidates:
        if folder.exists() and any(folder.glob("model-*.gguf")):  # one made earlier, whole or in part
            return folder
    for folder in candidates:
        probe = next(p for p in (folder, *folder.parents) if p.exists())
        if shutil.disk_usage(probe).free > need:
            folder.mkdir(parents=True, exist_ok=True)
            return folder
    raise ValueError(f"no room for the GGUF files ({need / 1e9:.0f} GB) in {' or '.join(map(str, candidates))}")


def _run(cmd: list[str], log: Path, deadline: float) -> None:
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                              timeout=max(10.0, deadline - time.perf_counter()))
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} {' '.join(cmd[1:3])} exited with {proc.returncode} (see {log.name})")


def measure_bench(peer: Any, gguf: Path, entry: dict, repetitions: int, deadline: float, work: Path,
                  decode_only: bool) -> None:
    from bench.lib.peer_runs import run_bench

    for label, cmd in peer.bench_runs(gguf, PREFILL, repetitions):
        if decode_only and not label.startswith("decode"):
            continue
        left = deadline - time.perf_counter()
        if left < 20:
            entry.setdefault("skipped", []).append(f"{label}: {left:.0f}s left")
            continue
        entry["runs"].append(run_bench(label, cmd, work / f"{peer.name}.log", left - 5))


def measure_server(peer: Any, gguf: Path, entry: dict, bench: Any, level: int, deadline: float, work: Path) -> None:
    """One round of `level` streaming clients against the peer's llama-server with as many slots."""
    from bench.lib.peer_runs import run_clients, serving

    plan = bench.plan
    left = deadline - time.perf_counter()
    if left < 40:
        entry.setdefault("skipped", []).append(f"{level} clients: {left:.0f}s left")
        return
    context = level * (plan.http_prompt + plan.http_tokens + 64)
    try:
        with serving(lambda port: peer.server(gguf, level, context, port), work / f"{peer.name}-server.log",
                     min(180.0, left - 20)) as (url, sampler, cmd):
            rnd = run_clients(url, level, plan.http_prompt, plan.http_tokens, bench.vocab,
                              min(plan.http_round_timeout, deadline - time.perf_counter() - 10))
            entry.setdefault("servers", []).append({"slots": level, "command": cmd, "round": rnd,
                                                    "memory": sampler.stop()})
    except (RuntimeError, subprocess.SubprocessError, OSError, ValueError) as exc:
        entry.setdefault("servers", []).append({"slots": level, "failed": f"{type(exc).__name__}: {exc}"})


def measure_ktserve_gguf(bench: Any, gguf: Path, deadline: float, full: bool) -> dict:
    """ktserve serving the peers' own GGUF file as its model (no kt_method: the experts run as the file's blocks
    allow, engines/kt/experts/methods.py's choose_gguf_method), measured by measure_ktserve; with `full` its
    prompts and rounds too."""
    from bench.run import RULES

    entry: dict = {"model": str(gguf), "kt_method": None}
    return measure_ktserve(bench, entry, lambda plan: bench.kt_config(RULES, model=gguf, plan=plan),
                           f"GGUF {gguf.name}", deadline, GGUF_ROW_MIN_SECONDS, prompts=full, clients=full)


def measure_ktserve_cpu_prefill(bench: Any, method: str, deadline: float, clients: bool) -> dict:
    """ktserve with `method` experts on the run's checkpoint and every routed expert of a prompt on the CPU
    (CPU_PREFILL), measured by measure_ktserve, its prompts always (what the row is for) and with `clients` its
    rounds: set beside the run's own row, what streaming prompts' experts to the GPU by default changes. Without a
    GPU nothing streams by default either, so the row is skipped with that reason."""
    import torch

    entry: dict = {"model": str(bench.model_dir), "kt_method": method, "options": dict(CPU_PREFILL)}
    if not torch.cuda.is_available():
        return {**entry, "skipped": "no GPU: without one the run's own row keeps prompts' experts on the CPU too"}
    tokens, chunk = CPU_PREFILL["kt_gpu_prefill_tokens"], CPU_PREFILL["chunk_size"]
    return measure_ktserve(bench, entry, lambda plan: bench.kt_config(method, plan=plan, chunk_size=chunk,
                                                                      kt_gpu_prefill_tokens=tokens),
                           f"{method} prompts on the CPU", deadline, CPU_PREFILL_ROW_MIN_SECONDS, prompts=True,
                           clients=clients)


def measure_ktserve(bench: Any, entry: dict, config_for: Callable[[Any], Any], label: str, deadline: float,
                    min_seconds: float, prompts: bool, clients: bool) -> dict:
    """One ktserve row of the table (`config_for(plan)`: its engine config), measured by the code that measures the
    run's own engine: batch-1 decode as the decode phase measures it, with `prompts` the ttft phase's prompts and
    with `clients` one round each of CLIENTS streaming clients as the http phase sends them (bench/lib/engine_runs.py,
    bench/lib/http_load.py). Skipped with the reason when fewer than `min_seconds` are left (a load is not bounded by
    the deadline); a failure is recorded in the entry, and the peers' rounds still run."""
    import traceback
    from dataclasses import replace

    from bench.lib.engine_runs import EngineRun, release_memory, ttft_points
    from bench.lib.http_load import run_clients, serving
    from bench.lib.sysinfo import memory_snapshot

    plan = replace(bench.plan, http_levels=CLIENTS)  # the engine sized for the rounds it serves here
    left = deadline - time.perf_counter()
    if left < min_seconds:
        return {**entry, "skipped": f"{left:.0f}s left, {min_seconds}s needed to start"}
    run = None
    try:
        run = EngineRun("ktransformers", config_for(plan), bench.log_path, label=label)
        run.warm_up(bench.vocab)
        entry.update(load_time=fig(run.load_time, "s", note=f"engine.start(): {label}"),
                     engine_details=dict(run.engine.info.details), memory_after_load=run.memory_after_load)
        entry["decode"] = run.decode(plan.decode_prompt, plan.decode_tokens, bench.vocab, deadline, None)
        if prompts:
            entry["ttft"] = ttft_points(run, plan.ttft_prompts, plan.ttft_decode_tokens, bench.vocab, deadline)
        if clients:
            left = deadline - time.perf_counter()
            if left > 10:
                with serving(run.engine, entry["model"]) as url:
                    entry["http"] = run_clients(url, run.engine.info.id, plan, bench.vocab, left)
            else:
                entry["http"] = {"skipped": f"{left:.0f}s left"}
        entry["memory"] = memory_snapshot(run.rss_reset)
    except Exception as exc:  # the peers' rounds still run; the entry says what failed
        entry["failed"] = f"{type(exc).__name__}: {exc}"
        entry["traceback"] = traceback.format_exc().strip().splitlines()[-6:]
    finally:
        if run is not None:
            entry["host_rss_after_stop"] = run.close()
        release_memory()
    return entry


# ------------------------------------------------------------------------------------------------ figures
def peer_figures(entry: dict) -> dict:
    """decode, prefill_<n>, clients_<n> (tok/s; the best over the engine's runs) and memory of one peer entry."""
    from bench.lib.peer_runs import classify, merge_memory

    best: dict[str, tuple[float, str]] = {}
    for run in entry.get("runs", []):
        for record in run.get("records", []):
            kind = classify(record)
            if kind is None:
                continue
            key = "decode" if kind[0] == "decode" else f"prefill_{kind[1]}"
            rate = float(record["avg_ts"])
            if key not in best or rate > best[key][0]:
                best[key] = (rate, run["label"])
    figures = {k: fig(v, "tok/s", run=label) for k, (v, label) in best.items()}
    for server in entry.get("servers", []):
        clients = round_figure(server.get("round") or {})
        if clients is not None:
            figures[f"clients_{server['slots']}"] = clients
    memory = merge_memory(*(r.get("memory") for r in entry.get("runs", [])),
                          *(s.get("memory") for s in entry.get("servers", [])))
    figures.update({"gpu_memory": memory.get("gpu_peak", fig(None, "GB")),
                    "host_memory": memory.get("host_rss_peak", fig(None, "GB"))})
    return figures


def round_figure(rnd: dict) -> dict | None:
    """The aggregate tok/s of one streaming round (bench/lib/http_client.py): its output_throughput when every request
    finished in time; for a round cut at its time limit the partial rate (the tokens streamed by then over the time
    to then, `partial` true), which the table marks and the ratios leave out; None when it has neither."""
    if not rnd.get("timed_out") and (rnd.get("output_throughput") or {}).get("value") is not None:
        return rnd["output_throughput"]
    partial = rnd.get("output_throughput_partial") or {}
    return partial if partial.get("value") is not None else None


def kt_figures(decode: dict | None, points: list[dict], rounds: list[dict], memory: dict | None) -> dict:
    """decode, prefill_<n>, clients_<n>, gpu_memory and host_memory of one ktserve engine from what the decode,
    ttft and http measurements (bench/lib/engine_runs.py, bench/lib/http_load.py) wrote."""
    figures = {"decode": (decode or {}).get("decode_throughput", fig(None, "tok/s"))}
    for point in points:
        figures[f"prefill_{point['prompt_tokens']}"] = fig(
            (point.get("prefill_throughput") or {}).get("value"), "tok/s", note="prompt tokens / time to first token")
    for rnd in rounds:
        clients = round_figure(rnd) if rnd.get("concurrency") in CLIENTS else None
        if clients is not None:
            figures[f"clients_{rnd['concurrency']}"] = clients
    memory = memory or {}
    figures["gpu_memory"] = memory.get("gpu_used_nvidia_smi") or memory.get("gpu_peak_allocated") or fig(None, "GB")
    figures["host_memory"] = memory.get("host_rss_peak") or fig(None, "GB")
    return figures


def ktserve_figures(results: dict, method: str) -> dict:
    """ktserve's figures for `method` from this run's decode phase, and for the primary method its ttft and http
    phases too."""
    kt = (results.get("kt") or {}).get(method) or {}
    primary = method == (results.get("meta") or {}).get("primary")
    return kt_figures(kt.get("decode"), (results.get("ttft") or {}).get("points", []) if primary else [],
                      (results.get("http") or {}).get("rounds", []) if primary else [], kt.get("memory"))


def gguf_row_name(quant: str) -> str:
    return f"ktserve (GGUF {quant})"


def engine_entries(bench: Any, measured: dict[tuple[str, str], dict], on_gguf: dict[str, dict] | None = None,
                   cpu_prefill: dict[str, dict] | None = None) -> list[dict]:
    """For each bits in turn: ktserve's entry for the method measured, ktserve's with prompts' experts on the CPU
    (`cpu_prefill`: method -> measure_ktserve_cpu_prefill's entry), ktserve's on the GGUF file (`on_gguf`: quant ->
    measure_ktserve_gguf's entry), then each peer's."""
    out = []
    results = bench.results.data
    version = _ktserve_version()
    for method, quant in QUANT_FOR.items():
        if (results.get("kt") or {}).get(method, {}).get("decode"):
            out.append({"name": "ktserve", "version": version, "bits": method, "figures": ktserve_figures(results, method)})
        row = (cpu_prefill or {}).get(method)
        if row is not None:
            out.append(_kt_row(CPU_PREFILL_ROW_NAME, method, version, row, options=row.get("options")))
        row = (on_gguf or {}).get(quant)
        if row is not None:
            out.append(_kt_row(gguf_row_name(quant), quant, version, row, gguf=row.get("model")))
        for (name, q), entry in measured.items():
            if q == quant:
                out.append({**{k: v for k, v in entry.items() if k != "figures"}, "figures": peer_figures(entry)})
    return out


def _kt_row(name: str, bits: str, version: str, row: dict, **extra: Any) -> dict:
    """A table row of one of measure_ktserve's entries."""
    return {"name": name, "version": version, "bits": bits, **extra,
            "experts_method": (row.get("engine_details") or {}).get("experts_method"),
            **{k: row[k] for k in ("failed", "skipped", "note") if k in row},
            "figures": kt_figures(row.get("decode"), row.get("ttft") or [], (row.get("http") or {}).get("rounds") or [],
                                  row.get("memory"))}


def complete(figure: dict | None) -> float | None:
    """A figure's value unless it is a partial one (round_figure), which no ratio uses."""
    return None if not figure or figure.get("partial") else figure.get("value")


def ratios(engines: list[dict], method: str, name: str = "ktserve") -> dict:
    """ktserve / the best peer for each figure of RATIOS at `method`'s bits (None where either is missing or only
    partial); `name` picks ktserve's row: its own run (method), CPU_PREFILL_ROW_NAME (method) or the GGUF file's
    (gguf_row_name, the file's type)."""
    quant = QUANT_FOR.get(method)
    ours = next((e["figures"] for e in engines if e["name"] == name and e["bits"] in (method, quant)), {})
    theirs = [e for e in engines if not e["name"].startswith("ktserve") and e["bits"] == quant]
    out = {}
    for key in RATIOS:
        value = complete(ours.get(key))
        best = max(theirs, key=lambda e: complete(e["figures"].get(key)) or 0.0, default=None)
        peer_value = complete(best["figures"].get(key)) if best else None
        out[key] = fig(value / peer_value if value and peer_value else None, "x",
                       best_peer=best["name"] if peer_value else None)
    return out


# bench.json key of each bits' ratios of one ktserve row -> (its label in the table, the row's name at a method)
RATIO_ROWS: dict[str, tuple[str, Callable[[str], str]]] = {
    "ratios_by_bits": ("ktserve", lambda method: "ktserve"),
    "ratios_cpu_prefill_by_bits": ("ktserve, prompts on the CPU", lambda method: CPU_PREFILL_ROW_NAME),
    "ratios_gguf_by_bits": ("ktserve on the GGUF", lambda method: gguf_row_name(QUANT_FOR[method]))}


def with_ratios(engines: list[dict], primary: str) -> dict:
    """`ratios` (the primary method's bits), and for each bits measured `ratios_by_bits` (ktserve's own run),
    `ratios_cpu_prefill_by_bits` (its row with prompts' experts on the CPU) and `ratios_gguf_by_bits` (its GGUF row)."""
    measured = [m for m, q in QUANT_FOR.items() if any(e["bits"] in (m, q) for e in engines)]
    return {"ratios": ratios(engines, primary),
            **{key: {QUANT_FOR[m]: ratios(engines, m, name(m)) for m in measured}
               for key, (_, name) in RATIO_ROWS.items()}}


def merge_sections(sections: list[dict], primary: str = "AMXINT8") -> dict:
    """One peers section from several runs' (e.g. one call at 8 bits, one at 4): each engine row (name, bits)
    from the last run that has it, in the order of the bits; the ratios computed again over them all."""
    rows: dict[tuple[str, str], dict] = {}
    for section in sections:
        for e in section.get("engines", []):
            rows[(e["name"], e["bits"])] = e
    order = {b: i for i, b in enumerate(x for m, q in QUANT_FOR.items() for x in (m, q))}
    engines = sorted(rows.values(), key=lambda e: order.get(e["bits"], len(order)))  # stable: rows keep their order
    threads = sorted({s.get("threads") for s in sections if s.get("threads") is not None})
    return {"threads": threads[0] if len(threads) == 1 else threads, "engines": engines,
            **with_ratios(engines, primary),
            "merged_from": [{"quants": s.get("quants"), "build": s.get("build"), "gguf": s.get("gguf")}
                            for s in sections]}


def _ktserve_version() -> str:
    import tomllib

    with open(REPO / "pyproject.toml", "rb") as f:
        return "ktserve " + tomllib.load(f)["project"]["version"]


def peers_lines(section: dict) -> list[str]:
    """The peers table of the summary; a figure of a round cut at its time limit is marked `~` (round_figure)."""
    if not section:
        return []

    def v(figures: dict, key: str, spec: str = ".1f") -> str:
        figure = figures.get(key) or {}
        value = figure.get("value")
        return "-" if value is None else ("~" if figure.get("partial") else "") + format(value, spec)

    w = max([21, *(len(e["name"]) + 1 for e in section.get("engines", []))])
    lines = [f"peers ({section.get('threads')} threads each; decode tg128 after 512 tokens; prefill tok/s; aggregate "
             f"tok/s of 16 / 32 streaming clients; peak GPU / host memory GB)",
             f"{'engine':<{w}}{'bits':<9}{'decode':>8}{'pp512':>8}{'pp2048':>8}{'pp8192':>8}{'16 cl':>8}{'32 cl':>8}"
             f"{'GPU GB':>8}{'host GB':>8}"]
    partial = []
    for e in section.get("engines", []):
        f = e["figures"]
        lines.append(f"{e['name']:<{w}}{e['bits']:<9}{v(f, 'decode'):>8}{v(f, 'prefill_512', '.0f'):>8}"
                     f"{v(f, 'prefill_2048', '.0f'):>8}{v(f, 'prefill_8192', '.0f'):>8}{v(f, 'clients_16'):>8}"
                     f"{v(f, 'clients_32'):>8}{v(f, 'gpu_memory'):>8}{v(f, 'host_memory'):>8}")
        partial += [f"{e['name']} {e['bits']} {k.split('_')[1]} clients {f[k].get('completed')}/"
                    f"{f[k].get('requests')} in {f[k].get('elapsed')} s" for k in ("clients_16", "clients_32")
                    if (f.get(k) or {}).get("partial")]
    if partial:
        lines.append("~ the round hit its time limit: output tokens streamed by then / time to then (requests "
                     "completed): " + "; ".join(partial) + "; no ratio uses it")
    for key, (label, _) in RATIO_ROWS.items():
        default = {"": section.get("ratios") or {}} if key == "ratios_by_bits" else {}
        for quant, r in (section.get(key) or default).items():
            parts = [f"{k} {v(r, k, '.2f')}" + (f" ({r[k]['best_peer']})" if r.get(k, {}).get("best_peer") else "")
                     for k in RATIOS if (r.get(k) or {}).get("value") is not None]
            if parts:
                lines.append(f"{label} / best peer{' at ' + quant if quant else ''}: " + ", ".join(parts))
    for e in section.get("engines", []):
        for what in ("failed", "skipped", "note"):
            if e.get(what):  # a peer's skipped steps are a list
                lines.append(f"{e['name']} {e['bits']}: {what}: "
                             f"{e[what] if isinstance(e[what], str) else '; '.join(e[what])}")
    builds = [section.get("build")] + [m.get("build") for m in section.get("merged_from", [])]
    for name, b in ((n, b) for build in builds for n, b in (build or {}).items()):
        line = f"build {name}: " + ("reused" if b.get("reused") else
                                    f"{b.get('steps_done')}/{b.get('steps_total')} steps in {b.get('seconds')} s"
                                    + ("" if b.get("finished") else " (unfinished)")
                                    + (f" {b['failed']}" if b.get("failed") else ""))
        if line not in lines:  # merged calls that each reused the same build say so once
            lines.append(line)
    return lines


# ------------------------------------------------------------------------------------------------ CLI
def gguf_main(argv: list[str]) -> int:
    """`python -m bench.peers gguf`: the shape's checkpoint (written unless there), its bf16 GGUF, and once
    a llama-quantize is built (waiting for it up to --budget), the Q8_0 and Q4_0 files."""
    from bench.lib.checkpoint import build_checkpoint, existing_model
    from bench.lib.peer_build import quantizer
    from bench.run import default_model_dir
    from bench.lib.shapes import SHAPES
    from engines.kt.experts.cpuinfer import default_cpu_threads

    p = argparse.ArgumentParser(prog="python -m bench.peers gguf")
    p.add_argument("--work", type=Path, default=DEFAULT_WORK)
    p.add_argument("--shape", choices=sorted(SHAPES), default="v2-lite")
    p.add_argument("--budget", type=float, default=540)
    args = p.parse_args(argv)
    deadline = time.perf_counter() + args.budget
    shape = SHAPES[args.shape]
    model_dir = default_model_dir(shape)
    if existing_model(model_dir, shape.config) is None:
        cost = build_checkpoint(model_dir, shape.config, shard_bytes=shape.plan.shard_bytes)
        print(f"checkpoint {model_dir}: {cost['build_s']:.0f} s", flush=True)
    threads = default_cpu_threads()
    try:
        print(json.dumps(make_ggufs(model_dir, args.work, None, [], threads, deadline)), flush=True)
        while (quantize := quantizer(args.work)) is None and time.perf_counter() < deadline - 60:
            time.sleep(5)
        if quantize is None:
            print("llama-quantize not built in time: the Q8_0 / Q4_0 files are left for the measuring call", flush=True)
            return 1
        print(json.dumps(make_ggufs(model_dir, args.work, quantize.parent, list(QUANT_FOR.values()), threads,
                                    deadline)), flush=True)
    except subprocess.TimeoutExpired as exc:  # the next call starts the step again
        print(f"out of time: {' '.join(map(str, exc.cmd[:4]))}... stopped after {exc.timeout:.0f}s", flush=True)
        return 1
    return 0


def table_main(argv: list[str]) -> int:
    """`python -m bench.peers table`: the peers sections of several runs' bench.json as one table."""
    p = argparse.ArgumentParser(prog="python -m bench.peers table")
    p.add_argument("results", type=Path, nargs="+", help="bench.json files (a row measured in several: the last's)")
    p.add_argument("--out", type=Path, help="write the merged section here as JSON ({\"peers\": ...})")
    p.add_argument("--primary", default="AMXINT8", choices=sorted(QUANT_FOR), help="the bits of `ratios`")
    args = p.parse_args(argv)
    sections = []
    for path in args.results:
        try:
            section = json.loads(path.read_text()).get("peers")
        except (OSError, ValueError) as exc:
            p.error(f"{path}: {exc}")
        if not section:
            p.error(f"{path}: no peers section")
        sections.append(section)
    merged = merge_sections(sections, args.primary)
    merged["sources"] = [str(path) for path in args.results]
    print("\n".join(peers_lines(merged)), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"peers": merged}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["pack"]:
        p = argparse.ArgumentParser(prog="python -m bench.peers pack")
        p.add_argument("sdists", type=Path, nargs="+", help="the PyPI source archives (pip download --no-binary)")
        p.add_argument("--out", type=Path, default=DEFAULT_SOURCES)
        args = p.parse_args(argv[1:])
        from bench.lib.peer_build import pack

        for sdist in args.sdists:
            target = pack(sdist, args.out)
            print(f"{target} {target.stat().st_size / 1e6:.1f} MB", flush=True)
        return 0
    if argv[:1] == ["build"]:
        p = argparse.ArgumentParser(prog="python -m bench.peers build")
        p.add_argument("--sources", type=Path, default=DEFAULT_SOURCES)
        p.add_argument("--work", type=Path, default=DEFAULT_WORK)
        p.add_argument("--budget", type=float, default=540, help="seconds; an unfinished build continues next time")
        p.add_argument("--cpu", action="store_true", help="build without CUDA (to try the flags on a CPU machine)")
        p.add_argument("--gguf", action="store_true", help="meanwhile write the v2-lite checkpoint and its GGUF files "
                       "(`gguf` below, the compilers at a lower priority), so that the measuring call finds them")
        p.add_argument("--engines", type=engine_list, default=ENGINE_NAMES, help="peers to build (default: both)")
        args = p.parse_args(argv[1:])
        from bench.lib.peer_build import build_all, find_archives, unpack

        archives = find_archives(args.sources, args.engines)
        converter = find_archives(args.sources, ("llama.cpp",))
        if not archives or not converter:
            p.error(f"--sources {args.sources}: the archives of {', '.join(args.engines)} and llama.cpp's are needed")
        args.work.mkdir(parents=True, exist_ok=True)
        deadline = time.perf_counter() + args.budget
        for archive in {**archives, **converter}.values():  # the converter reads llama.cpp's tree during the builds
            unpack(archive, args.work)
        writer = subprocess.Popen([sys.executable, "-m", "bench.peers", "gguf", "--work", str(args.work), "--budget",
                                   str(args.budget - 5)], cwd=REPO) if args.gguf else None
        result = build_all(archives, args.work, os.cpu_count() or 1, deadline, not args.cpu, nice=10 * args.gguf)
        print(json.dumps(result, indent=1), flush=True)
        if writer is not None:
            try:
                writer.wait(timeout=max(1.0, deadline - time.perf_counter() + 10))
            except subprocess.TimeoutExpired:
                writer.kill()
        return 0 if all(b.get("finished") for b in result.values()) else 1
    if argv[:1] == ["gguf"]:
        return gguf_main(argv[1:])
    if argv[:1] == ["table"]:
        return table_main(argv[1:])
    from bench import run

    if not any(a == "--only" or a.startswith("--only=") for a in argv):
        argv = ["--only", "baseline,decode,ttft,http,peers", *argv]
    if not any(a == "--methods" or a.startswith("--methods=") for a in argv):
        argv = ["--methods", "AMXINT8,AMXINT4", *argv]
    return run.main(argv)


if __name__ == "__main__":
    sys.exit(main())
