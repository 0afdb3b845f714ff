"""report.html: one self-contained page (no network) with the run's summary, its machine facts and its curves.

The curves are drawn by the same script as the server's dashboard (hfport/train/static/charts.js, inlined here):
one panel per metric group with axes, hover read-out, a log scale for losses; every point is embedded, the
script downsamples only for drawing. Lines of metrics.jsonl that could not be read are listed, not fatal.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from ..rundir import RunDir, RunSummary
from .monitor import charts_js, fmt_duration, is_perf


def _rows(values: dict[str, Any]) -> str:
    return "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(json.dumps(v))}</td></tr>"
                   for k, v in values.items())


def machine_facts(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """From the perf lines: mean throughput over the run, peak memory, last elapsed figures."""
    perf = [e for e in entries if is_perf(e)]
    if not perf:
        return {}
    out: dict[str, Any] = {}
    for key in ("steps_per_s", "tokens_per_s", "examples_per_s"):
        values = [e[key] for e in perf if isinstance(e.get(key), (int, float))]
        if values:
            out[f"mean {key}"] = round(sum(values) / len(values), 2)
    evals = [e["eval_s"] for e in perf if isinstance(e.get("eval_s"), (int, float))]
    if evals:
        out["eval time (s, recent average)"] = evals[-1]
    keys = sorted({k for e in perf for k in e if k.endswith("_gb") and not k.endswith("_total_gb")})
    for key in keys:
        out[f"peak {key}"] = max(e[key] for e in perf if isinstance(e.get(key), (int, float)))
    totals = {k: perf[-1][k] for k in perf[-1] if k.endswith("_total_gb")}
    out.update(totals)
    waited = perf[-1].get("checkpoint_wait_s")
    if waited is not None:
        out["waited for background checkpoints (s)"] = waited
    first_eta = next((e["eta_s"] for e in perf if "eta_s" in e), None)
    if first_eta is not None:
        out["first ETA"] = fmt_duration(first_eta)
    return out


def before_after(entries: list[dict[str, Any]], summary: RunSummary) -> str:
    """--eval-before's table: each eval metric of the base model (the eval line of step 0), the best step's and the
    final evaluation's; empty without a step-0 evaluation."""
    evals = [e for e in entries if e.get("type") == "eval"]
    before = next((e for e in evals if e.get("step") == 0), None)
    if before is None:
        return ""
    best = next((e for e in reversed(evals) if e.get("step") == summary.best_step and e is not before), None)
    columns = [("before (step 0)", before), (f"best (step {summary.best_step})", best),
               ("final", summary.final_eval)]
    columns = [(name, values) for name, values in columns if values]
    keys = [k for k, v in before.items() if k.startswith("eval_") and isinstance(v, (int, float))]
    head = "".join(f"<th>{html.escape(name)}</th>" for name, _ in columns)
    body = "".join(f"<tr><td>{html.escape(k[5:])}</td>" + "".join(
        f"<td>{values[k]:.4f}</td>" if isinstance(values.get(k), (int, float)) else "<td></td>"
        for _, values in columns) + "</tr>" for k in keys)
    return f"<h2>Before and after fine-tuning</h2><table><tr><th>metric</th>{head}</tr>{body}</table>"


def render_report(entries: list[dict[str, Any]], summary: RunSummary, problems: list[str] | None = None) -> str:
    """The page as a string (write_report writes it)."""
    data = json.dumps([{"name": "run", "entries": entries}]).replace("</", "<\\/")  # never ends the <script>
    notes = "".join(f"<li>{html.escape(p)}</li>" for p in problems or [])
    facts = machine_facts(entries)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>hfport run report</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;color:#111}}table{{border-collapse:collapse}}
td{{border:1px solid #ddd;padding:2px 8px;font-size:13px}}.problems{{color:#9a3412}}</style>
</head><body><h1>hfport fine-tune report</h1><h2>Summary</h2><table>{_rows(summary.to_dict(with_config=False))}</table>
{before_after(entries, summary)}
{f'<h2>Machine</h2><table>{_rows(facts)}</table>' if facts else ''}
{f'<h2>Unreadable metrics lines</h2><ul class="problems">{notes}</ul>' if notes else ''}
<h2>Curves</h2><div id="charts"><noscript>the curves need JavaScript (inline, no network)</noscript></div>
<h2>Configuration</h2><table>{_rows(summary.config)}</table>
<script>{charts_js()}</script>
<script>HfCharts.render(document.getElementById("charts"), {data});</script>
</body></html>"""


def write_report(run: RunDir, entries: list[dict[str, Any]], summary: RunSummary,
                 problems: list[str] | None = None) -> Path:
    """Write run.report from metrics.jsonl's entries (and the lines that could not be read); returns its path."""
    run.report.write_text(render_report(entries, summary, problems), encoding="utf-8")
    return run.report
