"""Answer scoring as in SQuAD and FlashRAG: exact match and token F1 after normalisation."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace."""
    text = text.lower().translate(_PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golden: Iterable[str]) -> float:
    """1.0 when the normalised prediction equals any normalised golden answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golden))


def _f1(prediction: str, answer: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(answer).split()
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golden: Iterable[str]) -> float:
    """Token F1 of the normalised prediction, the best over the golden answers."""
    return max((_f1(prediction, g) for g in golden), default=0.0)


def contains_answer(text: str, golden: Iterable[str]) -> bool:
    """Whether a golden answer appears as whole normalised tokens in `text` (retrieval hit)."""
    haystack = f" {normalize_answer(text)} "
    return any((needle := normalize_answer(g)) and f" {needle} " in haystack for g in golden)
