"""Which kt-kernel expert classes compute over a given count of experts (the counts a split of the experts between
the GPU and kt-kernel leaves kt-kernel): each (method, experts, hidden x intermediate) in a child process, since a
failing class can crash the process.

    python -m bench.probes.expert_counts      (bench/results/nvidia-h100-2026-11-26-mapped/)

One JSON line per case: ok (finite output), or the child's exit code (-11: segmentation fault)."""
from __future__ import annotations

import json
import subprocess
import sys

CHILD = """
import sys, torch
from engines.kt.experts.cpu import RoutedExpertsCPU
n, m, H, I, K = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), 4
g = torch.Generator().manual_seed(0)
w = [torch.randn(n, *s, generator=g) * 0.05 for s in ((I, H), (I, H), (H, I))]
layer = RoutedExpertsCPU(layer_idx=5, num_experts=n, top_k=K, hidden_size=H, intermediate_size=I, method=m,
                         max_tokens=64)
layer.load_weights(*w)
ids = torch.stack([torch.randperm(n, generator=g)[:K] for _ in range(6)])
out = layer(torch.randn(6, H).bfloat16(), ids, torch.rand(6, K))
sys.exit(0 if bool(torch.isfinite(out.float()).all()) else 3)
"""

CASES = [("RAWINT4", (128, 64), (8, 12, 13, 16, 20)), ("RAWINT4", (256, 256), (20, 33, 64)),
         ("AMXINT8", (128, 64), (8, 12, 13, 16, 20)), ("BF16", (128, 64), (8, 12, 13, 16, 20)),
         ("FP8", (128, 128), (13, 20, 33)), ("AMXINT8", (256, 256), (20, 33, 40)),
         ("AMXINT4", (256, 256), (20, 33, 40)), ("FP8", (256, 256), (20, 33, 40))]


def main() -> int:
    for method, (hidden, inter), counts in CASES:
        for n in counts:
            done = subprocess.run([sys.executable, "-c", CHILD, str(n), method, str(hidden), str(inter)],
                                  capture_output=True, timeout=120)
            print(json.dumps({"method": method, "hidden": hidden, "intermediate": inter, "experts": n,
                              "result": "ok" if done.returncode == 0 else f"exit {done.returncode}"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
