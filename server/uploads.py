"""Uploaded data files (POST /jobs/finetune/upload) are removed once no job needs them.

An upload lands in `uploads/<random>/` and the job's config names its files by absolute path. A worker sweeps the
folder now and then: a sub-folder that no path of a queued or running job points into (its data, its output folder,
its model, any option), that holds no registered model, and that is older than the grace period (an upload whose job
is still being submitted is never swept), is deleted. A job's output_dir may not lie here at all
(routes/jobs.py refuses it): what a job writes is not an upload. So an upload goes soon after its job
ends (succeeded, failed or cancelled), and one whose submission failed half-way does not stay forever. Every worker
may sweep (the folder is shared across hosts); deleting twice is harmless.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("hfport.server.uploads")

LIVE = ("queued", "running")
# Fixed, not settings: an upload's job is submitted within seconds of the upload, so ten minutes of grace cover any
# submission still in flight; a sweep a minute keeps the folder's listing off the worker's every tick.
GRACE_S = 600.0
SWEEP_S = 60.0


def _strings(value: Any) -> list[str]:
    """Every string inside a job's config (paths hide in train, eval, output_dir, model, options.gate_data, ...)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def referenced(jobs: list[dict[str, Any]], root: Path, models: list[dict[str, Any]] = ()) -> set[str]:
    """The names of the upload folders under ROOT that any path these jobs' configs name points into (data, an
    output folder, a model, an option), or that a registered model (its folder, an adapter's base) lies in."""
    names = set()
    values = [s for job in jobs for s in _strings(job.get("config") or {})]
    values += [m[k] for m in models for k in ("path", "base") if m.get(k)]
    for value in values:
        path = Path(value)
        if path.is_absolute() and path.is_relative_to(root) and path != root:
            names.add(path.relative_to(root).parts[0])
    return names


def sweep(store: Any, root: Path, grace_s: float, now: float | None = None) -> list[str]:
    """Delete the upload folders under ROOT that no live job refers to and that are older than GRACE_S seconds;
    returns their names."""
    if not root.is_dir():
        return []
    now = time.time() if now is None else now
    live = [job for status in LIVE for job in store.list_jobs(status, limit=100_000)]
    keep = referenced(live, root.resolve(), store.list_models())
    removed = []
    for folder in sorted(root.iterdir()):
        if folder.name in keep or not folder.is_dir():
            continue
        try:
            age = now - folder.stat().st_mtime
        except FileNotFoundError:  # another worker swept it meanwhile
            continue
        if age >= grace_s:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    if removed:
        log.info("removed %d upload folder(s) no job needs: %s", len(removed), ", ".join(removed))
    return removed
