"""Decode runs that need a fresh process, merged into the parent's bench.json.

Two things are fixed for the life of a process: kt-kernel's worker pool (its thread count, engines/kt/experts/cpuinfer.py)
and kt-kernel's CPU build (picked at import; `KT_KERNEL_CPU_VARIANT` forces a lower one). So the thread sweep
and the avx2 run each start `python -m bench.run --only decode` in a child process on the same checkpoint, and
take the `kt` section of the child's bench.json. The decode of each method but the primary runs in one too: in
the main process it followed the primary's engine and the other children, and read slower than alone (one H200
machine, 2026-11-27: AMXINT4 52.1 tok/s there, 59.4 in a fresh process). The child's output goes to children.log
in the results folder.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def child_decode(*, shape: str, quick: bool, model_dir: Path, log_path: Path, method: str, threads: int | None,
                 cuda_graph: bool, rules: str | None, deadline: float, env: dict[str, str] | None = None,
                 gpu_prefill_tokens: int | None = None, chunk_size: int | None = None,
                 settings: dict | None = None) -> dict:
    """Run the decode phase of `method` ("rules": whatever the placement rules choose on that build) in a child
    process under the parent's rule file (`rules`, None: the default) and engine `settings` (`--setting`, each
    value as JSON); its kt section entry, with the child's meta and phase outcome. Raises RuntimeError when the
    child fails or produces nothing."""
    with tempfile.TemporaryDirectory(prefix="ktserve-bench-child-") as tmp:
        budget = deadline - time.perf_counter()
        if budget < 10:
            raise RuntimeError(f"only {budget:.0f}s left for the child run")
        # the child's primary method is its one method: it decodes in the child's own process
        cmd = [sys.executable, "-m", "bench.run", "--shape", shape, "--only", "decode", "--methods", method,
               "--primary", method, "--model-dir", str(model_dir), "--out", tmp, "--budget", f"{budget:.0f}"]
        cmd += ["--quick"] if quick else []
        cmd += [] if threads is None else ["--threads", str(threads)]
        cmd += [] if cuda_graph else ["--no-cuda-graph"]
        cmd += [] if rules is None else ["--rules", rules]
        cmd += [] if gpu_prefill_tokens is None else ["--gpu-prefill-tokens", str(gpu_prefill_tokens)]
        cmd += [] if chunk_size is None else ["--chunk-size", str(chunk_size)]
        for key, value in (settings or {}).items():
            cmd += ["--setting", f"{key}={json.dumps(value)}"]
        with open(log_path, "a") as log:
            log.write(f"\n$ {' '.join(f'{k}={v}' for k, v in (env or {}).items())} {' '.join(cmd)}\n")
            log.flush()
            try:
                rc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=log,
                                    stderr=subprocess.STDOUT, timeout=budget + 15).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        path = Path(tmp) / "bench.json"
        if not path.exists():
            raise RuntimeError(f"the child run wrote no bench.json (exit {rc}); see {log_path.name}")
        data = json.loads(path.read_text())
    phase = data.get("phases", {}).get(f"decode:{method}", {"status": "not run"})
    entry = dict(data.get("kt", {}).get(method) or {})
    meta = data.get("meta", {})
    entry["child"] = {"exit": rc, "phase": phase, "kt_cpu_threads": meta.get("kt_cpu_threads"),
                      **{k: v for k, v in meta.items() if "variant" in k or k == "kt_kernel"}}
    if "decode" not in entry:
        raise RuntimeError(f"the child's decode phase: {phase.get('status')} {phase.get('reason', '')}".strip())
    return entry
