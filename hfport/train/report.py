"""report.html: one self-contained page (inline SVG, no scripts, no network) with the run's curves."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from ..rundir import RunDir, RunSummary

W, H, PAD = 460, 220, 40


def _svg_chart(title: str, series: dict[str, list[tuple[float, float]]]) -> str:
    points = [p for s in series.values() for p in s]
    if not points:
        return ""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1

    def sx(x: float) -> float:
        return PAD + (x - x0) / (x1 - x0) * (W - 2 * PAD)

    def sy(y: float) -> float:
        return H - PAD + (y - y0) / (y1 - y0) * -(H - 2 * PAD)

    colors = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"]
    parts = [f'<svg width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" aria-label="{html.escape(title)}">',
             f'<text x="{W / 2}" y="16" text-anchor="middle" font-weight="bold">{html.escape(title)}</text>',
             f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="#888"/>',
             f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="#888"/>',
             f'<text x="{PAD}" y="{H - PAD + 14}" font-size="10">{x0:g}</text>',
             f'<text x="{W - PAD}" y="{H - PAD + 14}" font-size="10" text-anchor="end">{x1:g} steps</text>',
             f'<text x="{PAD - 4}" y="{H - PAD}" font-size="10" text-anchor="end">{y0:.3g}</text>',
             f'<text x="{PAD - 4}" y="{PAD + 4}" font-size="10" text-anchor="end">{y1:.3g}</text>']
    for k, (name, pts) in enumerate(series.items()):
        color = colors[k % len(colors)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{path}"/>')
        for x, y in pts if len(pts) < 40 else []:
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{color}"/>')
        parts.append(f'<text x="{W - PAD}" y="{PAD + 12 * k}" font-size="11" fill="{color}" '
                     f'text-anchor="end">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def write_report(run: RunDir, entries: list[dict[str, Any]], summary: RunSummary) -> Path:
    """Write run.report from metrics.jsonl's entries and the summary; returns its path."""
    train = [e for e in entries if e["type"] == "train"]
    evals = [e for e in entries if e["type"] == "eval"]
    charts = [
        _svg_chart("training loss", {"loss": [(e["step"], e["loss"]) for e in train]}),
        _svg_chart("learning rate", {"lr": [(e["step"], e["lr"]) for e in train]}),
        _svg_chart("gradient norm (before clipping)", {"grad_norm": [(e["step"], e["grad_norm"]) for e in train]}),
        _svg_chart("eval loss", {"eval_loss": [(e["step"], e["eval_loss"]) for e in evals if "eval_loss" in e]}),
    ]
    metric_keys = sorted({k for e in evals for k in e if k.startswith("eval_") and k != "eval_loss"
                          and isinstance(e[k], (int, float))})
    if metric_keys:
        charts.append(_svg_chart("eval metrics", {k[5:]: [(e["step"], e[k]) for e in evals if k in e]
                                                  for k in metric_keys[:6]}))
    rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(json.dumps(v))}</td></tr>"
                   for k, v in summary.to_dict(with_config=False).items())
    config_rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(json.dumps(v))}</td></tr>"
                          for k, v in summary.config.items())
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>hfport run report</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;color:#111}}table{{border-collapse:collapse}}
td{{border:1px solid #ddd;padding:2px 8px;font-size:13px}}.charts{{display:flex;flex-wrap:wrap;gap:1em}}</style>
</head><body><h1>hfport fine-tune report</h1><h2>Summary</h2><table>{rows}</table>
<h2>Curves</h2><div class="charts">{''.join(c for c in charts if c)}</div>
<h2>Configuration</h2><table>{config_rows}</table></body></html>"""
    run.report.write_text(page, encoding="utf-8")
    return run.report
