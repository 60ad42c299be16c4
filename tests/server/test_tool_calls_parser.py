"""The DeepSeek-V3 tool-call parser, fed model text in pieces as the engine delivers it."""
from __future__ import annotations

import json

import pytest

from server.chat.tool_calls import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, DeepSeekV3ToolParser


def call_text(name: str, args: dict | str) -> str:
    body = args if isinstance(args, str) else json.dumps(args)
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{body}\n```{CALL_END}"


def tool_output(*calls: str, before: str = "") -> str:
    return before + CALLS_BEGIN + "\n".join(calls) + CALLS_END


def feed_in_pieces(text: str, size: int):
    """Run the parser over `text` cut into `size`-character pieces; return (content, deltas, parser)."""
    parser = DeepSeekV3ToolParser()
    content, deltas = [], []
    for i in range(0, len(text), size):
        out = parser.feed(text[i:i + size])
        content.append(out.content)
        deltas += out.calls
    out = parser.finish()
    content.append(out.content)
    deltas += out.calls
    return "".join(content), deltas, parser


def assembled(deltas) -> list[dict]:
    """Tool calls put together from deltas the way the OpenAI SDK does it."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.id is not None:
            calls[d.index] = {"id": d.id, "name": d.name, "arguments": d.arguments}
        else:
            calls[d.index]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


TWO_CALLS = tool_output(call_text("get_weather", {"city": "Paris", "unit": "celsius"}),
                        call_text("get_time", {"zone": "Europe/Paris"}), before="Let me check.")


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_tool_calls_parse_the_same_whatever_the_delta_size(size):
    content, deltas, parser = feed_in_pieces(TWO_CALLS, size)
    assert content == "Let me check."
    calls = assembled(deltas)
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert json.loads(calls[1]["arguments"]) == {"zone": "Europe/Paris"}
    assert parser.well_formed


def test_each_call_is_announced_with_id_and_name_before_its_arguments():
    _, deltas, parser = feed_in_pieces(TWO_CALLS, 1)
    firsts = [d for d in deltas if d.id is not None]
    assert [d.index for d in firsts] == [0, 1]
    assert all(d.id.startswith("call_") for d in firsts) and firsts[0].id != firsts[1].id
    assert deltas.index(firsts[0]) < min(i for i, d in enumerate(deltas) if d.index == 0 and d.id is None)


def test_no_marker_text_leaks_into_content_or_arguments():
    content, deltas, _ = feed_in_pieces(TWO_CALLS, 1)
    pieces = [content] + [d.arguments for d in deltas]
    assert not any(ch in piece for piece in pieces for ch in "｜▁")
    assert not any("```" in d.arguments for d in deltas)


def test_arguments_with_newlines_are_kept_whole():
    args = '{\n  "city": "Paris"\n}'
    content, deltas, parser = feed_in_pieces(tool_output(call_text("get_weather", args)), 1)
    assert assembled(deltas)[0]["arguments"] == args and parser.well_formed


def test_plain_text_is_content_and_no_call():
    content, deltas, parser = feed_in_pieces("No tools needed: 1 < 2 and <｜tool", 2)
    assert content == "No tools needed: 1 < 2 and <｜tool"
    assert deltas == [] and not parser.well_formed


def test_a_broken_call_block_degrades_to_content():
    text = CALLS_BEGIN + "this is not a call"
    content, deltas, parser = feed_in_pieces(text, 3)
    assert content == text and deltas == [] and not parser.well_formed


def test_a_wrong_call_kind_degrades_to_content():
    text = CALLS_BEGIN + f"{CALL_BEGIN}python{SEP}run\n```json\n{{}}\n```{CALL_END}{CALLS_END}"
    content, deltas, parser = feed_in_pieces(text, 4)
    assert deltas == [] and content.startswith(CALLS_BEGIN + CALL_BEGIN + "python")


def test_arguments_that_are_not_json_are_not_well_formed():
    _, _, parser = feed_in_pieces(tool_output(call_text("f", "{not json")), 5)
    assert not parser.well_formed


def test_a_call_cut_off_mid_arguments_is_incomplete():
    text = tool_output(call_text("get_weather", {"city": "Paris"}))[:-40]
    _, deltas, parser = feed_in_pieces(text, 3)
    assert parser.calls and not parser.calls[-1].complete and not parser.well_formed
