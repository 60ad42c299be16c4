"""ktserve's benchmarks. `python -m bench.run` is the speed suite (bench/README.md); the other modules each
time one component."""
