"""A metric's history across evaluations, and early stopping on it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np

from .base import Mode, _check_mode

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
