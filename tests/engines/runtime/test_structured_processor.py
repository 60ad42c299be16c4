"""The grammar processor on its own: masks what the grammar forbids, forces EOS once it is complete."""
from __future__ import annotations

import ctypes
from dataclasses import replace

import numpy as np
import pytest

from engines.base import InvalidRequestError
from engines.base import Grammar, json_schema_grammar
from engines.runtime.structured import GrammarProcessor, compiler_for


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return compiler_for(tokenizer)


def allowed_tokens(processor, vocab: int) -> list[int] | None:
    """The token ids the processor allows next; None: any."""
    allowed = processor.allowed()
    if allowed is None or isinstance(allowed, int):
        return allowed if allowed is None else [allowed]
    bits = np.unpackbits(allowed.numpy().view(np.uint8), bitorder="little")
    assert not bits[vocab:].any(), "bits past the vocabulary"
    return np.flatnonzero(bits).tolist()


def run(processor, token_ids):
    for t in token_ids:
        assert t in allowed_tokens(processor, processor._vocab), f"token {t} was masked"
        processor.accept(t)


def test_only_grammar_tokens_survive_the_mask(compiler, tokenizer):
    processor = compiler.processor(json_schema_grammar({"enum": ["cat", "dog"]}))
    allowed = allowed_tokens(processor, len(tokenizer))
    assert allowed and all(tokenizer.decode([t]) in ('"', '"cat', '"dog', '"c', '"d', '"ca', '"do') or
                           '"cat"'.startswith(tokenizer.decode([t])) or '"dog"'.startswith(tokenizer.decode([t]))
                           for t in allowed)


def test_a_completed_grammar_leaves_only_eos(compiler, tokenizer):
    processor = compiler.processor(json_schema_grammar({"enum": ["cat"]}))
    run(processor, tokenizer.encode('"cat"', add_special_tokens=False))
    assert allowed_tokens(processor, len(tokenizer)) == [tokenizer.eos_token_id]


def test_constraint_waits_for_the_start_token(compiler, tokenizer):
    think_end = tokenizer.encode("</think>", add_special_tokens=False)[0]
    processor = compiler.processor(replace(json_schema_grammar({"enum": ["cat"]}), start_after=think_end))
    assert allowed_tokens(processor, len(tokenizer)) is None
    processor.accept(think_end)
    assert len(allowed_tokens(processor, len(tokenizer))) < len(tokenizer)


class AllowsEverything:
    """A matcher stand-in whose mask sets every bit it is handed."""

    def is_stopped(self):
        return False

    def is_error(self):
        return False

    def unsafe_compute_mask_ptr(self, ptr, size):
        ctypes.memset(ptr, 0xFF, size)


@pytest.mark.parametrize("vocab", [40, 63, 64])
def test_a_mask_never_allows_a_token_past_the_vocabulary(vocab):
    processor = GrammarProcessor(AllowsEverything(), vocab, eos_token_id=1)
    assert allowed_tokens(processor, vocab) == list(range(vocab))


def test_an_invalid_grammar_names_its_request_field(compiler):
    with pytest.raises(InvalidRequestError) as err:
        compiler.compile(Grammar("lark", "start: undefined_rule", param="tools"))
    assert err.value.param == "tools"
