"""--reasoning-parser deepseek_r1 and kt_force_think end to end: a scripted model writes the reply, the
official openai client reads it."""
from __future__ import annotations

import pytest

from tests.scripted_engine import ECHO, scripted_server

THOUGHT = "<think>\nThe user wants a greeting.</think>\n\nHello!"


@pytest.fixture(scope="module")
def r1(demo_model_dir):
    with scripted_server(demo_model_dir, reasoning_parser="deepseek_r1") as server:
        yield server


@pytest.fixture(scope="module")
def r1_forced(demo_model_dir):
    with scripted_server(demo_model_dir, reasoning_parser="deepseek_r1", kt_force_think=True) as server:
        yield server


def ask(server, text: str, **kwargs):
    return server.openai().chat.completions.create(model="scripted", messages=[{"role": "user", "content": text}],
                                                   **kwargs)


def streamed(server, text: str, **kwargs) -> tuple[list[str], list[str], str | None]:
    """(reasoning deltas, content deltas, finish_reason) of a streamed reply."""
    reasoning, content, finish = [], [], None
    for chunk in ask(server, text, stream=True, **kwargs):
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return reasoning, content, finish


def test_think_block_goes_to_reasoning_content_and_the_rest_to_content(r1):
    message = ask(r1, THOUGHT).choices[0].message
    assert message.reasoning_content == "The user wants a greeting."
    assert message.content == "Hello!"


def test_streamed_reasoning_and_content_arrive_in_their_own_fields(r1):
    reasoning, content, finish = streamed(r1, THOUGHT)
    assert "".join(reasoning) == "The user wants a greeting." and "".join(content) == "Hello!"
    assert not any("think>" in piece for piece in reasoning + content)
    assert finish == "stop"


def test_a_thinking_cut_off_by_max_tokens_is_all_reasoning(r1):
    reply = ask(r1, "<think>\nstep one, step two, step three and more", max_tokens=5).choices[0]
    assert reply.finish_reason == "length"
    assert reply.message.reasoning_content.startswith("step one") and reply.message.content == ""


def test_a_streamed_thinking_cut_off_by_max_tokens_is_all_reasoning(r1):
    reasoning, content, finish = streamed(r1, "<think>\nstep one, step two, step three", max_tokens=5)
    assert "".join(reasoning).startswith("step one") and "".join(content) == "" and finish == "length"


def test_force_think_ends_the_prompt_with_an_open_think_block(r1_forced):
    message = ask(r1_forced, ECHO).choices[0].message
    assert message.reasoning_content.endswith("<｜Assistant｜><think>\n")


def test_force_think_output_starts_inside_the_reasoning(r1_forced):
    message = ask(r1_forced, "Greeting needed.</think>\n\nHi!").choices[0].message
    assert (message.reasoning_content, message.content) == ("Greeting needed.", "Hi!")


def test_force_think_without_a_parser_shows_the_opening_tag(demo_model_dir):
    with scripted_server(demo_model_dir, kt_force_think=True) as server:
        assert ask(server, "Greeting needed.</think>\n\nHi!").choices[0].message.content == \
            "<think>\nGreeting needed.</think>\n\nHi!"
        _, content, _ = streamed(server, "Greeting needed.</think>\n\nHi!")
        assert "".join(content) == "<think>\nGreeting needed.</think>\n\nHi!"


def test_without_a_parser_the_text_is_untouched(server_without_parser):
    message = ask(server_without_parser, THOUGHT).choices[0].message
    assert message.content == THOUGHT and getattr(message, "reasoning_content", None) is None


@pytest.fixture(scope="module")
def server_without_parser(demo_model_dir):
    with scripted_server(demo_model_dir) as server:
        yield server
