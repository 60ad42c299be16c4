"""The "vllm" engine: vLLM's async engine behind the ktserve engine contract (see engine.py)."""
