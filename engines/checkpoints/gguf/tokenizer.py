"""The tokenizer a GGUF file carries (`tokenizer.ggml.*`), rebuilt as a transformers fast tokenizer.

DeepSeek's GGUFs keep a byte-level BPE (`tokenizer.ggml.model` "gpt2"): the tokens (byte-level spellings for
ordinary ones, plain text for added ones), their types (1 normal, 3 control = special, 4 user-defined, 5
unused padding), the merges, and `tokenizer.ggml.pre`, the name of the way text is split before merging.
transformers' own GGUF conversion knows no DeepSeek split, so the tokenizer is built here with the split of
DeepSeek's own tokenizer.json for the names that use it; the ids are the file's."""
from __future__ import annotations

import json
from typing import Any

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4

# DeepSeek-V3's pre-tokenizer (V3, R1, V3.1 and Kimi's deepseek-v3 GGUFs): digits in threes, CJK runs, then
# words, punctuation and spaces
_DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)
PRE_TOKENIZERS = {"deepseek-v3": _DEEPSEEK_V3_SPLITS}


def tokenizer_json(meta: Any, source: str) -> dict[str, Any]:
    """tokenizers' JSON form of the file's tokenizer; `meta(key, default)` reads the metadata."""
    model, pre = meta("tokenizer.ggml.model", None), meta("tokenizer.ggml.pre", None)
    if model != "gpt2" or pre not in PRE_TOKENIZERS:
        raise ValueError(f"model: {source} carries a {model!r} tokenizer with the {pre!r} split; ktserve rebuilds "
                         f"byte-level BPE tokenizers split as {', '.join(PRE_TOKENIZERS)}. Give the original model's "
                         "folder (config.json and tokenizer files) as model_path beside gguf_path")
    tokens = list(meta("tokenizer.ggml.tokens"))
    types = list(meta("tokenizer.ggml.token_type", [NORMAL] * len(tokens)))
    # every id in the model's vocabulary, added ones too: tokenizers numbers an added token it does not find
    # there after the vocabulary, whatever id the JSON gives it
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": kind == CONTROL} for i, (t, kind) in enumerate(zip(tokens, types))
             if kind in (CONTROL, USER_DEFINED)]
    bos = meta("tokenizer.ggml.bos_token_id", None)
    post = None
    if bos is not None and meta("tokenizer.ggml.add_bos_token", False):
        first = {"SpecialToken": {"id": tokens[bos], "type_id": 0}}
        post = {"type": "TemplateProcessing",
                "single": [first, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [first, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": tokens[bos],
                         "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {tokens[bos]: {"id": tokens[bos], "ids": [bos], "tokens": [tokens[bos]]}}}
    splits = [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
              for r in PRE_TOKENIZERS[pre]]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            *splits, {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": list(meta("tokenizer.ggml.merges"))},
    }


def build_tokenizer(meta: Any, source: str) -> Any:
    """A PreTrainedTokenizerFast with the file's ids, special tokens and chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = tokenizer_json(meta, source)
    tokens = meta("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        index = meta(key, None)
        return None if index is None else tokens[int(index)]

    try:
        backend = Tokenizer.from_str(json.dumps(spec))
    except Exception as exc:  # the tokenizers library raises its own Exception on inconsistent vocab/merges
        raise ValueError(f"model: {source}: its tokenizer metadata does not make a tokenizer ({exc})") from None
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id") or token("tokenizer.ggml.eos_token_id"),
        clean_up_tokenization_spaces=False, model_max_length=int(1e30))
    tokenizer.chat_template = meta("tokenizer.chat_template", None)
    return tokenizer
