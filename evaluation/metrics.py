"""Per-sample scores, computed by the libraries LLaMA-Factory's evaluation uses.

- Segmentation: jieba. It splits Chinese into words and leaves English words whole (split at
  whitespace and punctuation), so one tokenizer serves both languages.
- BLEU-1..4: nltk `sentence_bleu` with `SmoothingFunction().method3`, cumulative weights
  (1,0,0,0), (1/2,1/2,0,0), (1/3,1/3,1/3,0), (1/4,1/4,1/4,1/4).
- ROUGE-1/2/L: F-scores from rouge-chinese `Rouge().get_scores` on the space-joined tokens.
- Multiple choice: the answer letter found in the generated text.

All scores are percentages (x100), like LLaMA-Factory's `predict_results.json`.
"""

from __future__ import annotations

import logging
import re
import unicodedata

import jieba
from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
from rouge_chinese import Rouge

jieba.setLogLevel(logging.WARNING)  # its dictionary-loading banner would interleave with the progress bar

BLEU_WEIGHTS = {
    "bleu-1": (1.0, 0.0, 0.0, 0.0),
    "bleu-2": (1 / 2, 1 / 2, 0.0, 0.0),
    "bleu-3": (1 / 3, 1 / 3, 1 / 3, 0.0),
    "bleu-4": (1 / 4, 1 / 4, 1 / 4, 1 / 4),
}
ROUGE_KEYS = ("rouge-1", "rouge-2", "rouge-l")
TEXT_METRICS = tuple(BLEU_WEIGHTS) + ROUGE_KEYS

_SMOOTHING = SmoothingFunction().method3
_ROUGE = Rouge()


def segment(text: str) -> list[str]:
    """Word tokens of `text` (jieba), whitespace dropped."""
    return [token for token in jieba.cut(text) if token.strip()]


def bleu_scores(hypothesis: str, reference: str) -> dict[str, float]:
    """Sentence BLEU-1..4 of `hypothesis` against one `reference`, x100."""
    hyp, ref = segment(hypothesis), segment(reference)
    if not hyp or not ref:
        return dict.fromkeys(BLEU_WEIGHTS, 0.0)
    return {name: 100 * sentence_bleu([ref], hyp, weights=weights, smoothing_function=_SMOOTHING)
            for name, weights in BLEU_WEIGHTS.items()}


def rouge_scores(hypothesis: str, reference: str) -> dict[str, float]:
    """ROUGE-1/2/L F-scores of `hypothesis` against `reference`, x100."""
    hyp, ref = segment(hypothesis), segment(reference)
    if not hyp or not ref:
        # rouge-chinese raises on an empty side; an empty answer shares nothing with the reference.
        return dict.fromkeys(ROUGE_KEYS, 0.0)
    scores = _ROUGE.get_scores(" ".join(hyp), " ".join(ref))[0]
    return {name: 100 * scores[name]["f"] for name in ROUGE_KEYS}


def text_scores(hypothesis: str, reference: str) -> dict[str, float]:
    """BLEU-1..4 and ROUGE-1/2/L in one dict."""
    return bleu_scores(hypothesis, reference) | rouge_scores(hypothesis, reference)


# Reasoning models (DeepSeek-R1) weigh several letters before answering; only the answer counts.
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)


def extract_choice(text: str, letters: str) -> str | None:
    """The option letter that `text` answers with, or None when it names none unambiguously.

    Tried in order: an explicit answer phrase ("The answer is B", "Answer: (B)", "答案：B"), a
    letter opening the text ("B.", "B) ...", "B" alone on the first line), a parenthesised letter ("(B)"), and finally the only
    option letter standing alone anywhere in the text.
    """
    # NFKC folds full-width forms ("Ｂ", "：", "（") into the ASCII ones the patterns expect.
    text = _THINK.sub("", unicodedata.normalize("NFKC", text))
    # A letter not glued to other Latin letters, so "Because" does not read as "B".
    letter = rf"(?<![A-Za-z])([{re.escape(letters)}])(?![A-Za-z])"
    patterns = (
        rf"(?i:answer|correct option|correct choice)(?:\s+is)?\s*:?\s*\(?{letter}",
        rf"答案\s*(?:是|为|应为|应该是|选)?\s*:?\s*\(?{letter}",
        rf"^\s*\(?{letter}(?:[.):、,]|[ \t]*(?:\n|$))",
        rf"\({letter}\)",
    )
    for pattern in patterns:
        match = re.search(pattern, text)
        if match:
            return match.group(1)
    standalone = set(re.findall(letter, text))
    return standalone.pop() if len(standalone) == 1 else None
