"""What the benchmarks share: bench.json figures and the report, the machine description and memory probes, the model
shapes and random checkpoints, engine runs, HTTP load, bandwidth ceilings, fresh-process runs and the peer builds.
Nothing here imports an experiment (the contract in .importlinter)."""
