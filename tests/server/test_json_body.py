"""Request bodies and answers as JSON in pieces (server/json_body.py): what is parsed or encoded a piece at a
time, so that no single native call holds the interpreter lock for long, reads and writes exactly what one
call would."""
from __future__ import annotations

import json

import pytest
from starlette.responses import JSONResponse

from server.errors import APIError
from server.json_body import IN_PIECES_BYTES, SLICE, decode, render_json

PAD = b" " * IN_PIECES_BYTES  # trailing whitespace: the same document, large enough to be parsed in pieces


@pytest.mark.parametrize("content", [
    {"tokens": list(range(3 * SLICE + 5)), "token_strs": ["é", "\u2028", "a\"b", "日本"] * SLICE, "count": None},
    {"data": [{"index": i, "embedding": [i / 7, -0.0, 1e-300, 2.5e300]} for i in range(SLICE + 1)]},
    [[True, False, None, 1.5, "x", {"k": [1, [2, [3]]]}]] * 10, (1, 2), [], {}, "text", 0,
], ids=["token-lists", "embeddings", "nested", "tuple", "empty-list", "empty-dict", "string", "number"])
def test_an_answer_encoded_in_slices_is_byte_for_byte_what_jsonresponse_renders(content):
    assert render_json(content) == JSONResponse(content).body


def test_a_body_parsed_in_pieces_is_what_json_loads_reads():
    body = json.dumps({"tokens": list(range(200_000)), "texts": ["a,b]", "é\\n", "\u00e9"], "x": [1e300, -0.0, None],
                       "nested": {"a": [{"b": [True, False]}]}}).encode()
    assert len(body) >= IN_PIECES_BYTES
    assert decode(body) == json.loads(body)


@pytest.mark.parametrize("text,error", [
    (b'{"a": [1, 2,', json.JSONDecodeError),
    (b'{"a": 1} {"b": 2}', json.JSONDecodeError),
    (b'[' * 5000 + b']' * 5000, RecursionError),
], ids=["truncated", "extra-data", "nested-too-deeply"])
def test_a_broken_body_parsed_in_pieces_fails_as_json_loads_does(text, error):
    with pytest.raises(error):
        json.loads(text + PAD)
    with pytest.raises(error):
        decode(text + PAD)


def test_a_lone_surrogate_in_a_body_parsed_in_pieces_is_refused_naming_the_field():
    with pytest.raises(APIError) as refused:
        decode(b'{"input": ["ok", "\\ud800"]}' + PAD)
    assert refused.value.status == 400 and refused.value.param == "input[1]"
