"""report.html of an evaluation: one self-contained page (no script, no network), the charts drawn here as inline SVG
in the palette and panel size of the fine-tune report's charts (hfport/train/static/charts.js).

    the headline metrics         bars, a colour per model (MODEL, and --compare's model)
    the confusion matrix         one heat map per model: rows the true label, columns the predicted one (counts)
    per-class F1                 bars per label (classification), per entity type (token classification)
    recall@k and accuracy@k      curves over k = 1 ... 100 (sentence-embedding, text-ranking)
and the tables: every metric side by side (with the difference), each model's per-class table.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from .. import hub
from .result import Evaluation, EvalResult, short_names

COLORS = ("#1f6feb", "#d1242f", "#1a7f37", "#8250df", "#bc4c00", "#0a7a8a")  # charts.js's first colours
W, H, L, R, T, B = 440, 230, 56, 12, 26, 60  # panel size and plot margins (room below for rotated labels)
HEADLINE = ("accuracy", "f1_macro", "f1_micro", "exact_match", "f1", "precision", "recall", "mse", "mae", "r2",
            "ndcg@10", "mrr@10", "map@100", "perplexity", "spearman", "pearson")


def _e(text: Any) -> str:
    return html.escape(str(text))




def _svg(title: str, body: str, width: int = W, height: int = H) -> str:
    return (f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="{_e(title)}"><title>{_e(title)}</title>'
            f'<text x="{L}" y="16" class="t">{_e(title)}</text>{body}</svg>')


def _legend(models: list[str], right: float) -> str:
    """The models' colours in the title row, right-aligned at RIGHT (above the plot, never over it)."""
    out, x = [], right
    for i, m in reversed(list(enumerate(models))):
        name = m[:20]
        x -= 18 + 6.5 * len(name)
        out.append(f'<rect x="{x:.0f}" y="7" width="10" height="10" fill="{COLORS[i % len(COLORS)]}"/>'
                   f'<text x="{x + 14:.0f}" y="16" class="s">{_e(name)}</text>')
    return "".join(out)


def _range(values: list[float]) -> tuple[float, float]:
    """The value axis: [0, 1] for fractions (most metrics), else from 0 (or the lowest value) to the highest."""
    low, high = min(0.0, *values), max(0.0, *values)
    if low >= 0 and high <= 1:
        return 0.0, 1.0
    return low, high if high > low else low + 1


def _axis(top: float, bottom: float, low: float, high: float, width: int) -> str:
    """A left value axis with 5 ticks and light grid lines."""
    out = []
    for i in range(5):
        value = low + (high - low) * i / 4
        y = bottom - (bottom - top) * i / 4
        out.append(f'<line x1="{L}" x2="{width - R}" y1="{y:.1f}" y2="{y:.1f}" class="g"/>'
                   f'<text x="{L - 4}" y="{y + 4:.1f}" class="s" text-anchor="end">{value:.3g}</text>')
    return "".join(out)


def bar_chart(title: str, groups: list[str], series: list[tuple[str, list[float | None]]]) -> str:
    """Grouped bars: a group per name in GROUPS, a bar per (model, values) in SERIES."""
    if not groups:
        return ""
    longest = 6.2 * max(len(g[:24]) for g in groups)  # the longest label's length in pixels, before rotating
    width = max(W, L + R + len(groups) * (14 * len(series) + 10)) + int(0.82 * longest)  # room for its slant
    values = [v for _, vs in series for v in vs if v is not None]
    low, high = _range(values or [0.0])
    top, bottom = T + 4, H - B
    height = bottom + 16 + int(0.58 * longest)
    scale = (bottom - top) / (high - low)
    slot = (width - L - R - int(0.82 * longest)) / len(groups)
    bar = min(18.0, (slot - 6) / len(series))
    out = [_axis(top, bottom, low, high, width - int(0.82 * longest))]
    for g, name in enumerate(groups):
        x0 = L + g * slot + (slot - bar * len(series)) / 2
        for s, (model, vs) in enumerate(series):
            v = vs[g]
            if v is None:
                continue
            y, y_zero = bottom - (v - low) * scale, bottom - (0 - low) * scale
            out.append(f'<rect x="{x0 + s * bar:.1f}" y="{min(y, y_zero):.1f}" width="{bar - 1:.1f}" '
                       f'height="{abs(y_zero - y):.1f}" fill="{COLORS[s % len(COLORS)]}">'
                       f'<title>{_e(model)} {_e(name)}: {v:.4f}</title></rect>')
        cx = L + g * slot + slot / 2
        out.append(f'<text transform="translate({cx:.1f},{bottom + 10}) rotate(35)" class="s">{_e(name[:24])}</text>')
    if len(series) > 1:
        out.append(_legend([m for m, _ in series], width - R))
    return _svg(title, "".join(out), width, height)


def line_chart(title: str, xs: list[int], series: list[tuple[str, list[float]]]) -> str:
    """Curves over XS (evenly spaced: k = 1, 2, 3, 5, 10, ... reads better than a linear axis), y in [0, 1]."""
    top, bottom = T + 4, H - B + 26
    step = (W - L - R - 20) / max(1, len(xs) - 1)
    out = [_axis(top, bottom, 0.0, 1.0, W)]
    for i, k in enumerate(xs):
        out.append(f'<text x="{L + 10 + i * step:.1f}" y="{bottom + 14}" class="s" text-anchor="middle">{k}</text>')
    out.append(f'<text x="{W - R}" y="{bottom + 28}" class="s" text-anchor="end">k</text>')
    for s, (model, ys) in enumerate(series):
        points = [(L + 10 + i * step, bottom - (bottom - top) * y) for i, y in enumerate(ys)]
        color = COLORS[s % len(COLORS)]
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                   + " ".join(f"{x:.1f},{y:.1f}" for x, y in points) + '"/>')
        out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"><title>{_e(model)} @{k}: '
                f'{v:.4f}</title></circle>' for (x, y), k, v in zip(points, xs, ys)]
    out.append(_legend([m for m, _ in series], W - R))
    return _svg(title, "".join(out))


def heat_map(title: str, labels: list[str], matrix: list[list[int]]) -> str:
    """The confusion matrix: rows the true label, columns the predicted one; darker is more."""
    n = len(labels)
    cell = max(14, min(40, 320 // max(1, n)))
    left, top = 110, 40
    width, height = max(left + n * cell + 20, L + 8 * len(title)), top + n * cell + 70
    peak = max((v for row in matrix for v in row), default=0) or 1
    out = [f'<text x="{left + n * cell / 2:.0f}" y="{top - 8}" class="s" text-anchor="middle">predicted</text>',
           f'<text transform="translate(14,{top + n * cell / 2:.0f}) rotate(-90)" class="s" '
           f'text-anchor="middle">true</text>']
    for i, row in enumerate(matrix):
        out.append(f'<text x="{left - 4}" y="{top + i * cell + cell / 2 + 4:.1f}" class="s" '
                   f'text-anchor="end">{_e(labels[i][:16])}</text>')
        for j, v in enumerate(row):
            shade = v / peak
            fill = f"rgba(31,111,235,{0.08 + 0.92 * shade:.3f})" if v else "#f6f8fa"
            out.append(f'<rect x="{left + j * cell}" y="{top + i * cell}" width="{cell - 1}" height="{cell - 1}" '
                       f'fill="{fill}"><title>true {_e(labels[i])}, predicted {_e(labels[j])}: {v}</title></rect>')
            if cell >= 22:
                color = "#fff" if shade > 0.55 else "#111"
                out.append(f'<text x="{left + j * cell + cell / 2:.1f}" y="{top + i * cell + cell / 2 + 4:.1f}" '
                           f'class="s" text-anchor="middle" style="fill:{color}">{v}</text>')
    for j, name in enumerate(labels):
        x = left + j * cell + cell / 2
        out.append(f'<text transform="translate({x:.1f},{top + n * cell + 10}) rotate(35)" class="s">'
                   f'{_e(name[:16])}</text>')
    return _svg(title, "".join(out), width, height)


def _headline(results: list[EvalResult]) -> list[str]:
    names = list(dict.fromkeys(k for r in results for k in r.metrics))
    picked = [n for n in names if n.split("_", 1)[-1] in HEADLINE or n in HEADLINE]
    return picked or [n for n in names if "/" not in n and n != "loss"][:8]


def charts(evaluation: Evaluation, labels: list[str]) -> list[str]:
    """The page's charts; LABELS: the models' names on it."""
    results = evaluation.results
    out = []
    names = _headline(results)
    out.append(bar_chart("metrics", names, [(lab, [r.metrics.get(n) for n in names])
                                            for lab, r in zip(labels, results)]))
    for lab, r in zip(labels, results):
        confusion = r.details.get("confusion")
        if confusion:
            out.append(heat_map(f"confusion matrix: {lab}", confusion["labels"], confusion["matrix"]))
    classes = list(dict.fromkeys(c for r in results for c in r.details.get("per_class", {})))
    if classes:
        out.append(bar_chart("F1 per class", classes, [(lab, [r.details.get("per_class", {}).get(c, {}).get("f1")
                                                              for c in classes]) for lab, r in zip(labels, results)]))
    for metric in ("recall", "accuracy"):
        with_curves = [(lab, r.details["curves"][metric]) for lab, r in zip(labels, results)
                       if metric in r.details.get("curves", {})]
        if with_curves:
            ks = [int(k) for k in with_curves[0][1]]
            out.append(line_chart(f"{metric}@k", ks, [(lab, list(curve.values())) for lab, curve in with_curves]))
    return [c for c in out if c]


def _metrics_table(evaluation: Evaluation, labels: list[str]) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in ["metric", *labels]
                   + (["difference"] if len(evaluation.results) == 2 else []))
    names = list(dict.fromkeys(k for r in evaluation.results for k in r.metrics))
    body = []
    for name in names:
        values = [r.metrics.get(name) for r in evaluation.results]
        tds = "".join(f"<td>{'' if v is None else f'{v:.4f}'}</td>" for v in values)
        diff = evaluation.difference(name)
        if diff is not None:
            tds += f'<td class="{"up" if diff > 0 else "down" if diff < 0 else ""}">{diff:+.4f}</td>'
        body.append(f"<tr><td>{_e(name)}</td>{tds}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _per_class_table(result: EvalResult, label: str) -> str:
    table = result.details.get("per_class")
    if not table:
        return ""
    columns = list(dict.fromkeys(k for row in table.values() for k in row))
    head = "".join(f"<th>{_e(c)}</th>" for c in ["label", *columns])
    def cell(v: Any) -> str:
        return "" if v is None else str(v) if isinstance(v, int) else f"{v:.4f}"

    body = "".join(f"<tr><td>{_e(name)}</td>" + "".join(f"<td>{cell(row.get(c))}</td>" for c in columns) + "</tr>"
                   for name, row in table.items())
    return f"<h3>{_e(label)}</h3><table><tr>{head}</tr>{body}</table>"


def render_report(evaluation: Evaluation) -> str:
    """The page as a string."""
    labels = short_names([r.model for r in evaluation.results])
    facts = "".join(f"<tr><td>{_e(lab)}</td><td>{_e(r.model)}</td><td>{r.examples}</td><td>"
                    + _e(", ".join(f"{k} {v}" for k, v in r.facts.items() if v is not None)) + "</td></tr>"
                    for lab, r in zip(labels, evaluation.results))
    per_class = "".join(_per_class_table(r, lab) for lab, r in zip(labels, evaluation.results))
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>hfport evaluation: {_e(evaluation.task)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;color:#111}}table{{border-collapse:collapse;margin-bottom:1em}}
td,th{{border:1px solid #ddd;padding:2px 8px;font-size:13px;text-align:right}}
td:first-child,th:first-child{{text-align:left}}
.up{{color:#1a7f37}}.down{{color:#d1242f}}.chart{{margin:0 12px 12px 0;border:1px solid #eee}}
.chart .t{{font-size:13px;font-weight:600}}.chart .s{{font-size:11px;fill:#444}}.chart .g{{stroke:#eee}}</style>
</head><body><h1>hfport evaluation: {_e(evaluation.task)}</h1>
<p>data: {_e(evaluation.data)}{f"; corpus: {_e(evaluation.corpus)}" if evaluation.corpus else ""}</p>
<table><tr><th>model</th><th>path</th><th>examples</th><th>facts</th></tr>{facts}</table>
<h2>Charts</h2><div>{"".join(charts(evaluation, labels))}</div>
<h2>Metrics</h2>{_metrics_table(evaluation, labels)}
{f"<h2>Per class</h2>{per_class}" if per_class else ""}
</body></html>"""


def write_report(evaluation: Evaluation, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    hub.write_text_atomic(path, render_report(evaluation))  # whole or not at all
    return path
