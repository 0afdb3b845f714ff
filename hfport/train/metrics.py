"""Evaluation metrics for the four tasks, plus metric history and early stopping.

Pure functions over numpy arrays / Python lists (torch CPU tensors work too: they go through `np.asarray`).
No sklearn or seqeval at run time; the tests cross-check against both where they are installed.

Conventions
- Argument order is always `(predictions, labels)` (the order of transformers' `EvalPrediction`), not
  sklearn's `(y_true, y_pred)`.
- Every score is a fraction in [0, 1], SQuAD included (the official script prints 100x).
- Zero division is 0, as sklearn's `zero_division=0`: a label with no true and no predicted items scores
  precision = recall = F1 = 0 and still counts in macro averages.
- Empty inputs raise ValueError naming the argument; inputs of different lengths raise ValueError naming
  both lengths.
- R² follows sklearn's `r2_score`: a constant target scores 1.0 if predicted exactly, else 0.0.

Keys of `compute_metrics` (a flat `dict[str, float]`). The f1/<...> keys are stable across evals only for a
fixed label set: pass num_labels or label_names for classification; entity types are those seen in the data.
- sequence-classification / single_label_classification:
  accuracy, f1_macro, f1_micro, precision_macro, precision_micro, recall_macro, recall_micro, f1/<label>
- sequence-classification / multi_label_classification:
  exact_match and accuracy (both subset accuracy, as sklearn's accuracy_score), f1_macro, f1_micro,
  precision_macro, precision_micro, recall_macro, recall_micro, f1/<label>
- sequence-classification / regression: mse, mae, r2
- token-classification: precision, recall, f1 (entity level, micro), accuracy (token level), f1/<entity type>
- question-answering: exact_match, f1
- masked-lm: loss, perplexity; accuracy (over non-ignored positions) when predictions and labels are given
  (without `loss`, the loss is computed from the logits, every masked token weighing the same)
`<label>` is the label name when names are given, else the label id as a string.
"""

from __future__ import annotations

import collections
import math
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np

Mode = Literal["max", "min"]
ArrayLike = Any  # np.ndarray, torch CPU tensor, nested lists

_MODES = ("max", "min")


# ----------------------------------------------------------------------------------------------- input checks

def _array(x: ArrayLike, name: str) -> np.ndarray:
    if x is None:
        raise ValueError(f"{name} is required")
    a = np.asarray(x)
    if a.size == 0:
        raise ValueError(f"{name} is empty")
    return a


def _same_length(a: Any, b: Any, name_a: str = "predictions", name_b: str = "labels") -> None:
    if len(a) != len(b):
        raise ValueError(f"{name_a} has {len(a)} items but {name_b} has {len(b)}")


def _check_mode(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {list(_MODES)}, got {mode!r}")


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    # zero_division=0: where the denominator is 0 the ratio is defined as 0
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    return np.divide(num, den, out=np.zeros_like(num), where=den != 0)


def _prf(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Precision, recall, F1 from counts, elementwise. F1 = 2tp / (2tp + fp + fn), 0 where that is 0/0."""
    return _safe_div(tp, tp + fp), _safe_div(tp, tp + fn), _safe_div(2 * tp, 2 * tp + fp + fn)


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


# --------------------------------------------------------------------------------------- token classification

class Entity(NamedTuple):
    type: str
    start: int  # token index, inclusive
    end: int  # token index, inclusive


def _split_tag(tag: str) -> tuple[str, str]:
    # seqeval's default (prefix) parsing: "B-PER" -> ("B", "PER"); "O" and bare "B" get the type "_"
    return tag[:1], tag[1:].split("-", maxsplit=1)[-1] or "_"


def _chunk_ends(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    if prev_tag in ("E", "S"):
        return True
    if prev_tag in ("B", "I") and tag in ("B", "S", "O"):
        return True
    return prev_tag not in ("O", ".") and prev_type != type_


def _chunk_starts(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    if tag in ("B", "S"):
        return True
    # an I-/E- with no open chunk to continue opens one: seqeval's default (IOB1-like) leniency
    if prev_tag in ("E", "S", "O") and tag in ("E", "I"):
        return True
    return tag not in ("O", ".") and prev_type != type_


def get_entities(tags: Sequence[str]) -> list[Entity]:
    """Entities of one tag sequence, as seqeval's default mode finds them (IOB2/IOBES, lenient).

    An I- after O, or after a tag of another type, starts a new entity; a B- always does."""
    entities = []
    prev_tag, prev_type, begin = "O", "", 0
    for i, chunk in enumerate([*tags, "O"]):  # the trailing O closes an entity open at the end
        tag, type_ = _split_tag(chunk)
        if _chunk_ends(prev_tag, tag, prev_type, type_):
            entities.append(Entity(prev_type, begin, i - 1))
        if _chunk_starts(prev_tag, tag, prev_type, type_):
            begin = i
        prev_tag, prev_type = tag, type_
    return entities


def _tag_sequences(x: Any, name: str) -> list[list[str]]:
    if x is None:
        raise ValueError(f"{name} is required")
    if isinstance(x, str) or any(isinstance(s, str) for s in x):
        raise ValueError(f"{name} must be a list of tag sequences (list[list[str]]), not a flat list of tags")
    seqs = [list(s) for s in x]
    if not seqs:
        raise ValueError(f"{name} is empty")
    if not all(isinstance(t, str) for s in seqs for t in s):
        raise ValueError(f"{name} must be a list of tag sequences (list[list[str]]); "
                         "for label-id arrays pass id2label (see tags_from_ids)")
    return seqs


def _entity_counts(predictions: Any, labels: Any) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray,
                                                           int, int]:
    """(types, tp, fp, fn per type, correct tokens, total tokens)."""
    pred, true = _tag_sequences(predictions, "predictions"), _tag_sequences(labels, "labels")
    _same_length(pred, true)
    found: dict[str, set] = collections.defaultdict(set)
    gold: dict[str, set] = collections.defaultdict(set)
    correct = total = 0
    for k, (p, t) in enumerate(zip(pred, true)):
        if len(p) != len(t):
            raise ValueError(f"sequence {k}: predictions has {len(p)} tags but labels has {len(t)}")
        correct += sum(a == b for a, b in zip(p, t))
        total += len(t)
        for e in get_entities(p):
            found[e.type].add((k, e.start, e.end))
        for e in get_entities(t):
            gold[e.type].add((k, e.start, e.end))
    types = sorted(set(found) | set(gold))
    tp = np.array([len(found[c] & gold[c]) for c in types], dtype=np.int64)
    fp = np.array([len(found[c]) for c in types], dtype=np.int64) - tp
    fn = np.array([len(gold[c]) for c in types], dtype=np.int64) - tp
    return types, tp, fp, fn, correct, total


def entity_f1_per_type(predictions: Sequence[Sequence[str]], labels: Sequence[Sequence[str]]) -> dict[str, float]:
    """Entity-level F1 per entity type (types seen in either argument)."""
    types, tp, fp, fn, _, _ = _entity_counts(predictions, labels)
    _, _, f = _prf(tp, fp, fn)
    return {c: float(v) for c, v in zip(types, f)}


def token_classification_metrics(predictions: Sequence[Sequence[str]],
                                 labels: Sequence[Sequence[str]]) -> dict[str, float]:
    """precision, recall, f1 (entity level, micro, as seqeval's defaults), accuracy (token level), f1/<type>.

    An entity counts as found only with its exact type and span. No entities anywhere scores 0."""
    types, tp, fp, fn, correct, total = _entity_counts(predictions, labels)
    p, r, f = _prf(tp.sum(), fp.sum(), fn.sum())
    out = {"precision": float(p), "recall": float(r), "f1": float(f),
           "accuracy": correct / total if total else 0.0}
    out.update({f"f1/{c}": float(v) for c, v in zip(types, _prf(tp, fp, fn)[2])})
    return out


def tags_from_ids(predictions: ArrayLike, labels: ArrayLike, id2label: Mapping[int, str] | Sequence[str], *,
                  ignore_index: int = -100) -> tuple[list[list[str]], list[list[str]]]:
    """(predicted tags, true tags) per sequence, dropping positions whose label is `ignore_index`.

    `predictions` are (B, T) ids or (B, T, L) logits (argmaxed); ragged lists of rows work too. `id2label`
    is a config's mapping (int or numeric-string keys) or a list of names."""
    names = _id2label(id2label)
    if predictions is None or len(predictions) == 0:
        raise ValueError("predictions is empty")
    if labels is None or len(labels) == 0:
        raise ValueError("labels is empty")
    _same_length(predictions, labels)
    pred_tags, true_tags = [], []
    for k, (p, t) in enumerate(zip(predictions, labels)):
        p, t = np.asarray(p), np.asarray(t)
        if p.ndim == t.ndim + 1:
            p = p.argmax(axis=-1)
        if len(p) != len(t):
            raise ValueError(f"sequence {k}: predictions has {len(p)} positions but labels has {len(t)}")
        keep = t != ignore_index
        pred_tags.append([_lookup(names, int(i), "predictions") for i in p[keep]])
        true_tags.append([_lookup(names, int(i), "labels") for i in t[keep]])
    return pred_tags, true_tags


def _id2label(id2label: Mapping[int, str] | Sequence[str]) -> dict[int, str]:
    if isinstance(id2label, Mapping):
        try:
            return {int(k): v for k, v in id2label.items()}  # a config read from JSON has string keys
        except (TypeError, ValueError) as e:
            raise ValueError(f"id2label keys must be integer ids, got {list(id2label)}") from e
    return dict(enumerate(id2label))


def _lookup(names: dict[int, str], i: int, name: str) -> str:
    try:
        return names[i]
    except KeyError:
        raise ValueError(f"{name} holds id {i}, which id2label does not name (ids: {sorted(names)})") from None


# ------------------------------------------------------------------------------------------------ SQuAD (QA)

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


# ------------------------------------------------------------------------------------------------- masked LM

_MAX_EXP_ARG = math.log(np.finfo(np.float64).max)  # ~709.78: beyond it exp() overflows


def perplexity(mean_loss: float) -> float:
    """exp(mean token cross-entropy); inf where that overflows a float64, nan for a nan loss."""
    mean_loss = float(mean_loss)
    if math.isnan(mean_loss):
        return math.nan
    if mean_loss < 0:
        raise ValueError(f"mean_loss must be a cross-entropy (>= 0), got {mean_loss}")
    return math.exp(mean_loss) if mean_loss < _MAX_EXP_ARG else math.inf


def masked_accuracy(predictions: ArrayLike, labels: ArrayLike, *, ignore_index: int = -100) -> float:
    """Token accuracy over positions whose label is not `ignore_index`; logits (..., V) are argmaxed."""
    pred, true = _array(predictions, "predictions"), _array(labels, "labels")
    if pred.ndim == true.ndim + 1:
        pred = pred.argmax(axis=-1)
    if pred.shape != true.shape:
        raise ValueError(f"predictions has shape {pred.shape} but labels has shape {true.shape}")
    keep = true != ignore_index
    if not keep.any():
        raise ValueError(f"labels has no position other than ignore_index={ignore_index}")
    return float(np.mean(pred[keep] == true[keep]))


def masked_lm_loss(logits: ArrayLike, labels: ArrayLike, *, ignore_index: int = -100,
                   chunk_rows: int = 4096) -> float:
    """Mean cross-entropy over the positions whose label is not `ignore_index`, from (..., V) logits.

    Every masked token weighs the same, unlike a mean of per-batch losses. Computed in float64, a chunk of
    rows at a time, so a large vocabulary does not double the memory of the logits."""
    x, true = _array(logits, "logits"), _array(labels, "labels")
    if x.ndim != true.ndim + 1 or x.shape[:-1] != true.shape:
        raise ValueError(f"logits must be labels' shape plus a vocabulary axis; got {x.shape} and {true.shape}")
    keep = true != ignore_index
    if not keep.any():
        raise ValueError(f"labels has no position other than ignore_index={ignore_index}")
    rows, targets = x[keep], true[keep].astype(np.int64)  # (M, V), (M,)
    bad = targets[(targets < 0) | (targets >= x.shape[-1])]
    if bad.size:
        raise ValueError(f"labels holds id {int(bad[0])}, outside the vocabulary of {x.shape[-1]}")
    total = 0.0
    for start in range(0, len(rows), chunk_rows):
        z = rows[start:start + chunk_rows].astype(np.float64)  # (m, V)
        top = z.max(axis=1, keepdims=True)  # subtracted so exp cannot overflow
        log_norm = top[:, 0] + np.log(np.exp(z - top).sum(axis=1))
        total += float((log_norm - z[np.arange(len(z)), targets[start:start + chunk_rows]]).sum())
    return total / len(rows)


# ------------------------------------------------------------------------------------------------ dispatcher

def _holds_strings(sequences: Any) -> bool:
    """Are these tag-string sequences (rather than id arrays)? Judged by the first tag."""
    for seq in sequences if sequences is not None else ():
        for tag in seq:
            return isinstance(tag, str)
    return False

TASKS = ("sequence-classification", "token-classification", "question-answering", "masked-lm")
PROBLEM_TYPES = ("single_label_classification", "multi_label_classification", "regression")


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


def compute_metrics(task: str, problem_type: str | None = None, *, predictions: Any = None, labels: Any = None,
                    num_labels: int | None = None, label_names: Sequence[str] | None = None,
                    id2label: Mapping[int, str] | Sequence[str] | None = None, threshold: float = 0.0,
                    loss: float | None = None) -> dict[str, float]:
    """The task's metrics as a flat dict; keys are listed in the module docstring.

    - sequence-classification: predictions = logits (or ids / 0-1 matrix / values), labels as the loss takes
      them; `problem_type` None is inferred with transformers' rule (`infer_problem_type`).
    - token-classification: tag-string sequences, or id arrays / logits with -100 ignored plus `id2label`
      (or `label_names`, the names in id order).
    - question-answering: predictions = answer strings, labels = gold answer lists (empty = no answer).
    - masked-lm: `loss` = mean eval loss, or (..., V) logits and labels to compute it from (token-weighted);
      with predictions and labels, also masked-token accuracy.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid tasks: {list(TASKS)}")
    if task == "sequence-classification":
        if problem_type is None:
            problem_type = infer_problem_type(predictions, labels, num_labels)
        if problem_type == "single_label_classification":
            return classification_metrics(predictions, labels, num_labels=num_labels, label_names=label_names)
        if problem_type == "multi_label_classification":
            return multilabel_metrics(predictions, labels, threshold=threshold, label_names=label_names)
        if problem_type == "regression":
            return regression_metrics(predictions, labels)
        raise ValueError(f"unknown problem_type {problem_type!r}; valid: {list(PROBLEM_TYPES)}")
    if task == "token-classification":
        names = id2label if id2label is not None else label_names
        if names is not None and not _holds_strings(labels):
            predictions, labels = tags_from_ids(predictions, labels, names)
        return token_classification_metrics(predictions, labels)
    if task == "question-answering":
        return squad_metrics(predictions, labels)
    # masked-lm
    if loss is None:
        if predictions is None or labels is None:
            raise ValueError("masked-lm metrics need loss (the mean eval loss), or logits predictions and labels")
        loss = masked_lm_loss(predictions, labels)
    out = {"loss": float(loss), "perplexity": perplexity(loss)}
    if predictions is not None or labels is not None:
        out["accuracy"] = masked_accuracy(predictions, labels)
    return out


# ------------------------------------------------------------------------------ history and early stopping

def _improves(value: float, best: float | None, mode: str, threshold: float, threshold_mode: str) -> bool:
    """Is `value` better than `best` by more than the threshold? nan never improves."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    # rel uses |best| so that a negative best (e.g. R² < 0) still needs a move in the right direction
    margin = threshold * abs(best) if threshold_mode == "rel" else threshold
    return value > best + margin if mode == "max" else value < best - margin


class Point(NamedTuple):
    step: int
    value: float


class MetricHistory:
    """One metric's value at each evaluation, in step order."""

    def __init__(self, points: Sequence[tuple[int, float]] = ()):
        self.points: list[Point] = []
        for step, value in points:
            self.append(step, value)

    def __len__(self) -> int:
        return len(self.points)

    def append(self, step: int, value: float) -> None:
        # strictly increasing steps: a repeated step means an eval logged twice, and breaks slope()
        if self.points and step <= self.points[-1].step:
            raise ValueError(f"step {step} is not after the last recorded step {self.points[-1].step}")
        self.points.append(Point(int(step), float(value)))

    @property
    def steps(self) -> list[int]:
        return [p.step for p in self.points]

    @property
    def values(self) -> list[float]:
        return [p.value for p in self.points]

    def best(self, mode: Mode = "max") -> Point | None:
        """The best (step, value); the earliest on ties; None while empty or all nan."""
        _check_mode(mode)
        best = None
        for p in self.points:
            if _improves(p.value, None if best is None else best.value, mode, 0.0, "abs"):
                best = p
        return best

    def slope(self, last_n: int) -> float:
        """Least-squares slope of value against step over the last `last_n` evals (all, if fewer)."""
        if last_n < 2:
            raise ValueError(f"last_n must be at least 2, got {last_n}")
        if len(self.points) < 2:
            raise ValueError(f"slope needs at least 2 evals, the history has {len(self.points)}")
        pts = self.points[-last_n:]
        x = np.array([p.step for p in pts], dtype=np.float64)
        y = np.array([p.value for p in pts], dtype=np.float64)
        x -= x.mean()
        return float((x * (y - y.mean())).sum() / (x * x).sum())

    def stalled(self, patience: int, threshold: float = 0.0, mode: Mode = "max") -> bool:
        """True when none of the last `patience` evals beat the best before them by more than `threshold`.

        False until there are more than `patience` evals (nothing to compare against yet)."""
        _check_mode(mode)
        if patience < 1:
            raise ValueError(f"patience must be at least 1, got {patience}")
        if len(self.points) <= patience:
            return False
        before = MetricHistory(self.points[:-patience]).best(mode)
        recent = MetricHistory(self.points[-patience:]).best(mode)
        if before is None:
            return recent is None
        return recent is None or not _improves(recent.value, before.value, mode, threshold, "abs")

    def converged(self, window: int, tolerance: float) -> bool:
        """True when the last `window` values all lie within `tolerance` of each other (max - min)."""
        if window < 2:
            raise ValueError(f"window must be at least 2, got {window}")
        if len(self.points) < window:
            return False
        recent = [p.value for p in self.points[-window:]]
        if any(math.isnan(v) for v in recent):  # a nan run has not converged (and max/min ignore nan by order)
            return False
        return max(recent) - min(recent) <= tolerance

    def state_dict(self) -> dict[str, Any]:
        return {"points": [[p.step, p.value] for p in self.points]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.points = []
        for step, value in state["points"]:
            self.append(step, value)


class EarlyStopping:
    """Stops after `patience` consecutive evaluations without improvement of `metric`.

    An improvement is `value > best + threshold` (mode "max"; mirrored for "min"), or with threshold_mode
    "rel" `value > best + threshold * |best|`. The first value always improves; nan never does."""

    def __init__(self, metric: str, mode: Mode = "max", patience: int = 3, threshold: float = 0.0,
                 threshold_mode: Literal["abs", "rel"] = "abs"):
        _check_mode(mode)
        if patience < 1:
            raise ValueError(f"patience must be at least 1, got {patience}")
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        if threshold_mode not in ("abs", "rel"):
            raise ValueError(f"threshold_mode must be 'abs' or 'rel', got {threshold_mode!r}")
        self.metric, self.mode, self.patience = metric, mode, patience
        self.threshold, self.threshold_mode = threshold, threshold_mode
        self.best: float | None = None
        self.best_step: int | None = None
        self.num_bad_evals = 0
        self.num_evals = 0

    def update(self, value: float, step: int | None = None) -> bool:
        """Record one evaluation's value; True if it is the new best."""
        value = float(value)
        self.num_evals += 1
        if _improves(value, self.best, self.mode, self.threshold, self.threshold_mode):
            self.best, self.best_step, self.num_bad_evals = value, step, 0
            return True
        self.num_bad_evals += 1
        return False

    def update_from(self, metrics: Mapping[str, float], step: int | None = None) -> bool:
        """`update` with this stopper's metric taken from an eval's metrics dict."""
        if self.metric not in metrics:
            raise KeyError(f"metric {self.metric!r} is not among the eval metrics {sorted(metrics)}")
        return self.update(metrics[self.metric], step)

    @property
    def should_stop(self) -> bool:
        return self.num_bad_evals >= self.patience

    def state_dict(self) -> dict[str, Any]:
        """Everything, JSON-serialisable."""
        return {"metric": self.metric, "mode": self.mode, "patience": self.patience,
                "threshold": self.threshold, "threshold_mode": self.threshold_mode,
                "best": self.best, "best_step": self.best_step,
                "num_bad_evals": self.num_bad_evals, "num_evals": self.num_evals}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the progress of a saved run.

        metric and mode must match (a best value of another metric or direction means nothing); patience and
        threshold stay as constructed, so a resumed run may change them."""
        for key in ("metric", "mode"):
            if state[key] != getattr(self, key):
                raise ValueError(f"saved early stopping tracks {key} {state[key]!r}, this one {getattr(self, key)!r}")
        self.best = None if state["best"] is None else float(state["best"])
        self.best_step = state["best_step"]
        self.num_bad_evals = int(state["num_bad_evals"])
        self.num_evals = int(state["num_evals"])
