"""What every verify returns and how it compares: the report (one row a check), the fail-closed row guard, the
tolerances by dtype, and the one output comparison every format's verify calls.

Tolerances (|candidate - reference| <= atol + rtol * |reference|, element-wise), with the max abs diffs measured on
the real all-MiniLM-L6-v2 (6 layers, hidden 384) and on the tiny test models:
    float32    atol 1e-5, rtol 1e-4: the same weights; only the two implementations' summation order differs
               (MiniLM 2.6e-6; tiny models <= 1e-6).
    float16    atol 1e-2, rtol 1e-2: each weight is rounded to 11 significant bits (unit roundoff 2^-11 ~ 4.9e-4);
               the rounding errors of hundreds of products per output add up layer by layer (MiniLM 3.1e-3).
    bfloat16   atol 5e-2, rtol 5e-2: 8 significant bits (unit roundoff 2^-8 ~ 3.9e-3), eight times coarser
               (MiniLM 2.8e-2 on last_hidden_state). Deeper models drift further: pass looser values if needed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import hub
from ..errors import ExportError

# (atol, rtol) by the dtype DIR's weights are stored in; the module docstring says why
TOLERANCES: dict[str, tuple[float, float]] = {"float32": (1e-5, 1e-4), "float16": (1e-2, 1e-2),
                                              "bfloat16": (5e-2, 5e-2)}


@dataclass
class Row:
    check: str  # format | config | source | load | labels | weights | tokenizer | outputs | ...
    output: str
    shape: str = ""
    max_abs_diff: float | None = None
    tolerance: str = ""
    passed: bool = False
    detail: str = ""


@dataclass
class VerifyReport:
    dir: str
    source: str
    dtype: str | None = None
    atol: float | None = None
    rtol: float | None = None
    rows: list[Row] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.passed]

    @property
    def tolerance(self) -> str:
        return f"atol={self.atol:g} rtol={self.rtol:g}"

    def set_tolerances(self, dtype: str, atol: float | None, rtol: float | None,
                       defaults: tuple[float, float] | None = None) -> None:
        """DIR's dtype, and atol/rtol as given or by that dtype (TOLERANCES) or DEFAULTS."""
        default_atol, default_rtol = defaults or TOLERANCES[dtype]
        self.dtype = dtype
        self.atol = default_atol if atol is None else atol
        self.rtol = default_rtol if rtol is None else rtol

    def add(self, check: str, output: str, passed: bool, *, shape: Any = "", diff: float | None = None,
            tolerance: str = "", detail: str = "") -> Row:
        shape = "x".join(map(str, shape)) if isinstance(shape, (tuple, list, torch.Size)) else str(shape)
        row = Row(check, output, shape, diff, tolerance, bool(passed), detail)
        self.rows.append(row)
        return row

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for r in self.rows:
            d = asdict(r)
            if d["max_abs_diff"] is not None and not math.isfinite(d["max_abs_diff"]):
                d["max_abs_diff"] = str(d["max_abs_diff"])  # JSON has no NaN/inf
            rows.append(d)
        return {"dir": self.dir, "source": self.source, "dtype": self.dtype, "atol": self.atol, "rtol": self.rtol,
                "passed": self.passed, "failures": len(self.failures), "rows": rows}

    def write_json(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        hub.write_json_atomic(path, self.to_dict())

    def table(self) -> str:
        header = ("check", "output", "shape", "max abs diff", "tolerance", "result")
        body = [(r.check, r.output, r.shape, "" if r.max_abs_diff is None else f"{r.max_abs_diff:.3g}",
                 r.tolerance, "PASS" if r.passed else "FAIL") for r in self.rows]
        widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
        lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in (header, *body)]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for r in self.failures:
            if r.detail:
                lines.append(f"FAIL {r.check} {r.output}: {r.detail}")
        n, bad = len(self.rows), len(self.failures)
        verdict = (f"PASS: {n} checks, {self.dir} matches {self.source}" if self.passed else
                   f"FAIL: {bad} of {n} checks failed" if n else "FAIL: no check ran")
        return "\n".join([*lines, verdict])


class VerifyFailed(ExportError):
    """`export(verify=True)` found the export does not match its source; DIR was not written."""

    def __init__(self, message: str, report: VerifyReport):
        super().__init__(message)
        self.report = report


@contextmanager
def check_row(report: VerifyReport, check: str, output: str) -> Iterator[None]:
    """A check that raises is a failed row naming the exception: verify fails closed."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every failure must become a FAIL row, never a pass
        report.add(check, output, False, detail=f"{type(e).__name__}: {e}")


@contextmanager
def reporting(report: VerifyReport, json_path: str | os.PathLike[str] | None) -> Iterator[VerifyReport]:
    """The body of a verify: anything no single check caught is a failed "verify run" row, and the report is
    written to json_path (when given) however the body ended."""
    try:
        with check_row(report, "verify", "run"):
            yield report
    finally:
        if json_path is not None:
            report.write_json(json_path)


def compare(report: VerifyReport, check: str, output: str, got: Any, ref: Any, *, real: Tensor | None = None,
            atol: float | None = None, rtol: float | None = None, what: str = "the output") -> Row:
    """The one output comparison: GOT (the export's) against REF (the reference), element-wise
    |got - ref| <= atol + rtol * |ref| (default: the report's tolerances), at REAL positions only when a mask of the
    leading axes is given (per-token outputs: what a model puts at padding is not part of its contract). Adds and
    returns one row with the max abs diff; a NaN/inf, a shape mismatch or a missing output fails it."""
    atol = report.atol if atol is None else atol
    rtol = report.rtol if rtol is None else rtol
    tolerance = f"atol={atol:g} rtol={rtol:g}"
    if got is None or ref is None:
        return report.add(check, output, False, tolerance=tolerance,
                          detail=f"only {'the reference' if got is None else 'the export'} returns {output}")
    a, b = torch.as_tensor(got), torch.as_tensor(ref)
    shape = tuple(a.shape)
    if shape != tuple(b.shape):
        return report.add(check, output, False, shape=shape, tolerance=tolerance,
                          detail=f"shape {list(a.shape)} vs the reference's {list(b.shape)}")
    a, b = a.double(), b.double()
    if real is not None:  # (B, T, ...) -> (N, ...)
        real = real.bool()
        a, b = a[real], b[real]
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    rel = ((a - b).abs() / b.abs().clamp(min=1e-12)).max().item() if a.numel() else 0.0
    ok = math.isfinite(diff) and bool(torch.isclose(a, b, atol=atol, rtol=rtol).all())
    where = " at real positions" if real is not None else ""
    return report.add(check, output, ok, shape=shape, diff=diff, tolerance=tolerance,
                      detail="" if ok else f"{what} differs from the reference (max abs diff {diff:.3g}, max rel "
                                           f"diff {rel:.3g}{where})")
