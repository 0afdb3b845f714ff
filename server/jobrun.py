"""One job, in its own process: `python -m server.jobrun JOB_ID --data-dir DIR`.

The worker (server/worker.py) starts it; it reads the job from the store, runs the same engine as `hfport finetune`
(or hfport.export for export jobs) and writes events, progress, the result and the final status back. A fine-tune
whose output folder already holds checkpoints (the server died while it ran) resumes from the latest one.
Exit codes: 0 succeeded, 1 failed (the error is in the store), 143 terminated (cancel or server shutdown).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from .store import BaseStore, open_store

log = logging.getLogger("hfport.server.jobrun")

PROGRESS_KEYS = ("step", "epoch")


def _die_with_parent(parent_pid: int | None) -> None:
    """Linux: SIGKILL this process when the server that started it dies, so no orphan keeps training."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(143)


def _is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def head_task(folder: Path) -> str | None:
    """The pipeline task of a model folder's head, read from config.json (None if it cannot be told)."""
    from hfport import hub
    from hfport.modeling import task_of
    from hfport.registry import get_family

    try:
        raw, source = hub.read_config(folder)
        model_task = task_of(get_family(raw.get("model_type"), source), raw.get("architectures") or [])
    except Exception:  # noqa: BLE001 - an unreadable config has no task; callers decide what that means
        return None
    from hfport.pipelines import PIPELINES

    return next((name for name, cls in PIPELINES.items() if cls.model_task == model_task), None)


def run_finetune(store: BaseStore, job: dict[str, Any]) -> dict[str, Any]:
    from hfport.train.checkpoint import latest_checkpoint
    from hfport.train.loop import RUN_FILES, finetune

    main = _is_main_rank()
    config = dict(job["config"])
    register_as = config.pop("register_as", None) or f"finetune-{job['id']}"
    out = Path(config["output_dir"])
    config["resume"], config["overwrite"] = None, False
    ckpt = latest_checkpoint(out / "checkpoints") if (out / "checkpoints").is_dir() else None
    if ckpt is not None:
        import json

        step = json.loads((ckpt / "trainer_state.json").read_text())["step"]
        config["resume"] = "latest"
        if main:
            log.info("job %s: resuming from checkpoint %s (step %d)", job["id"], ckpt, step)
            store.drop_events_past(job["id"], step)
            store.add_event(job["id"], {"type": "resumed", "step": step, "checkpoint": ckpt.name})
            store.update_progress(job["id"], {"step": step, "resumed_from": step})
    elif any((out / name).exists() for name in RUN_FILES):  # a run cut off before its first checkpoint
        config["overwrite"] = True
    total = config.get("max_steps")

    def on_event(event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "done":
            event = {k: v for k, v in event.items() if k != "config"}
        store.add_event(job["id"], event)
        if kind in ("train", "eval"):
            progress = {k: event[k] for k in PROGRESS_KEYS if k in event}
            if total:
                progress["total_steps"] = total
            metrics = {k: v for k, v in event.items() if k not in ("type", "step", "epoch")
                       and isinstance(v, (int, float)) and "/" not in k}
            store.update_progress(job["id"], progress, metrics)

    summary = finetune(config, progress=False, on_event=on_event if main else None)
    if not main:
        return {}
    summary = {k: v for k, v in summary.items() if k != "config"}
    best = out / "best"
    task = head_task(best)
    store.register_model(register_as, str(best), task, source=f"job:{job['id']}", replace=True)
    return {"output_dir": str(out), "model": register_as, "model_path": str(best), "task": task,
            "summary": summary}


def run_export(store: BaseStore, job: dict[str, Any]) -> dict[str, Any]:
    import importlib

    try:
        export_module = importlib.import_module("hfport.export")
    except ImportError as e:
        raise RuntimeError(f"this install has no hfport.export ({e}); export jobs cannot run") from e
    config = dict(job["config"])
    options = dict(config.get("options") or {})
    store.add_event(job["id"], {"type": "export", "stage": "export" + (" + verify" if config.get("verify") else ""),
                                "source": config["model"]})
    result = export_module.export(config["model"], config["output_dir"], verify=bool(config.get("verify")),
                                  **options)
    report = getattr(result, "report", None)
    out = {"output_dir": str(getattr(result, "out", config["output_dir"])),
           **{k: _jsonable(getattr(result, k)) for k in ("family", "task", "dtype", "files") if hasattr(result, k)}}
    if report is not None:
        out["verify"] = _jsonable(report.to_dict() if hasattr(report, "to_dict") else report)
        store.add_event(job["id"], {"type": "export", "stage": "verified", "passed": out["verify"].get("passed")})
    return out


def _jsonable(value: Any) -> Any:
    import json

    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        if isinstance(value, (list, tuple)):
            return [_jsonable(v) for v in value]
        if hasattr(value, "model_dump"):
            return _jsonable(value.model_dump())
        if hasattr(value, "__dict__"):
            return _jsonable({k: v for k, v in vars(value).items() if not k.startswith("_")})
        return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.jobrun")
    parser.add_argument("job_id")
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--heartbeat", type=float, default=2.0)
    parser.add_argument("--attempt", type=int, default=None,
                        help="the attempt the worker claimed (fencing token): heartbeats and the final status "
                             "apply only while it still holds the job")
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def terminated(signum: int, frame: Any) -> None:
        log.info("job %s: terminated by signal %d", args.job_id, signum)
        os._exit(143)  # the worker records why (cancel or shutdown); nothing to write from here

    signal.signal(signal.SIGTERM, terminated)
    # the worker passes a PostgreSQL URL in the environment (never argv); otherwise the data dir's SQLite file
    store = open_store(os.environ.get("HFPORT_DATABASE_URL") or args.data_dir / "hfport.db")
    job = store.get_job(args.job_id)
    if job is None:
        print(f"no job {args.job_id} in {store.describe()}", file=sys.stderr)
        return 2
    if args.attempt is not None and (job["attempts"] != args.attempt or job["status"] != "running"):
        print(f"job {args.job_id}: attempt {args.attempt} no longer holds it ({job['status']}, attempt "
              f"{job['attempts']})", file=sys.stderr)
        return 0
    main_rank = _is_main_rank()
    stop = threading.Event()
    if main_rank:
        def beat() -> None:
            while not stop.wait(args.heartbeat):
                try:
                    held = store.heartbeat(job["id"], args.attempt)
                except Exception as e:  # noqa: BLE001 - a database blip: the lease rule decides, not this thread
                    log.warning("heartbeat failed: %s", e)
                    continue
                if not held:  # requeued or claimed again elsewhere: that attempt owns the job now
                    log.warning("job %s: attempt %s lost its lease; stopping", job["id"], args.attempt)
                    os._exit(143)

        threading.Thread(target=beat, daemon=True, name="heartbeat").start()
    try:
        result = (run_finetune if job["kind"] == "finetune" else run_export)(store, job)
    except Exception as e:  # noqa: BLE001 - every failure ends up in the store, with its message
        traceback.print_exc()
        if main_rank:
            store.finish(job["id"], "failed", error=f"{type(e).__name__}: {e}", attempt=args.attempt)
        return 1
    finally:
        stop.set()
    if main_rank:
        store.finish(job["id"], "succeeded", result=result, attempt=args.attempt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
