"""Kill points inside a checkpoint save, injected from outside the production code.

A test names a point and a step; the child process that trains installs wrappers around the calls
hfport/train/checkpoint.py makes (hub.save_weights, torch.save, os.replace, retire, RunDir.set_latest) and, when
that step's save reaches the point, SIGKILLs itself (or stalls, for a test that kills from outside). Nothing in
hfport knows about this module.

    after-weights    model.safetensors written, nothing else
    after-optimizer  optimizer.pt written
    after-state      trainer_state.json written (the folder is whole, still under its temporary name)
    after-retire     re-save only: the old step-N folder renamed away, the new one not yet in place
    before-rename    the new folder is about to be renamed into place
    after-rename     step-N is in place, `latest` not yet moved
    before-latest    `latest`'s new text written under its temporary name, not yet renamed over it
    after-latest     `latest` moved; on a re-save the old folder is not yet deleted
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

POINTS = ("after-weights", "after-optimizer", "after-state", "after-retire", "before-rename", "after-rename",
          "before-latest", "after-latest")
ENV = "HFPORT_TESTS_FAULT"  # "POINT:STEP" or "POINT:STEP:stall=SECONDS", read by `python -m tests.faults`


def _hit(action: str) -> None:
    if action.startswith("stall="):
        time.sleep(float(action.removeprefix("stall=")))
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def install(point: str, step: int, action: str = "kill") -> None:
    """Wrap the calls a checkpoint save makes so that `step`'s save stops at `point`."""
    import torch

    from hfport import hub
    from hfport.rundir import RunDir
    from hfport.train import checkpoint

    if point not in POINTS:
        raise ValueError(f"fault point {point!r}: expected one of {POINTS}")
    tmp_prefix, final_name = f".tmp-step-{step}-", f"step-{step}"

    def ours(path: Any) -> bool:  # a file or folder of this step's save (not best/, final/ or another step)
        return Path(path).name.startswith(tmp_prefix) or Path(path).parent.name.startswith(tmp_prefix)

    def after(func: Callable, when: Callable[..., bool], at: str) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = func(*args, **kwargs)
            if point == at and when(*args, **kwargs):
                _hit(action)
            return out
        return wrapped

    hub.save_weights = after(hub.save_weights, lambda weights, folder, *a, **k: ours(folder), "after-weights")
    torch.save = after(torch.save, lambda obj, f, *a, **k: ours(f) and Path(f).name == "optimizer.pt",
                       "after-optimizer")
    hub.write_json_atomic = after(hub.write_json_atomic,
                                  lambda path, *a, **k: ours(path) and Path(path).name == "trainer_state.json",
                                  "after-state")
    checkpoint.retire = after(checkpoint.retire, lambda run, folder: folder.name == final_name, "after-retire")
    real_replace = os.replace

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        into_place = Path(src).name.startswith(tmp_prefix) and Path(dst).name == final_name
        if into_place and point == "before-rename":
            _hit(action)
        pointing = Path(dst).name == "latest" and Path(src).read_text().strip() == final_name
        if point == "before-latest" and pointing:  # hub.write_text_atomic's rename of this step's pointer
            _hit(action)
        real_replace(src, dst, *args, **kwargs)
        if into_place and point == "after-rename":
            _hit(action)

    os.replace = replace
    RunDir.set_latest = after(RunDir.set_latest, lambda run, folder: folder.name == final_name, "after-latest")


def finetune_with_fault(config: Any, point: str, step: int, action: str = "kill") -> None:
    """A fork-server child's target: install the fault, then train."""
    from hfport.train.loop import finetune

    install(point, step, action)
    finetune(config, progress=False)


def finetune_noting_imports(config: Any, note: Path) -> None:
    """A fork-server child's target: train, then write the modules the run had to import (those the fork server
    had not preloaded) to `note`, one a line (tests/finetuning.py's check_resume_after_sigkill reads them)."""
    before = set(sys.modules)
    from hfport.train.loop import finetune

    finetune(config, progress=False)
    note.write_text("".join(f"{m}\n" for m in sorted(set(sys.modules) - before)))


if __name__ == "__main__":  # python -m tests.faults finetune ... : the CLI with the fault named by $HFPORT_TESTS_FAULT
    point, step, *rest = os.environ[ENV].split(":")
    install(point, int(step), *rest)
    from hfport.cli import main

    sys.argv = ["hfport", *sys.argv[1:]]
    main()
