"""The checkpoint fault matrix: a run SIGKILLed at every step of a checkpoint save, and of a re-save of a step that
already exists (a run resumed from an older checkpoint), resumes from a complete checkpoint, never finds `latest`
naming an incomplete folder, and ends bit-identical to an uninterrupted run. The kill points are injected by the
test fixture tests/faults.py, around the calls the writer makes; the production code has no hook."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hfport.rundir import TRAINER_STATE, RunDir
from tests.finetuning import base_config, model_lines
from tests.forked import start_child

CHECKPOINT_FILES = {"model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "rng.pt", TRAINER_STATE}
def _child(target, *args) -> int | None:
    """target(*args) in a fork-server child (tests/forked.py's start_child); its exit code."""
    child = start_child(target, *args)
    child.join(300)
    return child.exitcode


def _config(workdir: Path, out: Path, **kw):
    # save_total_limit 3 keeps step-2 for the re-save cases to resume from
    return base_config(workdir, out, max_steps=6, batch_size=8, save_steps=2, save_total_limit=3, eval=None, **kw)


def _train(config) -> int:
    from hfport.train.loop import finetune

    return _child(finetune, config)


def _killed(config, point: str, step: int) -> None:
    from tests.faults import finetune_with_fault

    assert _child(finetune_with_fault, config, point, step) == -9, f"{point} at step {step} was never reached"


def _assert_consistent(out: Path, where: str) -> None:
    """Every step-N folder is whole; `latest` names a whole one or none; resume finds a whole one."""
    run = RunDir(out)
    for step in run.checkpoint_steps():
        files = {p.name for p in run.checkpoint(step).iterdir()}
        assert CHECKPOINT_FILES <= files, f"{where}: step-{step} is incomplete: {sorted(files)}"
    if run.latest_pointer.is_file():
        named = run.checkpoints / run.latest_pointer.read_text().strip()
        assert not named.exists() or CHECKPOINT_FILES <= {p.name for p in named.iterdir()}, \
            f"{where}: latest names the incomplete {named.name}"
    point = run.resume_point()
    assert point is not None and CHECKPOINT_FILES <= {p.name for p in point.checkpoint.iterdir()}, where


def _assert_same_run(out: Path, ref: Path, where: str) -> None:
    assert model_lines((out / "metrics.jsonl").read_text()) == model_lines((ref / "metrics.jsonl").read_text()), where
    a, b = load_file(str(out / "final" / "model.safetensors")), load_file(str(ref / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{where}: final weights differ"
    # the resumed run swept what the killed one left half-written (a checkpoint folder, `latest`'s temporary file)
    left = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    assert not left, f"{where}: left behind {left}"


@pytest.fixture(scope="module")
def reference(workdir, tmp_path_factory) -> Path:
    ref = tmp_path_factory.mktemp("faults") / "ref"
    assert _train(_config(workdir, ref)) == 0
    return ref


@pytest.mark.parametrize("point", ["after-weights", "after-optimizer", "after-state", "before-rename",
                                   "after-rename", "before-latest", "after-latest"])
def test_kill_during_a_save(workdir, reference, tmp_path, point):
    out = tmp_path / "run"
    _killed(_config(workdir, out), point, 4)
    _assert_consistent(out, f"killed {point} of step 4's save")
    assert _train(_config(workdir, out, resume="latest")) == 0
    _assert_same_run(out, reference, f"killed {point} of step 4's save, resumed")


@pytest.mark.parametrize("point", ["after-weights", "after-state", "after-retire", "before-rename", "after-rename",
                                   "before-latest", "after-latest"])
def test_kill_during_a_resave(workdir, reference, tmp_path, point):
    out = tmp_path / "run"
    shutil.copytree(reference, out)  # a finished run with step-2, step-4 and step-6
    older = str(RunDir(out).checkpoint(2))
    _killed(_config(workdir, out, resume=older), point, 4)  # resumed from step 2, killed re-saving step 4
    _assert_consistent(out, f"killed {point} of step 4's re-save")
    assert _train(_config(workdir, out, resume="latest")) == 0
    _assert_same_run(out, reference, f"killed {point} of step 4's re-save, resumed")


def test_a_resume_sweeps_the_killed_runs_leftovers_before_training(workdir, reference, tmp_path):
    """A killed save's half-written files (of the names this run's writers use, in its checkpoints folder) are gone
    when the resumed run's first step is logged, before any save of its own; other names stay."""
    from hfport.train.loop import finetune

    out = tmp_path / "run"
    shutil.copytree(reference, out)
    checkpoints = out / "checkpoints"
    ours = [".tmp-step-6-4242", ".old-step-2-4242", ".latest.0123456789ab.tmp"]  # folder, folder, file
    theirs = [".latest.tmp", ".tmp-step-6-notes", "notes.txt"]  # not the writers' names: not this run's to remove
    for name in ours[:2]:
        (checkpoints / name).mkdir()
        (checkpoints / name / "model.safetensors").write_bytes(b"half")
    for name in [*ours[2:], *theirs]:
        (checkpoints / name).write_text("step-")
    seen: list[set[str]] = []

    def first_step(event: dict) -> None:
        if not seen and event.get("step") == 5:
            seen.append({p.name for p in checkpoints.iterdir()})

    finetune(_config(workdir, out, resume=str(RunDir(out).checkpoint(4))), progress=False, on_event=first_step)
    assert seen, "no event at step 5"
    assert not set(ours) & seen[0] and set(theirs) <= seen[0], sorted(seen[0])
