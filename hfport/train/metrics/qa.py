"""question-answering metrics: SQuAD's exact match and token F1 (v1.1, and v2's unanswerable questions)."""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .base import _same_length

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """The official SQuAD normalisation: lowercase, drop punctuation, drop a/an/the, squeeze whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _golds(answers: Sequence[str] | str | Mapping[str, Any]) -> list[str]:
    if isinstance(answers, Mapping):  # a datasets SQuAD row: {"text": [...], "answer_start": [...]}
        answers = answers["text"]
    answers = [answers] if isinstance(answers, str) else list(answers)
    # v2: golds that normalise to nothing are dropped; none left means "no answer", matched only by ""
    return [a for a in answers if normalize_answer(a)] or [""]


def _f1_one(prediction: str, gold: str) -> float:
    pred_toks, gold_toks = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred_toks or not gold_toks:
        return float(pred_toks == gold_toks)  # v2: both empty (no answer) is a match
    same = sum((collections.Counter(pred_toks) & collections.Counter(gold_toks)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_toks), same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def squad_exact_match(prediction: str, answers: Sequence[str] | str | Mapping[str, Any]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer; no golds = no answer."""
    return max(float(normalize_answer(prediction) == normalize_answer(g)) for g in _golds(answers))


def squad_f1(prediction: str, answers: Sequence[str] | str | Mapping[str, Any]) -> float:
    """Best token-overlap F1 of the prediction against the gold answers; no golds = no answer."""
    return max(_f1_one(prediction, g) for g in _golds(answers))


def squad_metrics(predictions: Sequence[str],
                  answers: Sequence[Sequence[str] | str | Mapping[str, Any]]) -> dict[str, float]:
    """exact_match and f1 averaged over questions (fractions, not the official script's percentages).

    `answers[i]` lists the gold texts of question i (or is a datasets row `{"text": [...], ...}`); an empty list
    marks an unanswerable (SQuAD v2) question, which only the prediction "" matches. With answers everywhere
    this is SQuAD v1.1."""
    if predictions is None or len(predictions) == 0:
        raise ValueError("predictions is empty")
    if answers is None or len(answers) == 0:
        raise ValueError("answers is empty")
    _same_length(predictions, answers, "predictions", "answers")
    if isinstance(predictions, str) or not all(isinstance(p, str) for p in predictions):
        raise ValueError("predictions must be a list of answer strings")
    em = [squad_exact_match(p, a) for p, a in zip(predictions, answers)]
    f1 = [squad_f1(p, a) for p, a in zip(predictions, answers)]
    return {"exact_match": float(np.mean(em)), "f1": float(np.mean(f1))}


def compute(problem_type: str | None = None, *, predictions: Any = None, labels: Any = None,
            **_: Any) -> dict[str, float]:
    """predictions = answer strings, labels = gold answer lists (empty = no answer)."""
    return squad_metrics(predictions, labels)
