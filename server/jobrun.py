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

import hfport
from hfport import PERF, RunDir
from hfport.errors import HfportError
from hfport.export import DEFAULT_FORMAT

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


def model_task(folder: Path) -> str | None:
    """The pipeline task of a model folder's head (None if its config cannot tell)."""
    try:
        return hfport.model_task(folder)
    except (HfportError, ValueError, OSError):  # an unreadable config has no task; callers decide what that means
        return None


def run_finetune(store: BaseStore, job: dict[str, Any]) -> dict[str, Any]:
    main = _is_main_rank()
    config = dict(job["config"])
    register_as = config.pop("register_as", None) or f"finetune-{job['id']}"
    run = RunDir(config["output_dir"])
    config["resume"], config["overwrite"] = None, False
    point = run.resume_point()
    if point is not None:
        config["resume"] = "latest"
        if main:
            log.info("job %s: resuming from checkpoint %s (step %d)", job["id"], point.checkpoint, point.step)
            store.drop_events_past(job["id"], point.step)
            store.add_event(job["id"], {"type": "resumed", "step": point.step, "checkpoint": point.checkpoint.name})
            store.update_progress(job["id"], {"step": point.step, "resumed_from": point.step})
    elif run.existing():  # a run cut off before its first checkpoint
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
        elif kind == PERF:  # ETA, throughput and resources (hfport.train.monitor) go to the job's progress
            store.update_progress(job["id"], {k: v for k, v in event.items() if k != "type"
                                              and isinstance(v, (int, float))})

    hfport.finetune(config, progress=False, on_event=on_event if main else None)
    if not main:
        return {}
    summary = run.summary()
    task = model_task(run.best)
    lora = hfport.lora
    # a LoRA run's best/ is an adapter: registered over its base, whose weights the adapters share when served
    base = lora.read_adapter_config(run.best).get("base_model_name_or_path") \
        if lora.is_adapter_folder(run.best) else None
    store.register_model(register_as, str(run.best), task, source=f"job:{job['id']}", replace=True,
                         kind="adapter" if base else "model", base=base)
    return {"output_dir": str(run.root), "model": register_as, "model_path": str(run.best), "task": task,
            "summary": summary.to_dict(with_config=False) if summary is not None else {}}


def run_export(store: BaseStore, job: dict[str, Any]) -> dict[str, Any]:
    config = dict(job["config"])
    format_ = config.get("format") or DEFAULT_FORMAT  # jobs queued before formats existed wrote HF folders
    verify = bool(config.get("verify"))
    store.add_event(job["id"], {"type": "export", "stage": "export" + (" + verify" if verify else ""),
                                "source": config["model"], "format": format_})
    result = hfport.export(config["model"], config["output_dir"], format=format_, verify=verify,
                           **(config.get("options") or {})).to_dict()
    out = {"output_dir": result["out"], **{k: result[k] for k in ("format", "family", "task", "dtype", "files")}}
    if result["verify"] is not None:
        out["verify"] = result["verify"]
        store.add_event(job["id"], {"type": "export", "stage": "verified", "passed": out["verify"]["passed"]})
    return out


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
    # HFPORT_VERBOSITY reaches the job process (and each of its ranks) through the environment
    hfport.verbosity.configure(hfport.verbosity.from_env(default="verbose"),
                               "%(asctime)s %(levelname)s %(name)s: %(message)s")

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
