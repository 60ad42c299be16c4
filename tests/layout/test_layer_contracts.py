"""The layers point one way (.importlinter at the repository root): server/ reaches the engines only through
engines/base.py and never imports torch or numpy, engines/ never import server/, the ktransformers and
huggingface engines never import each other, the ktransformers core imports no model family (it finds them
through engines/kt/families/__init__.py), the families never import each other but V3.2 building on V2 / V3's,
engines/checkpoints/ imports no demo model, and bench.lib (what the benchmarks share) never imports an
experiment (tests/layout/test_import_cycles.py: no import cycles at all). import-linter reads the code, so a violation
anywhere (a function-level import included) fails here."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--config", str(REPO / ".importlinter"), "--no-cache"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
