"""fill-mask (masked LM) metrics: token-weighted loss, perplexity, masked-token accuracy."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .base import ArrayLike, _array

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


def compute(problem_type: str | None = None, *, predictions: Any = None, labels: Any = None,
            loss: float | None = None, **_: Any) -> dict[str, float]:
    """`loss` = mean eval loss, or (..., V) logits and labels to compute it from (token-weighted); with
    predictions and labels, also masked-token accuracy."""
    if loss is None:
        if predictions is None or labels is None:
            raise ValueError("fill-mask metrics need loss (the mean eval loss), or logits predictions and labels")
        loss = masked_lm_loss(predictions, labels)
    out = {"loss": float(loss), "perplexity": perplexity(loss)}
    if predictions is not None or labels is not None:
        out["accuracy"] = masked_accuracy(predictions, labels)
    return out
