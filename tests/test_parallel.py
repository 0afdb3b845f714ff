"""The suite's xdist plumbing (tests/parallel.py, conftest's hooks), in a small pytest run of its own on two workers:
a folder built_once is built once a run and every worker reads the same one; the parity grid each worker records
reaches the controller, which prints it (before, the grid of a run on workers was empty: only the controller's own
tests, none, recorded into it); a worker takes its share of the cores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import parallel

REPO = Path(__file__).resolve().parent.parent

# two files (one a worker under --dist loadfile; NAME: a or b), each using the shared folder and recording a
# grid cell
INNER = '''
import os
import pytest
from tests import grid, parallel


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    def build(folder):
        with open(os.environ["BUILDS"], "a") as log:
            log.write(f"{os.environ['PYTEST_XDIST_WORKER']}\\n")
        (folder / "made").write_text(str(folder))
    return parallel.built_once(tmp_path_factory, "shared", build)


def test_NAME(shared):
    grid.record("family-NAME", "base", 1e-7)
    assert (shared / "made").read_text() == str(shared)
    with open(os.environ["SEEN"], "a") as log:
        log.write(f"{shared}\\n")
    assert parallel.workers() == 2 and parallel.core_share() == max(1, (os.cpu_count() or 1) // 2)
'''


def test_two_workers_build_once_and_the_grid_comes_back(tmp_path):
    inner = tmp_path / "inner"
    inner.mkdir()
    for name in ("a", "b"):
        (inner / f"test_{name}.py").write_text(INNER.replace("NAME", name))
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST_")}  # not ours
    env |= {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "BUILDS": str(tmp_path / "builds"), "SEEN": str(tmp_path / "seen")}
    # conftest's parity grid hooks (tests/grid.py's) as a plugin, in a run whose rootdir is the inner folder
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.grid", "-n", "2", "--dist", "loadfile",
                           "-p", "no:cacheprovider", "-q", "--basetemp", str(tmp_path / "base"), str(inner)],
                          cwd=inner, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len((tmp_path / "builds").read_text().split()) == 1  # one worker built it
    seen = (tmp_path / "seen").read_text().split()
    assert len(seen) == 2 and len(set(seen)) == 1, seen  # both tests read that one folder
    grid = done.stdout.split("parity grid")[-1]
    assert "parity grid" in done.stdout and "family-a" in grid and "family-b" in grid, done.stdout[-3000:]


def test_without_xdist_one_process_takes_every_core(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert parallel.workers() == 1 and parallel.core_share() == (os.cpu_count() or 1)
