"""Per-token cost of grammar-constrained decoding on the DeepSeek vocabulary (129,280 tokens).

Prints, for a JSON schema with the keywords that bound an output: the one-time tokenizer index build, the
schema compile, and the median / p90 time of one step (compute the mask, apply it to a logits row), over
sampled outputs. Run: `python -m bench.structured_mask` (CPU; builds the demo model if needed)."""
from __future__ import annotations

import statistics
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "kind": {"enum": ["cat", "dog"]}}, "required": ["name", "age", "kind"], "additionalProperties": False}


def main(samples: int = 20, max_steps: int = 200) -> None:
    from transformers import AutoTokenizer

    from engines.demo_model import ensure_demo_model
    from engines.runtime.structured import GrammarCompiler, json_schema_grammar

    tokenizer = AutoTokenizer.from_pretrained(ensure_demo_model())
    started = time.perf_counter()
    compiler = GrammarCompiler(tokenizer)
    built = time.perf_counter() - started
    grammar = json_schema_grammar(SCHEMA)
    started = time.perf_counter()
    compiler.compile(grammar)
    compiled = time.perf_counter() - started
    steps: list[float] = []
    for seed in range(samples):
        gen = torch.Generator().manual_seed(seed)
        processor = compiler.processor(grammar)
        for _ in range(max_steps):
            logits = torch.randn(compiler.vocab_size, generator=gen) * 4
            t0 = time.perf_counter()
            processor([], logits)
            steps.append(time.perf_counter() - t0)
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            if token == compiler.eos_token_id:
                break
            processor.accept(token)
    steps.sort()
    print(f"vocabulary {compiler.vocab_size}: index build {built * 1e3:.0f} ms, schema compile {compiled * 1e3:.1f} ms, "
          f"step median {statistics.median(steps) * 1e6:.0f} us, p90 {steps[int(len(steps) * 0.9)] * 1e6:.0f} us "
          f"over {len(steps)} steps")


if __name__ == "__main__":
    main()
