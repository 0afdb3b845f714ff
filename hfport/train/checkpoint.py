"""Checkpoints: written whole under a temporary name, then renamed; `latest` moves only after the rename.

Where they go (checkpoints/step-<N>/, checkpoints/latest) is RunDir's (hfport/rundir.py); this file owns what is
inside one. checkpoints/step-<N>/ holds model.safetensors + config.json (an HF folder), optimizer.pt, scheduler.pt,
scaler.pt (tensors and plain values only, read back with weights_only=True), and trainer_state.json (step,
epoch, position in the epoch's batch order, metric history, early stopping, RNG states).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from .. import hub
from ..rundir import TRAINER_STATE, RunDir


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


def save_checkpoint(run: RunDir, step: int, model: Any, optimizer: Any, scheduler: Any, scaler: Any,
                    state: dict[str, Any]) -> Path:
    """Write checkpoints/step-<step>/ atomically and point checkpoints/latest at it."""
    run.checkpoints.mkdir(parents=True, exist_ok=True)
    final = run.checkpoint(step)
    tmp = run.checkpoints / f".tmp-step-{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    if scaler is not None:
        torch.save(scaler.state_dict(), tmp / "scaler.pt")
    torch.save(rng_tensors(), tmp / "rng.pt")
    hub.write_json_atomic(tmp / TRAINER_STATE, {**state, "rng": capture_rng()})
    for f in tmp.iterdir():  # the data must be on disk before the rename makes it visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    run.set_latest(final)
    return final


def prune(run: RunDir, keep: int, protect: set[int]) -> None:
    """Keep the newest `keep` checkpoints plus the protected ones (the best)."""
    steps = run.checkpoint_steps()
    for step in steps[:-keep] if keep else steps:
        if step not in protect:
            shutil.rmtree(run.checkpoint(step), ignore_errors=True)
    for stale in run.checkpoints.glob(".tmp-step-*"):  # left by a run killed mid-write: never "latest", safe to drop
        shutil.rmtree(stale, ignore_errors=True)


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
