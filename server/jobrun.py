"""One job, in its own process: `python -m server.jobrun JOB_ID --data-dir DIR`.

The worker (server/worker.py) starts it; it reads the job from the store, runs the same engine as `hfport finetune`
(hfport.export for export jobs, hfport.evaluate for evaluate jobs) and writes events, progress, the result and the
final status back. A fine-tune
whose output folder already holds checkpoints (the server died while it ran) resumes from the latest one.
Every write it makes carries its attempt's lease, and it dies before another worker may take the job over
(server/fence.py). Exit codes: 0 succeeded, 1 failed (the error is in the store), 143 terminated (cancel or server
shutdown), 75 fenced (its lease was lost or not renewed in time), 76 stalled (no step progress within stall_s).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import hfport
from hfport import PERF, RunDir
from hfport.errors import HfportError
from hfport.export import DEFAULT_FORMAT

from . import fence as fencing
from .fence import Fence, FencedStore
from .settings import Settings
from .store import BaseStore, open_store

log = logging.getLogger("hfport.server.jobrun")

PROGRESS_KEYS = ("step", "epoch")


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
    if main:  # the ranks `accelerate launch` started (HFPORT_JOB_PROCESSES), shown by GET /jobs/{id}
        store.update_progress(job["id"], {"num_processes": int(os.environ.get("WORLD_SIZE", "1"))})
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
    # an adapter's base as the API resolved and confined it (a registered adapter's registered base), never the
    # one its adapter_config.json names
    result = hfport.export(config["model"], config["output_dir"], format=format_, verify=verify,
                           base_model=config.get("base_model"), **(config.get("options") or {})).to_dict()
    out = {"output_dir": result["out"], **{k: result[k] for k in ("format", "family", "task", "dtype", "files")}}
    if result["verify"] is not None:
        out["verify"] = result["verify"]
        store.add_event(job["id"], {"type": "export", "stage": "verified", "passed": out["verify"]["passed"]})
    return out


def run_evaluate(store: BaseStore, job: dict[str, Any]) -> dict[str, Any]:
    """hfport.evaluate, its figures in output_dir (eval.json, report.html) and in the job's result."""
    config = dict(job["config"])
    out = Path(config["output_dir"])
    store.add_event(job["id"], {"type": "evaluate", "stage": "evaluate", "model": config["model"],
                                "task": config["task"], "data": config["data"]})
    evaluation = hfport.evaluate(config["model"], config["data"], task=config["task"], corpus=config.get("corpus"),
                                 compare=config.get("compare"), json_path=out / "eval.json",
                                 report_path=out / "report.html", dtype=config.get("dtype"),
                                 batch_size=config.get("batch_size"), progress=False,
                                 **(config.get("options") or {}))
    store.update_progress(job["id"], {}, {k: v for k, v in evaluation.metrics.items()
                                          if isinstance(v, (int, float)) and "/" not in k})
    result = evaluation.to_dict()
    return {"output_dir": str(out), "json": str(out / "eval.json"), "report": str(out / "report.html"),
            "task": result["task"], "results": [{"model": r["model"], "examples": r["examples"],
                                                 "metrics": r["metrics"]} for r in result["results"]]}


RUNNERS = {"finetune": run_finetune, "export": run_export, "evaluate": run_evaluate}  # job kind -> what runs it


def main(argv: list[str] | None = None, fence: Fence | None = None) -> int:
    """Run the job. `fence`: already started by `python -m server.fence` (which also checked the attempt); without
    it, this process starts its own (after the engine's import: fine for a long lease)."""
    parser = argparse.ArgumentParser(prog="python -m server.jobrun")
    parser.add_argument("job_id")
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--heartbeat", type=float, default=2.0)
    parser.add_argument("--attempt", type=int, default=None,
                        help="the attempt the worker claimed (fencing token): every write applies only while it "
                             "still holds the job (default: the job's current attempt)")
    parser.add_argument("--lease-s", type=float, default=30.0, help="the job lease, by the database clock")
    parser.add_argument("--lease-margin-s", type=float, default=None,
                        help="die when no renewal succeeded for lease-s minus this (default a fifth of the lease)")
    parser.add_argument("--stall-s", type=float, default=None,
                        help="a fine-tune with no step progress this long is stopped and requeued")
    args = parser.parse_args(argv)
    fencing.die_with_parent(args.parent_pid)
    # HFPORT_VERBOSITY reaches the job process (and each of its ranks) through the environment: the worker sets it to
    # the server's level (`serve -q`, `-vv`) when it was given one
    hfport.verbosity.configure(hfport.verbosity.from_env(default="verbose"),
                               "%(asctime)s %(levelname)s %(name)s: %(message)s")

    def terminated(signum: int, frame: Any) -> None:
        log.info("job %s: terminated by signal %d", args.job_id, signum)
        os._exit(143)  # the worker records why (cancel or shutdown); nothing to write from here

    signal.signal(signal.SIGTERM, terminated)
    main_rank = _is_main_rank()
    if main_rank and fence is None:  # the other ranks write nothing to the store; the fence kills them with rank 0
        fence, code = fencing.start(argv if argv is not None else sys.argv[1:])
        if code is not None:
            return code
    if fence is not None:
        store, job = FencedStore(fence.store, fence), fence.store.get_job(args.job_id)
        fence.begin()
    else:  # a rank other than 0: reads only
        store = open_store(Settings.env_value("database_url") or args.data_dir / "hfport.db")
        job = store.get_job(args.job_id)
    try:
        result = RUNNERS[job["kind"]](store, job)
    except Exception as e:  # noqa: BLE001 - every failure ends up in the store, with its message
        traceback.print_exc()
        if main_rank:
            store.finish(job["id"], "failed", error=f"{type(e).__name__}: {e}", attempt=args.attempt)
        return 1
    if main_rank:
        store.finish(job["id"], "succeeded", result=result, attempt=args.attempt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
