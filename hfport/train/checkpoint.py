"""Checkpoints: written whole under a temporary name, then renamed; `latest` moves only after the rename. The loop
takes a CPU snapshot (snapshot) and a background thread writes it (CheckpointWriter); save_checkpoint does both
in the calling thread.

Where they go (checkpoints/step-<N>/, checkpoints/latest) is RunDir's (hfport/rundir.py); this file owns what is
inside one. checkpoints/step-<N>/ holds model.safetensors + config.json (an HF folder), optimizer.pt, scheduler.pt,
scaler.pt (tensors and plain values only, read back with weights_only=True), and trainer_state.json (step,
epoch, position in the epoch's batch order, metric history, early stopping, RNG states, and the number of processes
that trained: a resume with another number would be another run).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file

from .. import hub
from ..rundir import STEP_DIR, TRAINER_STATE, RunDir

NUM_PROCESSES = "num_processes"  # trainer_state.json's key: the processes of the run that wrote the checkpoint
# the names a checkpoint is written under (write_checkpoint) and retired to (retire) in checkpoints/: a run killed
# there leaves one, which sweep() removes
WRITING, RETIRED = ".tmp-step-{step}-{pid}", ".old-{name}-{pid}"
LEFTOVER = re.compile(r"\.(tmp|old)-step-\d+-\d+\Z")

def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": _jsonable(random.getstate()),
        "numpy": _jsonable(np.random.get_state()),
    }
    return state


def rng_tensors() -> dict[str, torch.Tensor]:
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda{i}"] = s
    return out


def restore_rng(state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    random.setstate(_tuplify(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("cuda")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (tuple, list)):
        return [_jsonable(v) for v in x]
    return x


def _tuplify(x: Any) -> Any:
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x


@dataclass
class Snapshot:
    """Everything a checkpoint holds, copied to the CPU at one instant: the next optimizer step mutates the live
    tensors in place, so a background writer must never see them. RNG states are captured here too, at the
    same point in the run an inline save would have captured them (that keeps resume bit-exact)."""

    step: int
    weights: dict[str, torch.Tensor]  # HF names -> CPU copies
    config: dict[str, Any]  # config.json
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    scaler: dict[str, Any] | None
    rng_tensors: dict[str, torch.Tensor]
    state: dict[str, Any]  # trainer_state.json, RNG included


def _cpu_copy(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)  # copy=True: on the CPU .to() alone would return the live tensor
    if isinstance(x, dict):
        return {k: _cpu_copy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_cpu_copy(v) for v in x)
    return copy.deepcopy(x)


def snapshot(step: int, model: Any, optimizer: Any, scheduler: Any, scaler: Any, state: dict[str, Any]) -> Snapshot:
    """CPU copies of the model, optimizer, scheduler, scaler, RNG and trainer state (see Snapshot)."""
    config = model.config.to_hf_dict(model.family.architectures[model.task])  # as model.save_pretrained writes it
    config["dtype"] = str(model.dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    return Snapshot(
        step=step, weights={k: _cpu_copy(v) for k, v in model.hf_state_dict().items()}, config=config,
        optimizer=_cpu_copy(optimizer.state_dict()), scheduler=_cpu_copy(scheduler.state_dict()),
        scaler=_cpu_copy(scaler.state_dict()) if scaler is not None else None, rng_tensors=_cpu_copy(rng_tensors()),
        state={**json.loads(json.dumps(state)), "rng": capture_rng()})


def write_checkpoint(run: RunDir, snap: Snapshot) -> Path:
    """Write checkpoints/step-<step>/ under a temporary name, fsync, rename, then point checkpoints/latest at it.

    A step-<N> folder is only ever made by renaming a complete one into place and only ever unmade by renaming it
    away (`retire`), so under its own name it is always whole, wherever the process is killed. Re-saving a step that
    exists (a run resumed from an older checkpoint) retires the old folder first; a kill between the two renames
    leaves `latest` naming no folder, and RunDir.latest_checkpoint falls back to the newest complete one."""
    run.checkpoints.mkdir(parents=True, exist_ok=True)
    final = run.checkpoint(snap.step)
    tmp = run.checkpoints / WRITING.format(step=snap.step, pid=os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    hub.save_weights(snap.weights, tmp)
    hub.write_json_atomic(tmp / "config.json", snap.config)
    torch.save(snap.optimizer, tmp / "optimizer.pt")
    torch.save(snap.scheduler, tmp / "scheduler.pt")
    if snap.scaler is not None:
        torch.save(snap.scaler, tmp / "scaler.pt")
    torch.save(snap.rng_tensors, tmp / "rng.pt")
    hub.write_json_atomic(tmp / TRAINER_STATE, snap.state)
    for f in tmp.iterdir():  # the data must be on disk before the rename makes it visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    old = retire(run, final) if final.exists() else None
    os.replace(tmp, final)
    run.set_latest(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def retire(run: RunDir, checkpoint: Path) -> Path:
    """Rename a checkpoint out of the step-<N> namespace (one atomic step) before it is deleted: an rmtree in place,
    killed half-way, would leave a folder that still looks like a checkpoint. sweep() removes what a kill left."""
    old = run.checkpoints / RETIRED.format(name=checkpoint.name, pid=os.getpid())
    shutil.rmtree(old, ignore_errors=True)
    os.replace(checkpoint, old)
    return old


def save_checkpoint(run: RunDir, step: int, model: Any, optimizer: Any, scheduler: Any, scaler: Any,
                    state: dict[str, Any]) -> Path:
    """Write checkpoints/step-<step>/ atomically and point checkpoints/latest at it, in this thread."""
    return write_checkpoint(run, snapshot(step, model, optimizer, scheduler, scaler, state))


class CheckpointWriter:
    """Writes snapshots on one background thread while training goes on.

    A save that comes due while the previous one is still being written WAITS for it (submit joins first):
    skipping it would leave a gap that save_total_limit's pruning and the best checkpoint's protection do not
    expect, and two writers at once would race on `latest`. wait() joins and re-raises a writer's error;
    the loop calls it before final/ and on every exit, so a run never ends with a save in flight."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.waited_s = 0.0  # total time the loop spent waiting for an earlier save (for the perf log)

    def submit(self, job: Callable[[], Any]) -> None:
        started = time.perf_counter()
        self.wait()
        self.waited_s += time.perf_counter() - started
        self._thread = threading.Thread(target=self._run, args=(job,), name="hfport-checkpoint", daemon=True)
        self._thread.start()

    def _run(self, job: Callable[[], Any]) -> None:
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
            self._error = e

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Join without raising (the way out after another error): a writer's failure is logged instead."""
        try:
            self.wait()
        except BaseException:  # noqa: BLE001 - the error already propagating matters more
            logging.getLogger("hfport.train").exception("background checkpoint failed")

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def rewind(run: RunDir, checkpoint: Path) -> list[int]:
    """A run resumed from a checkpoint older than its newest continues from there: `latest` names that checkpoint
    and the newer ones (the future the resumed run replaces, whose metrics.jsonl lines are cut) are retired. Without
    this, a kill before the resumed run's first save would resume from that abandoned future. Returns the retired
    steps; a checkpoint outside this run's folder changes nothing."""
    match = STEP_DIR.match(checkpoint.name)
    if match is None or checkpoint.parent.resolve() != run.checkpoints.resolve():
        return []
    newer = [s for s in run.checkpoint_steps() if s > int(match.group(1))]
    run.set_latest(checkpoint)  # first: from here on a kill resumes where this run is
    for step in newer:
        shutil.rmtree(retire(run, run.checkpoint(step)), ignore_errors=True)
    return newer


def prune(run: RunDir, keep: int, protect: set[int]) -> None:
    """Keep the newest `keep` checkpoints plus the protected ones (the best)."""
    steps = run.checkpoint_steps()
    for step in steps[:-keep] if keep else steps:
        if step not in protect:
            shutil.rmtree(retire(run, run.checkpoint(step)), ignore_errors=True)
    sweep(run)


def sweep(run: RunDir) -> list[str]:
    """Remove what a run killed mid-save or mid-delete left in its checkpoints folder: a checkpoint being written or
    retired (never named by `latest`) and `latest`'s own temporary file (hub.write_text_atomic's). Only those names,
    only there; called where this process is the run's one writer (prune, and a resume before training). Returns the
    names removed."""
    if not run.checkpoints.is_dir():
        return []
    stale = [p for p in run.checkpoints.iterdir() if LEFTOVER.match(p.name)]
    stale += hub.atomic_temporaries(run.latest_pointer)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return sorted(p.name for p in stale)


def load_checkpoint(path: Path, model: Any, optimizer: Any, scheduler: Any, scaler: Any) -> dict[str, Any]:
    """Restore everything saved by save_checkpoint; returns trainer_state (RNG not yet restored)."""
    weights = load_file(str(path / hub.SAFE_WEIGHTS))
    ours = {name: weights[hf] for name, hf in model.hf_names().items()}
    model.load_state_dict(ours, strict=True)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    if scaler is not None and (path / "scaler.pt").is_file():
        scaler.load_state_dict(torch.load(path / "scaler.pt", weights_only=True))
    state = json.loads((path / TRAINER_STATE).read_text())
    state["rng_tensors"] = torch.load(path / "rng.pt", weights_only=True)
    return state
