"""Running one peer engine (ik_llama.cpp or llama.cpp): llama-bench for decode and prefill, llama-server under
the `http` phase's streaming clients, each process's GPU and host memory sampled while it runs.

How each engine is run is what its own documentation recommends for a hybrid MoE model on one GPU: every
layer on the GPU (`-ngl 99`) except the routed experts (`-ot exps=CPU`), flash attention, the benchmark's
thread count; ik_llama.cpp adds its fused MoE (`-fmoe 1`), MLA mode 3 and run-time repacking of the CPU
tensors (`-rtr`). Repacked tensors cannot be copied to the GPU for large batches, which is how both engines
compute a long prompt's experts, so ik's prefill runs without `-rtr` (its decode both ways: each figure keeps
the faster run). Prompt processing runs in batches of PREFILL_BATCH tokens (`-b`/`-ub`), as both
projects advise for hybrid prefill: a batch of 32 tokens or more copies every routed expert of a layer to the GPU
(16.7 GB for the Q8_0 file), so the default 512-token batch pays that copy once per 512 tokens (llama.cpp, H200,
2026-11-28: pp512 224 tok/s against 1,802 at 8,192 in 4,096-token batches; its server's 16 clients, then on the
default batch, spent 21 s on their 4,096 prompt tokens)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from bench.lib.report import fig

PREFILL_BATCH = 4096
DECODE_DEPTH = 512  # tg128 after this many tokens of context


@dataclass(frozen=True)
class Peer:
    name: str
    bin: Path  # folder with llama-bench and llama-server
    version: str
    threads: int

    @property
    def ik(self) -> bool:
        return self.name == "ik_llama.cpp"

    def common(self) -> list[str]:
        return ["-ngl", "99", "-ot", "exps=CPU", "-t", str(self.threads)]

    def bench_runs(self, gguf: Path, prompts: tuple[int, ...], repetitions: int) -> list[tuple[str, list[str]]]:
        """(label, llama-bench command) in order of importance: decode first."""
        base = [str(self.bin / "llama-bench"), "-m", str(gguf), *self.common(), "-fa", "1", "-r", str(repetitions),
                "-o", "json"]
        pp = ["-p", ",".join(map(str, prompts)), "-n", "0", "-b", str(PREFILL_BATCH), "-ub", str(PREFILL_BATCH)]
        if self.ik:
            ik = ["-fmoe", "1", "-mla", "3"]
            gp = ["-gp", f"{DECODE_DEPTH},128"]
            return [("decode -rtr 1", [*base, *ik, "-rtr", "1", "-p", "0", "-n", "0", *gp]),
                    ("prefill -rtr 0", [*base, *ik, "-rtr", "0", *pp, *gp])]
        return [("decode", [*base, "-p", "0", "-n", "128", "-d", str(DECODE_DEPTH)]), ("prefill", [*base, *pp])]

    def server(self, gguf: Path, slots: int, context: int, port: int) -> list[str]:
        cmd = [str(self.bin / "llama-server"), "-m", str(gguf), *self.common(), "-fa", "on", "-np", str(slots),
               "-c", str(context), "-b", str(PREFILL_BATCH), "-ub", str(PREFILL_BATCH), "--host", "127.0.0.1",
               "--port", str(port)]
        return cmd + (["-mla", "3", "-rtr"] if self.ik else [])


# ------------------------------------------------------------------------------------------------ memory
class MemorySampler:
    """Peak host RSS (VmHWM) of `pid` and peak GPU memory in use (nvidia-smi, less what was in use before)."""

    def __init__(self, pid: int, gpu_before: float | None, period: float = 0.5):
        self.pid, self.gpu_before, self.period = pid, gpu_before, period
        self.host_peak = 0.0
        self.gpu_peak: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peer-memory")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            host = _vm_hwm_gb(self.pid)
            if host is not None:
                self.host_peak = max(self.host_peak, host)
            gpu = gpu_used_gb()
            if gpu is not None and self.gpu_before is not None:
                self.gpu_peak = max(self.gpu_peak or 0.0, gpu - self.gpu_before)
            self._stop.wait(self.period)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=5)
        return {"gpu_peak": fig(self.gpu_peak, "GB", note="nvidia-smi memory.used, less what was in use before"),
                "host_rss_peak": fig(self.host_peak or None, "GB", note="VmHWM; the mmap'd GGUF pages it touched "
                                     "count")}


def _vm_hwm_gb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    except (OSError, ValueError):
        pass
    return None


def gpu_used_gb() -> float | None:
    from bench.lib.sysinfo import nvidia_smi

    used = nvidia_smi("memory.used")
    return float(used[0]) * 1024 ** 2 / 1e9 if used else None


def merge_memory(*entries: dict | None) -> dict:
    """The larger peak of each kind over several runs' memory entries."""
    out: dict = {}
    for entry in entries:
        for key, value in (entry or {}).items():
            if value.get("value") is not None and (key not in out or value["value"] > out[key]["value"]):
                out[key] = value
    return out


# ------------------------------------------------------------------------------------------------ llama-bench
def bench_records(text: str) -> list[dict]:
    """Every llama-bench result object in its output (json and jsonl alike)."""
    decoder, records, i = json.JSONDecoder(), [], 0
    while (i := text.find("{", i)) >= 0:
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        if isinstance(obj, dict) and "avg_ts" in obj:
            records.append(obj)
        i = end
    return records


def classify(record: dict) -> tuple[str, int] | None:
    """("decode", context) or ("prefill", prompt tokens) for one llama-bench record."""
    n_prompt, n_gen = int(record.get("n_prompt") or 0), int(record.get("n_gen") or 0)
    if n_gen > 0:  # llama.cpp: tg at n_depth; ik_llama.cpp's -gp: tg after n_prompt tokens
        return "decode", int(record.get("n_depth") or 0) + (n_prompt if n_prompt else 0)
    if n_prompt > 0:
        return "prefill", n_prompt
    return None


def run_bench(label: str, cmd: list[str], log: Path, timeout: float) -> dict:
    """One llama-bench command: its records, memory and wall time; what it printed goes to `log`."""
    started = time.perf_counter()
    gpu_before = gpu_used_gb()
    with open(log, "a") as err:
        err.write(f"\n$ {' '.join(cmd)}\n")
        err.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        sampler = MemorySampler(proc.pid, gpu_before)
        try:
            out, _ = proc.communicate(timeout=max(1.0, timeout))
            timed_out = False
        except subprocess.TimeoutExpired:
            _stop(proc)
            out, _ = proc.communicate()
            timed_out = True
        memory = sampler.stop()
        err.write(out)
    entry = {"label": label, "command": cmd, "wall": fig(time.perf_counter() - started, "s"),
             "returncode": proc.returncode, "records": [_slim(r) for r in bench_records(out)], "memory": memory}
    if timed_out:
        entry["timed_out"] = True
    return entry


def _slim(record: dict) -> dict:
    keep = ("n_prompt", "n_gen", "n_depth", "n_batch", "n_ubatch", "n_threads", "avg_ts", "stddev_ts", "test",
            "repack", "fmoe", "mla_attn", "flash_attn", "model_type", "model_size", "build_commit", "type_k")
    return {k: record[k] for k in keep if k in record}


def _stop(proc: subprocess.Popen) -> None:
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------------ llama-server
@contextlib.contextmanager
def serving(cmd_for_port, log: Path, timeout: float) -> Iterator[tuple[str, MemorySampler, list[str]]]:
    """A llama-server on a free loopback port until /health answers; yields (url, memory sampler, command)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = cmd_for_port(port)
    url = f"http://127.0.0.1:{port}"
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    sampler = MemorySampler(proc.pid, gpu_used_gb())
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode} before it was ready (see {log.name})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not ready after {timeout:.0f}s (see {log.name})")
            time.sleep(0.25)
        yield url, sampler, cmd
    finally:
        _stop(proc)
        sampler.stop()


def run_clients(url: str, level: int, prompt: int, tokens: int, vocab: int, timeout: float) -> dict:
    """bench.lib.http_client's one round of `level` streaming clients against `url` (the `http` phase's load)."""
    cmd = [sys.executable, "-m", "bench.lib.http_client", "--base-url", url, "--model", "peer", "--levels", str(level),
           "--prompt-tokens", str(prompt), "--max-tokens", str(tokens), "--vocab", str(vocab),
           "--round-timeout", f"{timeout:.0f}", "--time-left", f"{timeout:.0f}"]
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=repo, timeout=timeout + 60)
    if out.returncode != 0:
        raise RuntimeError(f"the HTTP client exited with {out.returncode}: {out.stderr.strip()[-300:]}")
    rounds = json.loads(out.stdout.strip().splitlines()[-1]).get("rounds") or []
    return rounds[0] if rounds else {"concurrency": level, "skipped": True}


def version_of(bin_dir: Path) -> str | None:
    """What `llama-server --version` prints (build number and commit), first line."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([str(bin_dir / "llama-server"), "--version"], capture_output=True, text=True, timeout=20)
        text = (out.stdout + out.stderr).strip()
        m = re.search(r"version: .*", text)
        return m.group(0) if m else (text.splitlines()[0] if text else None)
    return None
