"""What every metric module shares: input checks and precision/recall/F1 from counts."""

from __future__ import annotations

from typing import Any, Literal

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
