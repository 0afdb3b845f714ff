"""token-classification metrics: entity-level precision/recall/F1 as seqeval computes them, token accuracy."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .base import ArrayLike, _prf, _same_length

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


def _holds_strings(sequences: Any) -> bool:
    """Are these tag-string sequences (rather than id arrays)? Judged by the first tag."""
    for seq in sequences if sequences is not None else ():
        for tag in seq:
            return isinstance(tag, str)
    return False


def compute(problem_type: str | None = None, *, predictions: Any = None, labels: Any = None,
            label_names: Sequence[str] | None = None, id2label: Mapping[int, str] | Sequence[str] | None = None,
            **_: Any) -> dict[str, float]:
    """Tag-string sequences, or id arrays / logits with -100 ignored plus `id2label` (or `label_names`)."""
    names = id2label if id2label is not None else label_names
    if names is not None and not _holds_strings(labels):
        predictions, labels = tags_from_ids(predictions, labels, names)
    return token_classification_metrics(predictions, labels)
