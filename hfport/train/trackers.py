"""report_to: experiment trackers (TensorBoard, MLflow, Weights & Biases) through accelerate's own
(Accelerator(log_with=...), init_trackers with the run's config, accelerator.log). They receive the same train, eval
and perf lines as metrics.jsonl, at the same steps, and only the main process logs (accelerate's trackers start and
log there only). Where each keeps its files unless the user points elsewhere:

    tensorboard   <logging_dir>/<run_name>/ (logging_dir defaults to <output_dir>/runs, run_name to output_dir's
                  name: several runs can share a logging_dir and `tensorboard --logdir` shows them side by side)
    mlflow        a SQLite store <output_dir>/mlflow.db (MLFLOW_TRACKING_URI overrides; MLflow 3 refuses its old
                  file store unless told to), experiment "hfport" (MLFLOW_EXPERIMENT_NAME overrides), the run
                  named run_name; `mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db` shows it
    wandb         offline (WANDB_MODE=online uploads) under <output_dir>/wandb (WANDB_DIR overrides), project "hfport"

A line's keys are named as transformers' TensorBoard and wandb callbacks name them: train/loss, train/lr,
eval/accuracy (metrics.jsonl's eval_accuracy), perf/tokens_per_s. A resumed run logs again from its
checkpoint's step, an overwritten one from step 1: TensorBoard's writer is told so (SummaryWriter's purge_step), and
its reader then hides the earlier events from there on, as metrics.jsonl drops its lines; MLflow and wandb start a
new run with the same name.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

from accelerate import Accelerator
from accelerate.tracking import TensorBoardTracker

from .monitor import PERF

# report_to's names -> (the module that must import, what to pip install)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"),
            "wandb": ("wandb", "wandb")}
PROJECT = "hfport"  # MLflow's experiment, wandb's project
LOGGED = ("train", "eval", PERF)  # the metrics.jsonl lines the trackers receive
EXTRA = "pip install 'hfport[trackers]'"

log = logging.getLogger("hfport.train")


def installed(name: str) -> bool:
    return importlib.util.find_spec(TRACKERS[name][0]) is not None


def report_to_list(value: Any) -> list[str]:
    """transformers' report_to values: a name, a list or a comma-separated string of names, "all" (every tracker
    hfport supports that is installed) or "none"; returned as the list of names. An unknown name, or one whose
    package is missing, is an error saying what to do."""
    if value is None:
        return []
    items = [p.strip() for p in value.split(",")] if isinstance(value, str) else [str(p).strip() for p in value]
    items = [p for p in items if p]
    if "none" in items or "all" in items:
        if len(items) > 1:
            raise ValueError(f"report_to {items}: 'none' and 'all' stand alone")
        return [name for name in TRACKERS if installed(name)] if items == ["all"] else []
    unknown = [p for p in items if p not in TRACKERS]
    if unknown:
        raise ValueError(f"report_to: unknown tracker(s) {unknown}; hfport reports to {list(TRACKERS)}, "
                         "'all' (every one installed) or 'none'")
    missing = [p for p in items if not installed(p)]
    if missing:
        raise ValueError(f"report_to {missing}: not installed; {EXTRA} (or pip install "
                         f"{' '.join(TRACKERS[m][1] for m in missing)})")
    return list(dict.fromkeys(items))


def tensorboard_dir(output_dir: str, logging_dir: str | None) -> Path:
    return Path(logging_dir) if logging_dir else Path(output_dir) / "runs"


def run_name(config: Any) -> str:
    return config.run_name or Path(config.output_dir).resolve().name


def accelerator_options(config: Any) -> dict[str, Any]:
    """Accelerator(**these): log_with ({} without trackers). TensorBoard's as accelerate's own tracker class, made
    here so that its folder is named after the run (accelerate's string form names it after the project)."""
    if not config.report_to:
        return {}
    return {"log_with": [TensorBoardTracker(run_name(config), tensorboard_dir(config.output_dir, config.logging_dir))
                         if name == "tensorboard" else name for name in config.report_to]}


def locations(config: Any) -> dict[str, str]:
    """Where each tracker of config.report_to keeps this run (the log line at start names them)."""
    out = Path(config.output_dir)
    where = {"tensorboard": str(tensorboard_dir(config.output_dir, config.logging_dir) / run_name(config)),
             "mlflow": os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(out / 'mlflow.db').resolve()}",
             "wandb": str(Path(os.environ.get("WANDB_DIR") or out) / "wandb")}
    return {name: where[name] for name in config.report_to}


def flat_config(config: Any) -> dict[str, bool | int | float | str]:
    """The config as trackers' hyperparameters take it: scalars as they are, the rest (lists, sections, None) as
    JSON text."""
    return {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
            for k, v in config.model_dump(mode="json").items()}


class Trackers:
    """The run's trackers: started with the config (init_trackers), fed each metrics.jsonl line (`around` wraps the
    loop's event callback), finished on every way out. Inactive (every call a no-op) without report_to and on
    every process but the main one."""

    def __init__(self, accelerator: Accelerator, config: Any, trainer: Any):
        """Start the trackers with the config and route `trainer`'s events through them."""
        self.accelerator = accelerator
        self.active = bool(config.report_to) and accelerator.is_main_process
        if not self.active:
            return
        name = run_name(config)
        for tracker in accelerator.log_with:  # accelerator_options' TensorBoard tracker: where this run starts
            if isinstance(tracker, TensorBoardTracker):
                tracker.init_kwargs["purge_step"] = (trainer.state.step if config.resume else 0) + 1
        if "mlflow" in config.report_to and not os.environ.get("MLFLOW_TRACKING_URI"):
            import mlflow  # an optional extra (report_to mlflow); accelerate's tracker uses the global tracking URI
            mlflow.set_tracking_uri(locations(config)["mlflow"])
        wandb_mode = {} if os.environ.get("WANDB_MODE") else {"mode": "offline"}  # never uploads unless asked to
        wandb_dir = Path(os.environ.get("WANDB_DIR") or config.output_dir)
        if "wandb" in config.report_to:
            wandb_dir.mkdir(parents=True, exist_ok=True)
        accelerator.init_trackers(PROJECT, config=flat_config(config), init_kwargs={
            "mlflow": {"run_name": name, "logging_dir": str(Path(config.output_dir).resolve() / "mlartifacts")},
            "wandb": {"name": name, "dir": str(wandb_dir), **wandb_mode}})
        trainer.emit = self.around(trainer.emit)
        log.info("report_to: %s", "; ".join(f"{k} at {v}" for k, v in locations(config).items()))

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def log(self, entry: dict[str, Any]) -> None:
        """One metrics.jsonl line: its numbers as <type>/<name> at its step (eval_accuracy -> eval/accuracy)."""
        if not self.active or entry.get("type") not in LOGGED:
            return
        kind = entry["type"]
        values = {f"{kind}/{k.removeprefix('eval_') if kind == 'eval' else k}": float(v) for k, v in entry.items()
                  if k not in ("type", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.accelerator.log(values, step=entry["step"])

    def around(self, emit: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None] | None:
        """The loop's event callback (main process), feeding the trackers first."""
        if not self.active:
            return emit

        def both(entry: dict[str, Any]) -> None:
            self.log(entry)
            if emit is not None:
                emit(entry)
        return both

    def finish(self) -> None:
        """Flush and close each tracker (not accelerator.end_training: that also ends the process group, which the
        caller still needs)."""
        if self.active:
            for tracker in self.accelerator.trackers:
                tracker.finish()
            self.accelerator.trackers.clear()
            self.active = False
