"""text-classification metrics: single-label, multi-label and regression."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from .base import ArrayLike, _array, _prf, _safe_div, _same_length

PROBLEM_TYPES = ("single_label_classification", "multi_label_classification", "regression")

# ------------------------------------------------------------------------------ single-label classification

def _class_ids(predictions: ArrayLike, labels: ArrayLike, num_labels: int | None,
               label_names: Sequence[str] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """Validated (pred index, label index, class values, class names); logits (N, L) are argmaxed."""
    pred, true = _array(predictions, "predictions"), _array(labels, "labels")
    if label_names is not None:
        if num_labels is not None and num_labels != len(label_names):
            raise ValueError(f"num_labels is {num_labels} but label_names has {len(label_names)} names")
        num_labels = len(label_names)
    if pred.ndim == 2:  # logits
        if num_labels is not None and pred.shape[1] != num_labels:
            raise ValueError(f"predictions has {pred.shape[1]} logits per row but num_labels is {num_labels}")
        num_labels = pred.shape[1]
        pred = pred.argmax(axis=1)
    if pred.ndim != 1 or true.ndim != 1:
        raise ValueError(f"predictions must be (N,) ids or (N, L) logits and labels (N,) ids; "
                         f"got shapes {pred.shape} and {true.shape}")
    _same_length(pred, true)
    for a, name in ((pred, "predictions"), (true, "labels")):
        # float ids that are whole numbers (a collator's float labels) are fine; strings or 0.5 are not
        whole = np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_ or (
            np.issubdtype(a.dtype, np.floating) and bool(np.all(np.mod(a, 1) == 0)))
        if not whole:
            raise ValueError(f"{name} must hold integer class ids, got dtype {a.dtype}")
    pred, true = pred.astype(np.int64), true.astype(np.int64)
    if num_labels is not None:
        classes = np.arange(num_labels)
        for a, name in ((pred, "predictions"), (true, "labels")):
            bad = a[(a < 0) | (a >= num_labels)]
            if bad.size:
                raise ValueError(f"{name} holds id {int(bad[0])}, outside 0..{num_labels - 1} (num_labels)")
    else:
        classes = np.union1d(pred, true)  # sklearn's default: the labels seen in either array
    names = list(label_names) if label_names is not None else [str(int(c)) for c in classes]
    return np.searchsorted(classes, pred), np.searchsorted(classes, true), classes, names


def _confusion_counts(pred: np.ndarray, true: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tp = np.bincount(true[pred == true], minlength=n)
    fp = np.bincount(pred, minlength=n) - tp
    fn = np.bincount(true, minlength=n) - tp
    return tp, fp, fn


def accuracy(predictions: ArrayLike, labels: ArrayLike) -> float:
    """Fraction of positions where prediction == label. Logits (N, L) are argmaxed."""
    pred, true = _array(predictions, "predictions"), _array(labels, "labels")
    if pred.ndim == true.ndim + 1:
        pred = pred.argmax(axis=-1)
    if pred.shape != true.shape:
        raise ValueError(f"predictions has shape {pred.shape} but labels has shape {true.shape}")
    return float(np.mean(pred == true))


def precision_recall_f1(predictions: ArrayLike, labels: ArrayLike, *, average: Literal["macro", "micro"] = "macro",
                        num_labels: int | None = None) -> tuple[float, float, float]:
    """Single-label (precision, recall, F1), macro or micro averaged.

    Without `num_labels` the classes are those seen in either array (sklearn's default); with it, every class
    in 0..num_labels-1 counts, so a class absent from the batch adds a 0 to the macro average."""
    if average not in ("macro", "micro"):
        raise ValueError(f"average must be 'macro' or 'micro', got {average!r}")
    pred, true, classes, _ = _class_ids(predictions, labels, num_labels, None)
    tp, fp, fn = _confusion_counts(pred, true, len(classes))
    if average == "micro":
        tp, fp, fn = tp.sum(keepdims=True), fp.sum(keepdims=True), fn.sum(keepdims=True)
    p, r, f = _prf(tp, fp, fn)
    return float(p.mean()), float(r.mean()), float(f.mean())


def per_label_f1(predictions: ArrayLike, labels: ArrayLike, *, num_labels: int | None = None,
                 label_names: Sequence[str] | None = None) -> dict[str, float]:
    """Single-label F1 per class, keyed by label name (or the id as a string)."""
    pred, true, classes, names = _class_ids(predictions, labels, num_labels, label_names)
    _, _, f = _prf(*_confusion_counts(pred, true, len(classes)))
    return {name: float(v) for name, v in zip(names, f)}


def classification_metrics(predictions: ArrayLike, labels: ArrayLike, *, num_labels: int | None = None,
                           label_names: Sequence[str] | None = None) -> dict[str, float]:
    """accuracy, {f1,precision,recall}_{macro,micro} and f1/<label> for single-label classification."""
    pred, true, classes, names = _class_ids(predictions, labels, num_labels, label_names)
    tp, fp, fn = _confusion_counts(pred, true, len(classes))
    p, r, f = _prf(tp, fp, fn)
    mp, mr, mf = _prf(tp.sum(), fp.sum(), fn.sum())
    out = {"accuracy": float(np.mean(pred == true)),
           "f1_macro": float(f.mean()), "f1_micro": float(mf),
           "precision_macro": float(p.mean()), "precision_micro": float(mp),
           "recall_macro": float(r.mean()), "recall_micro": float(mr)}
    out.update({f"f1/{name}": float(v) for name, v in zip(names, f)})
    return out


def confusion_matrix(predictions: ArrayLike, labels: ArrayLike, *, num_labels: int | None = None,
                     label_names: Sequence[str] | None = None) -> tuple[list[str], np.ndarray]:
    """(class names, (L, L) counts): row = the true class, column = the predicted one (sklearn's layout)."""
    pred, true, classes, names = _class_ids(predictions, labels, num_labels, label_names)
    n = len(classes)
    return names, np.bincount(true * n + pred, minlength=n * n).reshape(n, n)


def _table(names: list[str], tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> dict[str, dict[str, float]]:
    p, r, f = _prf(tp, fp, fn)
    return {name: {"precision": float(p[i]), "recall": float(r[i]), "f1": float(f[i]), "support": int(tp[i] + fn[i])}
            for i, name in enumerate(names)}


def per_class_metrics(predictions: ArrayLike, labels: ArrayLike, *, num_labels: int | None = None,
                      label_names: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    """Single-label {class: {precision, recall, f1, support}} (sklearn's classification_report, zero_division=0)."""
    pred, true, classes, names = _class_ids(predictions, labels, num_labels, label_names)
    return _table(names, *_confusion_counts(pred, true, len(classes)))


# -------------------------------------------------------------------------------- multi-label classification

def _binary(predictions: ArrayLike, labels: ArrayLike, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    pred, true = _array(predictions, "predictions"), _array(labels, "labels")
    if pred.shape != true.shape or pred.ndim != 2:
        raise ValueError(f"predictions and labels must both be (N, L); got shapes {pred.shape} and {true.shape}")
    if np.issubdtype(pred.dtype, np.floating):
        # logits: logit > 0 <=> sigmoid > 0.5. 0/1 floats pass through unchanged at the default threshold 0.
        pred = pred > threshold
    elif not np.isin(pred, (0, 1)).all():
        raise ValueError("integer predictions must be 0/1; pass float logits to threshold them")
    if not np.isin(true, (0, 1)).all():
        raise ValueError("multi-label labels must be 0/1")
    return pred.astype(bool), true.astype(bool)


def _multilabel_counts(pred: np.ndarray, true: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tp = (pred & true).sum(axis=0)
    return tp, (pred & ~true).sum(axis=0), (~pred & true).sum(axis=0)


def multilabel_per_label_f1(predictions: ArrayLike, labels: ArrayLike, *, threshold: float = 0.0,
                            label_names: Sequence[str] | None = None) -> dict[str, float]:
    """Multi-label F1 per column, keyed by label name (or the column index as a string)."""
    pred, true = _binary(predictions, labels, threshold)
    names = _column_names(label_names, pred.shape[1])
    _, _, f = _prf(*_multilabel_counts(pred, true))
    return {name: float(v) for name, v in zip(names, f)}


def multilabel_per_class_metrics(predictions: ArrayLike, labels: ArrayLike, *, threshold: float = 0.0,
                                 label_names: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    """Multi-label {label: {precision, recall, f1, support}}, each column on its own."""
    pred, true = _binary(predictions, labels, threshold)
    return _table(_column_names(label_names, pred.shape[1]), *_multilabel_counts(pred, true))


def _column_names(label_names: Sequence[str] | None, n: int) -> list[str]:
    if label_names is None:
        return [str(i) for i in range(n)]
    if len(label_names) != n:
        raise ValueError(f"label_names has {len(label_names)} names but predictions has {n} columns")
    return list(label_names)


def multilabel_metrics(predictions: ArrayLike, labels: ArrayLike, *, threshold: float = 0.0,
                       label_names: Sequence[str] | None = None) -> dict[str, float]:
    """exact_match (= accuracy), {f1,precision,recall}_{macro,micro} and f1/<label> for multi-label classification.

    `predictions` are (N, L) logits, thresholded as `logit > threshold` (0 = probability 0.5; pass logits,
    not probabilities), or 0/1 ints/bools used as they are. `labels` are (N, L) 0/1."""
    pred, true = _binary(predictions, labels, threshold)
    names = _column_names(label_names, pred.shape[1])
    tp, fp, fn = _multilabel_counts(pred, true)
    p, r, f = _prf(tp, fp, fn)
    mp, mr, mf = _prf(tp.sum(), fp.sum(), fn.sum())
    subset_accuracy = float(np.mean((pred == true).all(axis=1)))
    # "accuracy" too, as sklearn's accuracy_score means on multi-label input, so one default metric fits both
    out = {"exact_match": subset_accuracy, "accuracy": subset_accuracy,
           "f1_macro": float(f.mean()), "f1_micro": float(mf),
           "precision_macro": float(p.mean()), "precision_micro": float(mp),
           "recall_macro": float(r.mean()), "recall_micro": float(mr)}
    out.update({f"f1/{name}": float(v) for name, v in zip(names, f)})
    return out


# ------------------------------------------------------------------------------------------------ regression

def regression_metrics(predictions: ArrayLike, labels: ArrayLike) -> dict[str, float]:
    """mse, mae, r2; (N,), (N, 1) or (N, K) with a uniform average over the K outputs.

    R² follows sklearn's `r2_score` (force_finite=True): a constant target gives 1.0 for a perfect
    prediction and 0.0 otherwise; fewer than two samples give nan."""
    pred = _array(predictions, "predictions").astype(np.float64)
    true = _array(labels, "labels").astype(np.float64)
    # transformers' regression head returns (N, 1) while labels are (N,)
    pred = pred.reshape(len(pred), -1)
    true = true.reshape(len(true), -1)
    _same_length(pred, true)
    if pred.shape != true.shape:
        raise ValueError(f"predictions has {pred.shape[1]} outputs per row but labels has {true.shape[1]}")
    err = pred - true
    out = {"mse": float(np.mean(err ** 2)), "mae": float(np.mean(np.abs(err)))}
    if len(true) < 2:
        out["r2"] = math.nan
        return out
    ss_res = (err ** 2).sum(axis=0)
    ss_tot = ((true - true.mean(axis=0)) ** 2).sum(axis=0)
    r2 = np.where(ss_tot != 0, 1.0 - _safe_div(ss_res, ss_tot), np.where(ss_res == 0, 1.0, 0.0))
    out["r2"] = float(r2.mean())
    return out


def infer_problem_type(predictions: ArrayLike, labels: ArrayLike, num_labels: int | None = None) -> str:
    """transformers' rule: one label -> regression; integer labels -> single-label; else multi-label."""
    pred, true = _array(predictions, "predictions"), _array(labels, "labels")
    if num_labels is None and pred.ndim == 2:
        num_labels = pred.shape[1]
    if num_labels == 1:
        return "regression"
    if np.issubdtype(true.dtype, np.integer):
        return "single_label_classification"
    return "multi_label_classification" if true.ndim == 2 else "regression"


def compute(problem_type: str | None = None, *, predictions: ArrayLike = None, labels: ArrayLike = None,
            num_labels: int | None = None, label_names: Sequence[str] | None = None, threshold: float = 0.0,
            **_: Any) -> dict[str, float]:
    """The metrics of `problem_type`; None is inferred with transformers' rule (`infer_problem_type`)."""
    if problem_type is None:
        problem_type = infer_problem_type(predictions, labels, num_labels)
    if problem_type == "single_label_classification":
        return classification_metrics(predictions, labels, num_labels=num_labels, label_names=label_names)
    if problem_type == "multi_label_classification":
        return multilabel_metrics(predictions, labels, threshold=threshold, label_names=label_names)
    if problem_type == "regression":
        return regression_metrics(predictions, labels)
    raise ValueError(f"unknown problem_type {problem_type!r}; valid: {list(PROBLEM_TYPES)}")
