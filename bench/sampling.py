"""What choosing a step's tokens costs: `Sampler.sample_batch` over B rows of a 102,400-token vocabulary, with
the rows on the CPU and, where there is one, on a GPU, in the generation thread's setting (one torch CPU thread,
as the KT engine gives it when the model is on GPUs). Each row of a step asks for the same rules (`KINDS`):
greedy, temperature sampling (seeded), top_p, top_k, logprobs, the penalties over a 512-token history, or a JSON
schema (the demo model's tokenizer, DeepSeek-V3's 129,280 tokens, sets that kind's row width).

    python -m bench.sampling [--rows 1,8,32] [--kinds greedy,temperature,...] [--vocab 102400] [--repeats 20]
                             [--threads 1]

Prints one JSON line per (rows, kind, device): milliseconds per step, median of the repeats; and, for the
temperature rows on the CPU, what `torch.multinomial` (the sampler's draw before 2026-11-26) costs on the same
probabilities, for comparison. With `--prompt-positions N` (default 2048; 0: none) also the logprobs of an N-token
prompt (`Sampler.prompt_entries`, what `echo` with `logprobs` and `prompt_logprobs` ask for), with the top 0 and 5,
per device."""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch


KINDS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.7),
    "top_p": dict(temperature=0.7, top_p=0.9),
    "top_k": dict(temperature=0.7, top_k=50),
    "logprobs": dict(temperature=0.0, logprobs=5),
    "penalties": dict(temperature=0.7, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
    "json": dict(temperature=0.0),  # and a grammar
}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@functools.cache
def _demo_compiler():
    """The grammar compiler of the demo model's tokenizer, built once (it indexes the whole vocabulary)."""
    from transformers import AutoTokenizer

    from engines.demo_model import ensure_demo_model
    from engines.runtime.structured import compiler_for

    return compiler_for(AutoTokenizer.from_pretrained(ensure_demo_model()))


def _with_grammars(seqs: list) -> int:
    """Give each sequence a processor of SCHEMA over the demo model's tokenizer; that tokenizer's size."""
    from engines.base import json_schema_grammar

    compiler = _demo_compiler()
    for seq in seqs:
        seq.logits_processor = compiler.processor(json_schema_grammar(SCHEMA))
    return compiler.vocab_size


def _sequences(rows: int, kind: str, vocab: int) -> list:
    from engines.base import GenerationRequest, RequestHandle, SamplingParams
    from engines.runtime.sequence import Sequence

    history = torch.randint(vocab, (512,), generator=torch.Generator().manual_seed(1)).tolist()
    out = []
    for i in range(rows):
        request = GenerationRequest(prompt_token_ids=history[:256], sampling=SamplingParams(seed=i, **KINDS[kind]))
        handle = RequestHandle(request.request_id, loop=None, on_cancel=lambda _: None)  # type: ignore[arg-type]
        seq = Sequence.create(request, handle, detokenizer=None)  # type: ignore[arg-type]
        seq.token_ids += history[256:]  # 256 tokens generated so far
        out.append(seq)
    return out


class _Pieces:
    """A tokenizer stand-in for the logprob entries' token text."""

    @staticmethod
    def convert_ids_to_tokens(token_id: int) -> str:
        return f"t{token_id}"


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e3, 3)


def main() -> None:
    from engines.runtime.sampler import Sampler

    p = argparse.ArgumentParser(prog="python -m bench.sampling")
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--kinds", default=",".join(KINDS), help="which of " + ", ".join(KINDS))
    p.add_argument("--vocab", type=int, default=102400)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of the sampling thread")
    p.add_argument("--prompt-positions", type=int, default=2048, help="a prompt's logprobs over this many positions")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        p.error(f"--kinds: unknown {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    sampler = Sampler(tokenizer=_Pieces(), eos_token_ids=(1,))
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(rows)) * 3
        for kind in kinds:
            seqs = _sequences(rows, kind, args.vocab)
            width = _with_grammars(seqs) if kind == "json" else args.vocab
            for device in devices:
                on = logits.to(device) if width == args.vocab else torch.randn(rows, width).to(device)

                def step():
                    sampler.sample_batch(list(on), seqs)
                    if device == "cuda":
                        torch.cuda.synchronize()
                result = {"rows": rows, "kind": kind, "device": device, "ms": _median_ms(step, args.repeats),
                          "threads": args.threads}
                if kind == "temperature" and device == "cpu":
                    probs = torch.softmax(logits / 0.7, dim=-1)
                    gen = torch.Generator().manual_seed(0)
                    result["multinomial_ms"] = _median_ms(
                        lambda: [torch.multinomial(row, 1, generator=gen) for row in probs], args.repeats)
                print(json.dumps(result), flush=True)
    if args.prompt_positions > 0:
        logits = torch.randn(args.prompt_positions, args.vocab, generator=torch.Generator().manual_seed(0))
        targets = torch.randint(args.vocab, (args.prompt_positions,)).tolist()
        for device in devices:
            on = logits.to(device)
            for top in (0, 5):
                ms = _median_ms(lambda: sampler.prompt_entries(on, targets, top), max(1, args.repeats // 4))
                print(json.dumps({"prompt_positions": args.prompt_positions, "top": top, "device": device, "ms": ms,
                                  "threads": args.threads}), flush=True)


if __name__ == "__main__":
    main()
