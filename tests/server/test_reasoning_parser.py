"""The deepseek_r1 reasoning parser, fed model text in pieces as the engine delivers it."""
from __future__ import annotations

import pytest

from server.reasoning import DeepSeekR1ReasoningParser, check_reasoning_parser, prompt_opens_reasoning


def split(text: str, size: int, starts_in_reasoning: bool):
    """(reasoning pieces, content pieces) of `text` fed in `size`-character pieces."""
    parser = DeepSeekR1ReasoningParser(starts_in_reasoning)
    outs = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
    return [o.reasoning for o in outs], [o.content for o in outs]


@pytest.mark.parametrize("size", [1, 2, 5, 100])
def test_text_before_the_closing_tag_is_reasoning_and_after_it_content(size):
    reasoning, content = split("Let me think.\nOK.</think>\n\nThe answer is 4.", size, starts_in_reasoning=True)
    assert "".join(reasoning) == "Let me think.\nOK."
    assert "".join(content) == "The answer is 4."


@pytest.mark.parametrize("size", [1, 3])
def test_no_piece_of_a_split_closing_tag_reaches_either_field(size):
    reasoning, content = split("abc</think>def", size, starts_in_reasoning=True)
    assert not any(ch in piece for piece in reasoning + content for ch in "<>/")


def test_an_opening_tag_written_by_the_model_starts_the_reasoning():
    reasoning, content = split("<think>\nhmm</think>\n\nHello", 2, starts_in_reasoning=False)
    assert ("".join(reasoning), "".join(content)) == ("hmm", "Hello")


def test_output_without_any_thinking_is_all_content():
    reasoning, content = split("Just an answer <b>bold</b>", 3, starts_in_reasoning=False)
    assert ("".join(reasoning), "".join(content)) == ("", "Just an answer <b>bold</b>")


def test_thinking_that_never_closes_is_all_reasoning():
    reasoning, content = split("still thinking </thi", 4, starts_in_reasoning=True)
    assert ("".join(reasoning), "".join(content)) == ("still thinking </thi", "")


def test_a_prompt_ending_in_an_open_think_block_starts_in_reasoning():
    assert prompt_opens_reasoning("<｜Assistant｜><think>\n")
    assert not prompt_opens_reasoning("<｜User｜>what does <think> do?<｜Assistant｜>")


def test_an_unknown_parser_name_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="reasoning_parser"):
        check_reasoning_parser("qwen3")
