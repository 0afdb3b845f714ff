"""What an evaluation returns: one model's figures (EvalResult) and one or two models side by side (Evaluation),
as JSON (`hfport evaluate --json`) and as report.html (report.py)."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import hub


@dataclass
class EvalResult:
    """One model's figures on the data: `metrics` (flat, the names fine-tuning's evaluation and sentence-transformers
    use) and `details` for the charts and tables: per_class ({label: {precision, recall, f1, support}}), confusion
    ({"labels", "matrix": rows = true, columns = predicted}), curves ({"recall": {k: value}, ...})."""

    model: str
    task: str
    examples: int  # what the metrics average over: rows, sentences, questions or queries
    metrics: dict[str, float]
    details: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)  # dtype, problem type, corpus size, similarity function...

    def to_dict(self) -> dict[str, Any]:
        return _finite(asdict(self))


@dataclass
class Evaluation:
    """The result of `evaluate`: one model, or two with `--compare` (the first is MODEL, the second the other: the
    baseline MODEL is compared with, its difference MODEL's figure minus the other's)."""

    task: str
    data: str
    results: list[EvalResult]
    corpus: str | None = None

    @property
    def metrics(self) -> dict[str, float]:
        """The first model's metrics."""
        return self.results[0].metrics

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "data": self.data, "corpus": self.corpus,
                "results": [r.to_dict() for r in self.results]}

    def write_json(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        hub.write_json_atomic(path, self.to_dict())  # whole or not at all, under a temporary name of its own
        return path

    def difference(self, name: str) -> float | None:
        """With --compare: MODEL's figure minus the other's (a fine-tune compared with its base: the gain); None when
        either lacks it or there is one model."""
        if len(self.results) != 2:
            return None
        mine, other = (r.metrics.get(name) for r in self.results)
        return None if mine is None or other is None else mine - other

    def table(self) -> str:
        """The metrics as a text table, a column per model (and, with --compare, MODEL's difference from the other)."""
        names = list(dict.fromkeys(k for r in self.results for k in r.metrics))
        heads = ["metric", *short_names([r.model for r in self.results])]
        if len(self.results) == 2:
            heads.append("difference")
        rows = []
        for name in names:
            values = [r.metrics.get(name) for r in self.results]
            row = [name, *(_fmt(v) for v in values)]
            if len(values) == 2:
                row.append(_fmt(self.difference(name), signed=True))
            rows.append(row)
        widths = [max(len(str(x)) for x in col) for col in zip(heads, *rows)]
        return "\n".join("  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in
                                   enumerate(zip(line, widths))) for line in [heads, *rows])


def short_names(models: list[str]) -> list[str]:
    """Each model's shortest distinct name: its folder's name and its parent's (a run's "best" alone, or a package's
    "model", says nothing; a repo id is both), with as many more parent folders as tell them apart."""
    parts = [Path(m).parts or (m,) for m in models]
    for n in range(2, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-n:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(m) for m in models]


def _fmt(value: float | None, signed: bool = False) -> str:
    if value is None:
        return ""
    return f"{value:+.4f}" if signed else f"{value:.4f}"


def _finite(value: Any) -> Any:
    """JSON has no NaN: a metric without a value (R² of one example) becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
