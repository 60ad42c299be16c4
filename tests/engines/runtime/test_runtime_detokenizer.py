"""The incremental detokenizer never releases a broken character or a possible stop string."""
from __future__ import annotations

from engines.runtime.detokenizer import IncrementalDetokenizer

CHINESE = "我们今天去北京的长城看看风景，天气很好。饕餮之徒"


def stream(tokenizer, ids, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas = []
    for t in ids:
        detok.add_token(t)
        deltas.append(detok.take_delta())
        if detok.stopped_by:
            break
    detok.flush()
    deltas.append(detok.take_delta(final=True))
    return detok, deltas


def test_characters_split_across_tokens_are_released_whole(tokenizer):
    ids = tokenizer.encode(CHINESE, add_special_tokens=False)
    split = [t for t in ids if "\ufffd" in tokenizer.decode([t])]
    assert split, "the sample must contain a character split across byte tokens"
    _, deltas = stream(tokenizer, ids)
    assert "".join(deltas) == CHINESE
    assert not any("\ufffd" in d for d in deltas)


def test_an_unfinished_character_is_flushed_at_the_end(tokenizer):
    ids = tokenizer.encode("饕", add_special_tokens=False)
    _, deltas = stream(tokenizer, ids[:-1])
    assert deltas[-1] == tokenizer.decode(ids[:-1])


def test_stop_string_is_cut_with_the_text_after_it(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    detok, deltas = stream(tokenizer, ids, stop=("gamma",))
    assert "".join(deltas) == "alpha beta "
    assert detok.stopped_by == "gamma"


def test_stop_string_can_be_kept_in_the_output(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    _, deltas = stream(tokenizer, ids, stop=("gamma",), include_stop_str_in_output=True)
    assert "".join(deltas) == "alpha beta gamma"


def test_a_possible_stop_prefix_is_held_back_until_it_cannot_match(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=("abcx",))
    for t in tokenizer.encode("zz abc", add_special_tokens=False):
        detok.add_token(t)
    assert "abc" not in detok.take_delta()
    for t in tokenizer.encode("d", add_special_tokens=False):
        detok.add_token(t)
    assert detok.take_delta().endswith("abcd")


def test_special_tokens_are_skipped_by_default(tokenizer):
    ids = tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    _, deltas = stream(tokenizer, ids)
    assert "".join(deltas) == "hi"
