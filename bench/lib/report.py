"""bench.json and the plots. Every figure is `{"value": ..., "unit": ...}` (plus notes), so a reader never
has to guess whether a number is seconds or milliseconds. The file is rewritten after every phase, so a run
cut off by its time limit still leaves everything measured so far."""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any


def fig(value: float | None, unit: str, **extra: Any) -> dict:
    """One figure with its unit; None-valued extras are left out."""
    if isinstance(value, float) and math.isfinite(value):
        value = float(f"{value:.6g}")
    return {"value": value, "unit": unit, **{k: v for k, v in extra.items() if v is not None}}


def print_and_write(results: dict, out: str | Path | None, name: str) -> None:
    """A one-object bench's results: printed as JSON, and written to `out`/`name` when `out` is given."""
    text = json.dumps(results, indent=2)
    print(text)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text(text + "\n")


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class Results:
    def __init__(self, out_dir: Path, meta: dict):
        self.out_dir = out_dir
        self.path = out_dir / "bench.json"
        self.data: dict[str, Any] = {"meta": meta, "phases": {}}

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def section(self, *keys: str) -> dict:
        """The nested dict at `keys`, created empty where missing."""
        node = self.data
        for key in keys:
            node = node.setdefault(key, {})
        return node

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)

    def phase(self, name: str, status: str, elapsed: float, expected: float | None, **extra: Any) -> None:
        """Record a phase's outcome, save, and print its section of the JSON (flushed)."""
        entry = {"status": status, "elapsed": fig(elapsed, "s"), "expected": fig(expected, "s"), **extra}
        self.data["phases"][name] = entry
        self.save()
        section = self.data.get(_SECTION.get(name.split(":")[0], name))
        print(f"== {name}: {status} in {elapsed:.1f}s (expected {expected or 0:.0f}s)", flush=True)
        if section is not None and status == "ok":
            print(json.dumps(_select(section, name), separators=(",", ":"), default=str), flush=True)
        elif extra:
            print(json.dumps(extra, default=str), flush=True)


# phase -> the top-level key its figures live under
_SECTION = {"baseline": "cpu_bandwidth", "decode": "kt", "ttft": "ttft", "http": "http", "load": "load",
            "hf": "hf_gpu", "offload": "hf_offload", "model": "model", "threads": "thread_sweep", "avx2": "avx2"}


def _select(section: Any, phase: str) -> Any:
    if phase.startswith("decode:") and isinstance(section, dict):
        return section.get(phase.split(":", 1)[1], section)
    if phase == "model":
        return {k: v for k, v in section.items() if k != "config"}
    return section


def figure_value(d: Any, *path: str) -> Any:
    """The value at `path` in a bench.json section: a figure's `value`, anything else as it is; None where missing."""
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d.get("value") if isinstance(d, dict) and "unit" in d else d



# ------------------------------------------------------------------------------------------------ plots
def write_plots(data: dict, out_dir: Path) -> list[str]:
    """PNG plots next to bench.json; none (with a printed note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; bench.json written, plots skipped", file=sys.stderr, flush=True)
        return []
    written = []
    title = f"{data['meta'].get('shape')} on {data['meta'].get('gpu') or data['meta'].get('cpu')}"
    rounds = (data.get("http") or {}).get("rounds", [])
    if rounds:
        fig_, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        levels = [r["concurrency"] for r in rounds]
        ax1.plot(levels, [figure_value(r, "output_throughput") for r in rounds], "o-")
        ax1.set(xlabel="concurrent streaming clients", ylabel="output tokens/s (aggregate)", xscale="log", title=title)
        ax2.plot(levels, [figure_value(r, "tpot_median") for r in rounds], "o-", label="median")
        ax2.plot(levels, [figure_value(r, "tpot_p99") for r in rounds], "s--", label="p99")
        ax2.set(xlabel="concurrent streaming clients", ylabel="time per output token (ms)", xscale="log")
        ax2.legend()
        for ax in (ax1, ax2):
            _log_ticks(ax, levels)
        fig_.tight_layout()
        written.append(_save(fig_, out_dir / "throughput_vs_concurrency.png", plt))
    points = (data.get("ttft") or {}).get("points", [])
    if points:
        fig_, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        ctx = [p["prompt_tokens"] for p in points]
        ax1.plot(ctx, [figure_value(p, "tpot_median") for p in points], "o-", label="median")
        ax1.plot(ctx, [figure_value(p, "tpot_p99") for p in points], "s--", label="p99")
        ax1.set(xlabel="context length (tokens)", ylabel="time per output token (ms)", xscale="log",
                title=f"{title}, {(data.get('ttft') or {}).get('method')}")
        ax1.legend()
        ax2.plot(ctx, [figure_value(p, "ttft") for p in points], "o-")
        ax2.set(xlabel="prompt length (tokens)", ylabel="time to first token (s)", xscale="log")
        for ax in (ax1, ax2):
            _log_ticks(ax, ctx)
        fig_.tight_layout()
        written.append(_save(fig_, out_dir / "tpot_vs_context.png", plt))
    return written


def _log_ticks(ax: Any, values: list[int]) -> None:
    ax.minorticks_off()
    ax.set_xticks(values, [str(x) for x in values])
    ax.grid(alpha=0.3)


def _save(figure: Any, path: Path, plt: Any) -> str:
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path.name
