"""The grammar processor on its own: masks what the grammar forbids, forces EOS once it is complete."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engines.base import InvalidRequestError
from engines.base import Grammar, json_schema_grammar
from engines.runtime.structured import compiler_for


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return compiler_for(tokenizer)


def run(processor, token_ids):
    for t in token_ids:
        logits = torch.zeros(processor._vocab)
        processor([], logits)
        assert logits[t] == 0, f"token {t} was masked"
        processor.accept(t)


def test_only_grammar_tokens_survive_the_mask(compiler, tokenizer):
    processor = compiler.processor(json_schema_grammar({"enum": ["cat", "dog"]}))
    logits = torch.zeros(len(tokenizer))
    processor([], logits)
    allowed = torch.isfinite(logits).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]) in ('"', '"cat', '"dog', '"c', '"d', '"ca', '"do') or
                           '"cat"'.startswith(tokenizer.decode([t])) or '"dog"'.startswith(tokenizer.decode([t]))
                           for t in allowed)


def test_a_completed_grammar_leaves_only_eos(compiler, tokenizer):
    processor = compiler.processor(json_schema_grammar({"enum": ["cat"]}))
    run(processor, tokenizer.encode('"cat"', add_special_tokens=False))
    logits = torch.zeros(len(tokenizer))
    processor([], logits)
    assert torch.isfinite(logits).nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_constraint_waits_for_the_start_token(compiler, tokenizer):
    think_end = tokenizer.encode("</think>", add_special_tokens=False)[0]
    processor = compiler.processor(replace(json_schema_grammar({"enum": ["cat"]}), start_after=think_end))
    free = torch.zeros(len(tokenizer))
    processor([], free)
    assert torch.isfinite(free).all()
    processor.accept(think_end)
    constrained = torch.zeros(len(tokenizer))
    processor([], constrained)
    assert not torch.isfinite(constrained).all()


def test_an_invalid_grammar_names_its_request_field(compiler):
    with pytest.raises(InvalidRequestError) as err:
        compiler.compile(Grammar("lark", "start: undefined_rule", param="tools"))
    assert err.value.param == "tools"
