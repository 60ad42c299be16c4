"""Scores of `ktserve eval`, checked against values worked out by hand.

English pair: hypothesis "the cat sat on the mat", reference "the cat is on the mat" (6 tokens each,
so the brevity penalty is 1).
  n-gram precisions (clipped counts): 1-gram 5/6, 2-gram 3/5 (the cat, on the, the mat),
  3-gram 1/4 (on the mat), 4-gram 0/3 -> method3 smoothing replaces it with 1/(2*3) = 1/6.
  BLEU-1 = 5/6 = 83.3333             BLEU-2 = (5/6 * 3/5)^(1/2) = 0.5^(1/2) = 70.7107
  BLEU-3 = (5/6 * 3/5 * 1/4)^(1/3) = (1/8)^(1/3) = 50      BLEU-4 = (1/8 * 1/6)^(1/4) = 48^(-1/4) = 37.9918
  rouge-chinese counts distinct n-grams: unigrams {the cat sat on mat} vs {the cat is on mat} share 4
  of 5 -> ROUGE-1 = 80; bigrams share 3 of 5 -> ROUGE-2 = 60; the longest common subsequence
  "the cat on the mat" is 5 of 6 tokens on both sides -> ROUGE-L = 83.3333.

Chinese pair: "我喜欢吃苹果" vs "我喜欢吃香蕉", segmented by jieba as 我/喜欢/吃/苹果 and 我/喜欢/吃/香蕉.
  precisions 3/4, 2/3, 1/2, and 0/1 -> 1/(2*1) = 1/2.
  BLEU-1 = 75   BLEU-2 = (1/2)^(1/2) = 70.7107   BLEU-3 = (1/4)^(1/3) = 62.9961   BLEU-4 = (1/8)^(1/4) = 59.4604
  ROUGE-1 = 3/4 = 75   ROUGE-2 = 2/3 = 66.6667   ROUGE-L = 3/4 = 75.

Short answer: "the cat" vs "the cat is on the mat": every n-gram matches but the brevity penalty is
exp(1 - 6/2) = exp(-2), so BLEU-1 = BLEU-2 = 13.5335; ROUGE-1: P = 1, R = 2/5 -> F = 2*0.4/1.4 = 57.1429.
"""

import pytest

from evaluation.metrics import TEXT_METRICS, bleu_scores, extract_choice, rouge_scores, segment, text_scores


def approx(value):
    return pytest.approx(value, abs=1e-3)


def test_english_is_split_into_words_and_punctuation():
    assert segment("The cat sat on the mat.") == ["The", "cat", "sat", "on", "the", "mat", "."]


def test_chinese_is_segmented_into_words_by_jieba():
    assert segment("我喜欢吃苹果") == ["我", "喜欢", "吃", "苹果"]


def test_identical_answer_scores_100_on_every_metric():
    for text in ("The capital of France is Paris.", "三角形的内角和是180度。"):
        assert text_scores(text, text) == {name: approx(100.0) for name in TEXT_METRICS}


def test_english_partial_overlap_bleu():
    assert bleu_scores("the cat sat on the mat", "the cat is on the mat") == {
        "bleu-1": approx(83.3333), "bleu-2": approx(70.7107), "bleu-3": approx(50.0), "bleu-4": approx(37.9918)}


def test_english_partial_overlap_rouge():
    assert rouge_scores("the cat sat on the mat", "the cat is on the mat") == {
        "rouge-1": approx(80.0), "rouge-2": approx(60.0), "rouge-l": approx(83.3333)}


def test_chinese_partial_overlap_bleu():
    assert bleu_scores("我喜欢吃苹果", "我喜欢吃香蕉") == {
        "bleu-1": approx(75.0), "bleu-2": approx(70.7107), "bleu-3": approx(62.9961), "bleu-4": approx(59.4604)}


def test_chinese_partial_overlap_rouge():
    assert rouge_scores("我喜欢吃苹果", "我喜欢吃香蕉") == {
        "rouge-1": approx(75.0), "rouge-2": approx(66.6667), "rouge-l": approx(75.0)}


def test_short_answer_pays_the_brevity_penalty():
    scores = text_scores("the cat", "the cat is on the mat")
    assert scores["bleu-1"] == approx(13.5335)
    assert scores["bleu-2"] == approx(13.5335)
    assert scores["rouge-1"] == approx(57.1429)


def test_empty_answer_scores_zero():
    assert text_scores("", "The capital of France is Paris.") == dict.fromkeys(TEXT_METRICS, 0.0)


@pytest.mark.parametrize("text", [
    "The answer is B",
    "the correct answer is: (B) because ...",
    "Answer: B",
    "B.",
    "B) Carbon dioxide",
    "(B)",
    "I would pick (B) here.",
    "答案：B",
    "答案是Ｂ选项",
    "B",
])
def test_answer_letter_is_found_in_common_phrasings(text):
    assert extract_choice(text, "ABCD") == "B"


def test_answer_phrase_wins_over_other_letters_in_the_text():
    assert extract_choice("A is tempting, but the answer is C.", "ABCD") == "C"


def test_reasoning_block_is_ignored():
    assert extract_choice("<think>Maybe A, or D?</think>The answer is C", "ABCD") == "C"


def test_capital_inside_a_word_is_not_a_letter():
    assert extract_choice("Because water is wet", "ABCD") is None


def test_letter_outside_the_options_is_not_an_answer():
    assert extract_choice("The answer is E", "ABCD") is None


def test_two_bare_letters_without_an_answer_phrase_are_ambiguous():
    assert extract_choice("A good guess would be C", "ABCD") is None
