"""One-off probes kept because they answer a question again on a new machine: each is `python -m bench.probes.<name>`
and prints JSON lines (its docstring says what it measures). The results folders hold only what they printed."""
