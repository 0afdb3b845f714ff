"""The suite on pytest-xdist's workers (pyproject's addopts: `-n 2 --dist loadfile`, a file's tests on one worker):
each worker is a process of its own, with its own session fixtures, that runs beside the others on the same cores.

workers()       how many workers this run has (1 without xdist, or with `-n 0`)
core_share()    the cores one worker may keep busy: what a test that wants "every core" takes (conftest's all_cores)
once(...)       an action run once per run, however many workers ask for it (conftest's ddp_runs)
built_once(...) a folder built once per run (conftest's ddp_root)
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def workers() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def core_share() -> int:
    """os.cpu_count() split between the workers (at least 1): two workers that each took every core would keep
    twice as many threads busy as there are cores, each thread waiting for the others."""
    return max(1, (os.cpu_count() or 1) // workers())


def once(tmp_path_factory: pytest.TempPathFactory, name: str, action: Callable[[], None]) -> None:
    """`action()`, once per run. Without xdist, now. Under xdist the first worker to ask runs it under a file lock in
    the run's folder (the parent of every worker's basetemp), a worker that asks meanwhile waits for the lock, and
    every later one goes on at once (an action that raised leaves no `.done` mark: the next worker to ask runs it
    again, and fails the same way)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        action()
        return
    from filelock import FileLock  # huggingface_hub's dependency

    run = tmp_path_factory.getbasetemp().parent  # /tmp/pytest-of-<user>/pytest-<N>: this run's, every worker's
    with FileLock(str(run / f"{name}.lock")):
        if not (run / f"{name}.done").exists():
            action()
            (run / f"{name}.done").touch()


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """A folder that `build(folder)` fills, once per run (`once`): without xdist a fresh folder of this session's,
    under xdist NAME in the run's folder, the same one for every worker."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    folder = tmp_path_factory.getbasetemp().parent / name

    def make() -> None:
        shutil.rmtree(folder, ignore_errors=True)  # what a build that raised left
        folder.mkdir()
        build(folder)

    once(tmp_path_factory, name, make)
    return folder
