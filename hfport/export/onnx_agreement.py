"""The int8 gate: how far model_quantized.onnx may move the fp32 graph's answers, judged at the task level.

Each task record names its kind (`Task.agreement`); each kind is a measure (int8 outputs, fp32 outputs, the probe
batch, the config) -> (value, items counted, fp32 near ties left out) and the threshold it is held to:
    labels   the predicted label per text (argmax, or each label's logit > 0 where labels are independent)
    tags     the predicted tag per real token
    spans    identical argmax start and end (question answering)
    top_k    top-5 overlap at masked positions (fill-mask)
    cosine   cosine of the mean-pooled embeddings, the mean over the probe texts (feature extraction)
Label and tag agreement count only the items fp32 decides (NEAR_TIE says why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..heads import pool
from .common import ExportError

MIN_AGREEMENT = 0.99
MIN_COSINE = 0.99
# label and tag agreement count only the items on which fp32 decides: its two most probable labels at least this far
# apart in probability. On a near tie there is no answer to keep: int8's rounding (mean relative logit error ~0.03 on
# MiniLM) moves it either way, so one out-of-domain probe text a classifier scores 0.35 / 0.32 failed whole exports
# (a seed-7 MiniLM topic head: "She plays the violin beautifully."). A broken graph flips decided items and fails.
NEAR_TIE = 0.05
TOP_K = 5  # fill-mask: the candidates a user sees

Measure = Callable[[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor], Any], tuple[float, int, int]]


def fp32_decides(b: Tensor) -> Tensor:
    """Where fp32 (logits b, (..., L)) makes a decision: its two most probable labels at least NEAR_TIE apart in
    softmax probability. (..., L) -> (...,) bool."""
    top = b.softmax(-1).topk(2, dim=-1).values  # (..., 2)
    return top[..., 0] - top[..., 1] >= NEAR_TIE


def agreement(same: Tensor, decisive: Tensor) -> tuple[float, int, int]:
    """(agreement over the decisive items, their number, the near ties left out). When fp32 decides none, all count:
    a graph is never passed for want of items."""
    if not decisive.any():
        decisive = torch.ones_like(decisive)
    return same[decisive].float().mean().item(), int(decisive.sum()), int((~decisive).sum())


def labels(q: dict[str, Tensor], f: dict[str, Tensor], enc: dict[str, Tensor], config: Any) -> tuple[float, int, int]:
    """The predicted label per text: argmax, or each label's logit > 0 where labels are independent (multi-label,
    one output); texts on which fp32 is a near tie are left out (NEAR_TIE says why)."""
    a, b = q["logits"], f["logits"]  # (B, L)
    if config.problem_type == "multi_label_classification" or config.num_labels == 1:
        decisive = (torch.sigmoid(b) - 0.5).abs() >= NEAR_TIE / 2  # (B, L) per label
        same = (((a > 0) == (b > 0)) | ~decisive).all(dim=1)  # the decided labels all agree
        return agreement(same, decisive.any(dim=1))
    return agreement(a.argmax(-1) == b.argmax(-1), fp32_decides(b))


def tags(q: dict[str, Tensor], f: dict[str, Tensor], enc: dict[str, Tensor], config: Any) -> tuple[float, int, int]:
    real = enc["attention_mask"].bool()  # (B, T)
    a, b = q["logits"][real], f["logits"][real]  # (N, L)
    return agreement(a.argmax(-1) == b.argmax(-1), fp32_decides(b))


def spans(q: dict[str, Tensor], f: dict[str, Tensor], enc: dict[str, Tensor], config: Any) -> tuple[float, int, int]:
    real = enc["attention_mask"].bool()  # (B, T)

    def best(x: Tensor) -> Tensor:
        return x.masked_fill(~real, float("-inf")).argmax(-1)  # (B,)

    same = (best(q["start_logits"]) == best(f["start_logits"])) & (best(q["end_logits"]) == best(f["end_logits"]))
    return same.float().mean().item(), len(same), 0


def top_k(q: dict[str, Tensor], f: dict[str, Tensor], enc: dict[str, Tensor], config: Any) -> tuple[float, int, int]:
    masked = enc["masked"]  # (B, T)
    k = min(TOP_K, q["logits"].shape[-1])
    a, b = q["logits"][masked].topk(k).indices, f["logits"][masked].topk(k).indices  # (M, k)
    overlap = [len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(a, b)]
    return sum(overlap) / len(overlap), len(overlap), 0


def cosine(q: dict[str, Tensor], f: dict[str, Tensor], enc: dict[str, Tensor], config: Any) -> tuple[float, int, int]:
    mask = enc["attention_mask"]  # (B, T)
    a = pool(q["last_hidden_state"], mask, "mean")  # (B, C): sentence-transformers' mean pooling
    b = pool(f["last_hidden_state"], mask, "mean")  # (B, C)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)  # (B,)
    return cos.mean().item(), len(cos), 0  # the mean, as agreement is a mean


# the task record's agreement kind -> (measure, which threshold applies, its name in the report)
AGREEMENT: dict[str, tuple[Measure, str, str]] = {
    "labels": (labels, "agreement", "label agreement"),
    "tags": (tags, "agreement", "tag agreement"),
    "spans": (spans, "agreement", "span agreement"),
    "top_k": (top_k, "agreement", f"top-{TOP_K} overlap"),
    "cosine": (cosine, "cosine", "mean cosine"),
}


def check_thresholds(min_agreement: float, min_cosine: float) -> None:
    """Both thresholds are fractions in (0, 1]; an ExportError names a bad one."""
    for name, value in (("min_agreement", min_agreement), ("min_cosine", min_cosine)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
            raise ExportError(f"{name} {value!r}: expected a fraction in (0, 1], e.g. 0.99")
