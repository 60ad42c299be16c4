"""The short table `python -m bench.run` prints last, from its bench.json: every phase's figures in one place, so it
knows the experiments' own sections (bench.mtp's, bench.peers'); the library's report (bench/lib/report.py) knows
none of them."""
from __future__ import annotations

from typing import Any

from bench.lib.report import figure_value as _v


def _fmt(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, (int, float)) else str(value)


def _cut(rnd: dict) -> str:
    """What the summary says of a round that reached its time limit (bench/lib/http_client.py)."""
    if not rnd.get("timed_out"):
        return ""
    partial = rnd.get("output_throughput_partial") or {}
    if partial.get("value") is None:
        return " (timed out)"
    return (f" (timed out: ~{_fmt(partial['value'])} tok/s streamed by then, {partial.get('completed')} of "
            f"{partial.get('requests')} requests done)")


def summary_lines(data: dict) -> list[str]:
    """The short table printed last (the device reply carries the end of the output)."""
    lines = [f"device: {data['meta'].get('gpu') or data['meta'].get('cpu')} | shape {data['meta'].get('shape')} | "
             f"kt threads {data['meta'].get('kt_cpu_threads')} | CPU copy bandwidth "
             f"{_fmt(_v(data, 'cpu_bandwidth', 'copy_bandwidth'))} GB/s"]
    lines.append(f"{'engine':<22}{'load s':>8}{'decode tok/s':>14}{'% ceiling':>11}{'TTFT s':>9}{'GPU peak GB':>13}"
                 f"{'RSS peak GB':>13}")
    rows = [(f"kt {m}", data.get("kt", {}).get(m)) for m in ("AMXINT8", "AMXINT4", "BF16")]
    rows += [("hf engine, whole model", data.get("hf_gpu")), ("hf + accelerate offload", data.get("hf_offload"))]
    for label, r in rows:
        if not r:
            continue
        frac = _v(r, "decode", "fraction_of_ceiling")
        lines.append(f"{label:<22}{_fmt(_v(r, 'load_time')):>8}{_fmt(_v(r, 'decode', 'decode_throughput'), '.2f'):>14}"
                     f"{_fmt(None if frac is None else 100 * frac):>11}{_fmt(_v(r, 'decode', 'ttft'), '.3f'):>9}"
                     f"{_fmt(_v(r, 'memory', 'gpu_peak_allocated'), '.2f'):>13}"
                     f"{_fmt(_v(r, 'memory', 'host_rss_peak'), '.2f'):>13}")
    for label, r in rows[:3]:
        b = (r or {}).get("decode", {}).get("step_breakdown")
        if b:
            lines.append(f"{label} per step (ms): step {_fmt(_v(b, 'step'), '.2f')} = gpu {_fmt(_v(b, 'gpu'), '.2f')} + "
                         f"expert wait {_fmt(_v(b, 'expert_wait'), '.2f')} + other {_fmt(_v(b, 'other'), '.2f')} (after the "
                         f"forward {_fmt(_v(b, 'after_forward'), '.2f')}); "
                         f"CPU experts {_fmt(_v(b, 'expert'), '.2f')}; wait share "
                         f"{_fmt(_v(r, 'decode', 'expert_wait_share'), '.3f')}")
        slow = (r or {}).get("decode", {}).get("slow_steps")
        if slow and slow["count"]:
            gc_ = slow["gc_while_decoding"]
            ms = {key: _fmt(_v(slow, key), ".1f") for key in ("threshold", "gap_mean", "gpu_mean",
                                                               "expert_wait_mean", "other_mean")}
            lines.append(f"{label} slow gaps (> {ms['threshold']} ms): {slow['count']} of {slow['of']}, mean "
                         f"{ms['gap_mean']} ms = gpu {ms['gpu_mean']} + expert wait {ms['expert_wait_mean']} + other "
                         f"{ms['other_mean']}; {slow['with_gc']} during a garbage collection ({gc_['collections']} "
                         f"while decoding, longest {_fmt(_v(gc_, 'max'), '.1f')} ms)")
    from bench.mtp import summary as mtp_summary  # torch, only when a summary is printed

    lines += mtp_summary(data)
    sweep = data.get("thread_sweep") or {}
    for threads, r in sorted(((k, v) for k, v in sweep.items() if k.isdigit()), key=lambda kv: int(kv[0])):
        d = r.get("decode") or {}
        lines.append(f"kt {sweep.get('method')} {threads:>3} threads: {_fmt(_v(d, 'decode_throughput'), '.2f')} tok/s, "
                     f"TPOT median {_fmt(_v(d, 'tpot_median'))} ms p99 {_fmt(_v(d, 'tpot_p99'))} ms"
                     + (" (default)" if int(threads) == sweep.get("default_threads") else "")
                     + (f" failed: {r['failed']}" if "failed" in r else ""))
    lines += host_memory_lines(data)
    avx2 = data.get("avx2") or {}
    if avx2.get("decode"):
        d, details = avx2["decode"], avx2.get("engine_details") or {}
        lines.append(f"avx2 build ({details.get('cpu_variant')}, experts {details.get('experts_method')}): "
                     f"{_fmt(_v(d, 'decode_throughput'), '.2f')} tok/s, TPOT median {_fmt(_v(d, 'tpot_median'))} ms "
                     f"p99 {_fmt(_v(d, 'tpot_p99'))} ms")
    for p in (data.get("ttft") or {}).get("points", []):
        lines.append(f"TTFT {p['prompt_tokens']:>6} tokens: {_fmt(_v(p, 'ttft'), '.3f')} s (first of its length "
                     f"{_fmt(_v(p, 'ttft_first'), '.3f')} s), TPOT median {_fmt(_v(p, 'tpot_median'), '.1f')} ms")
    for r in (data.get("http") or {}).get("rounds", []):
        lines.append(f"HTTP {r['concurrency']:>3} clients: {_fmt(_v(r, 'output_throughput'))} tok/s, TPOT median "
                     f"{_fmt(_v(r, 'tpot_median'))} ms p99 {_fmt(_v(r, 'tpot_p99'))} ms, TTFT median "
                     f"{_fmt(_v(r, 'ttft_median'), '.3f')} s; decoding {_fmt(_v(r, 'decode_rate'))} of at most "
                     f"{_fmt(_v(r, 'decode_ceiling'))} tok/s" + _cut(r))
    lines += attention_lines(data)
    from bench.peers import peers_lines

    lines += peers_lines(data.get("peers") or {})
    load = data.get("load") or {}
    if load:
        lines.append(f"weight cache: {load.get('status')}" + (
            f", cold {_fmt(_v(load, 'cold_load_time'))} s, cached {_fmt(_v(load, 'cached_load_time'))} s"
            if load.get("status") == "supported" else ""))
    for name, p in data.get("phases", {}).items():
        if p.get("status") != "ok":
            lines.append(f"phase {name}: {p.get('status')} {p.get('reason', '')}")
    return lines


def attention_lines(data: dict) -> list[str]:
    """Per attention backend: the cached-prefix TTFT, then each context round's throughput and TPOT."""
    section = data.get("attention") or {}
    lines = []
    for backend, entry in (section.get("backends") or {}).items():
        if "error" in entry:
            lines.append(f"attention {backend}: {entry['error']}")
            continue
        cached = entry.get("cached_prefix") or {}
        rounds = [f"{key.removeprefix('context_')}: {_fmt(_v(r, 'output_throughput'))} tok/s, TPOT "
                  f"{_fmt(_v(r, 'tpot_median'))} ms" if "skipped" not in r else f"{key}: {r['skipped']}"
                  for key, r in entry.items() if key.startswith("context_")]
        lines.append(f"attention {backend}: cached-prefix TTFT {_fmt(_v(cached, 'ttft_cached'), '.3f')} s (cold "
                     f"{_fmt(_v(cached, 'ttft_cold'), '.3f')} s); {section.get('clients')} clients at "
                     + ("; ".join(rounds) or "no round"))
    return lines


def host_memory_lines(data: dict) -> list[str]:
    """Host memory of the engines that ran alone in a fresh process (the thread sweep's, and the decodes of the
    methods other than the primary) against the bytes of their experts. The main process's RSS
    (kt.<METHOD>.memory) also holds what earlier phases left (the checkpoint build, the bandwidth buffers, engines
    that stopped), so it says little about the engine's own."""
    sweep = data.get("thread_sweep") or {}
    runs = [(sweep.get("method"), f"{k} threads", v)
            for k, v in sorted(((k, v) for k, v in sweep.items() if k.isdigit()), key=lambda kv: int(kv[0]))]
    runs += [(method, "decode", v) for method, v in (data.get("kt") or {}).items()]
    lines = []
    for method, what, r in runs:
        rss = _v(r, "memory", "host_rss")
        experts = _v(data, "cpu_bandwidth", "expert_bytes", method or "")
        if rss is None or not experts or "child" not in r:
            continue  # a decode of the main process
        lines.append(f"host memory, kt {method} alone in a fresh process ({what}): "
                     f"{rss:.2f} GB after decoding, peak {_fmt(_v(r, 'memory_after_load', 'host_rss_peak'), '.2f')} GB "
                     f"while loading; the experts are {experts:.2f} GB: {rss / experts:.2f}x")
    return lines
