"""Load and soak suite: a bounded load generator that drives a real `ktserve serve` process on loopback
with a mix of chat and completions requests, checks every answer, and reports per scenario.

Run it with `python -m tests.load.run` (see docs/reliability.md); tests/load/test_load_fast.py runs short
versions of the same scenarios in CI."""
