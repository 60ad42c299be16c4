"""bench/results/ holds what runs measured, not code: a probe worth keeping is a module under bench/probes/, a
one-off is in git history, named by commit in its folder's README."""
from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_results_folders_hold_no_scripts_or_patches():
    code = sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.suffix in (".py", ".sh", ".patch"))
    assert code == [], "move probes to bench/probes/ (python -m bench.probes.NAME), drop the rest: " + ", ".join(code)


def test_every_results_folder_has_a_readme_with_its_commands():
    folders = [p for p in RESULTS.iterdir() if p.is_dir()]
    assert folders
    assert [p.name for p in folders if not (p / "README.md").is_file()] == []
