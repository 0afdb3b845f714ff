"""Fencing inside the job process (server/fence.py), without root: a fine-tune that hangs is killed and requeued
by the stall rule, saying why; a job process whose database stops answering (a loopback TCP relay that goes
silent, as a cut link does: no reset, no error) kills itself before its lease can run out by the database clock,
and nothing of it lands afterwards. The real network partition (ip netns) is tests/test_partition.py.

The hang lives here, in the tests: the job process is started through a wrapper (written by the fixture) that
replaces hfport.finetune, in that child only (after the fence started, as in production), with one that reports
step 1 and then sleeps."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from server.fence import FENCED, Fence
from server.settings import Settings
from server.store import Lease, open_store
from server.worker import REPO_ROOT, Worker
from tests.pgserver import fresh_db_name, pg_server  # noqa: F401 - the session fixture
from tests.test_chaos import build_inputs, job_config


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, minilm_path) -> tuple[Path, Path]:
    return build_inputs(tmp_path_factory.mktemp("fence-inputs"), minilm_path)


HANG = """import sys, time

import hfport
from server import fence


def finetune(config, progress=False, on_event=None):
    on_event({"type": "train", "step": 1, "epoch": 0.1, "loss": 1.0})
    time.sleep(3600)


hfport.finetune = finetune  # in this child only: the job module server.fence runs finds this engine
sys.exit(fence.main(sys.argv[sys.argv.index("server.jobrun"):]))
"""


@pytest.fixture
def hanging(tmp_path, monkeypatch) -> Path:
    """An executable the worker runs instead of the interpreter: `python -m server.fence server.jobrun ARGS` runs the
    real fence and jobrun over the hanging engine."""
    script, wrapper = tmp_path / "hang_jobrun.py", tmp_path / "python-hang"
    script.write_text(HANG)
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr("server.worker.sys.executable", str(wrapper))
    return wrapper


def hanging_config(inputs: tuple[Path, Path], folder: Path) -> dict:
    return {**job_config(inputs[1], 20, 5), "model": str(inputs[0]), "output_dir": str(folder / "run")}


def test_a_hung_finetune_is_killed_and_requeued_saying_why(inputs, hanging, tmp_path):
    settings = Settings(data_dir=tmp_path / "data", job_stall_s=2.0, job_lease_s=30.0)
    store = open_store(settings.db_path)
    worker = Worker(settings, store)
    job = store.create_job("finetune", hanging_config(inputs, tmp_path))
    worker.register()
    try:
        worker.tick()  # claims the job and starts its process
        assert job["id"] in worker.procs
        deadline = time.time() + 120
        while time.time() < deadline and store.get_job(job["id"])["status"] == "running":
            worker._reap()  # (not tick: it would claim the requeued job again at once)
            time.sleep(0.2)
        done = store.get_job(job["id"])
        log = (settings.runs_dir / job["id"] / "job.log").read_text(errors="replace")
        assert done["status"] == "queued" and done["attempts"] == 1, (done, log[-3000:])
        events = [e for _, e in store.events_after(job["id"])]
        stalled = [e for e in events if e["type"] == "stalled"]
        assert [e["step"] for e in events if e["type"] == "train"] == [1]  # progress, then nothing
        assert len(stalled) == 1 and stalled[0]["stall_s"] == 2.0 and stalled[0]["idle_s"] >= 2.0, events
        requeued = events[-1]
        assert requeued["status"] == "queued" and "no step progress within 2 s (HFPORT_JOB_STALL_S)" in \
            requeued["reason"], requeued
        assert "no step progress for" in log and "exit 76" in log, log[-3000:]
        assert not worker.procs  # its process is gone
        # the lease was not renewed after the stall was noticed
        assert done["heartbeat_at"] <= stalled[0]["time"] + 0.01, (done["heartbeat_at"], stalled[0]["time"])
    finally:
        worker.stop()
        store.close()


class SilentLink:
    """A TCP relay on loopback to `target`; `cut()` makes it stop forwarding in both directions without closing
    anything: the client's packets vanish, as on a cut cable (no reset, no error)."""

    def __init__(self, target: tuple[str, int]):
        self.target, self.open = target, threading.Event()
        self.open.set()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        while True:
            ready, _, _ = select.select([a, b], [], [], 0.1)
            if not self.open.is_set():
                time.sleep(0.05)
                continue  # held, never delivered
            for src in ready:
                data = src.recv(65536)
                if not data:
                    a.close(), b.close()
                    return
                (b if src is a else a).sendall(data)

    def cut(self) -> None:
        self.open.clear()

    def close(self) -> None:
        self.server.close()


def test_a_job_cut_off_from_the_database_dies_before_its_lease_runs_out(pg_server, inputs, hanging,
                                                                            tmp_path):  # noqa: F811
    url = pg_server.create_database(fresh_db_name())
    store = open_store(url)
    link = SilentLink(("127.0.0.1", pg_server.port))
    lease_s, margin_s = 4.0, 0.8
    job = store.create_job("finetune", {**hanging_config(inputs, tmp_path), "max_steps": 20})
    claimed = store.claim_next("w-cut", start_grace_s=30.0)  # as the worker does: covers the process's start
    proc = subprocess.Popen(
        [str(hanging), "-m", "server.fence", "server.jobrun", job["id"], "--data-dir", str(tmp_path), "--attempt",
         str(claimed["attempts"]), "--heartbeat", "0.3", "--lease-s", str(lease_s), "--lease-margin-s",
         str(margin_s)],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT),
             "HFPORT_DATABASE_URL": url.replace(f":{pg_server.port}/", f":{link.port}/")},
        stdout=open(tmp_path / "job.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)  # noqa: SIM115
    try:
        first = store.get_job(job["id"])["heartbeat_at"]
        deadline = time.time() + 120
        while store.get_job(job["id"])["heartbeat_at"] == first and time.time() < deadline:  # it renews
            assert proc.poll() is None, (tmp_path / "job.log").read_text()
            time.sleep(0.1)
        time.sleep(1.0)
        link.cut()
        cut_at = time.time()
        proc.wait(timeout=lease_s + 10)
        died_at = time.time()
        last = store.get_job(job["id"])
        log = (tmp_path / "job.log").read_text(errors="replace")
        assert proc.returncode == FENCED, log[-3000:]
        assert "no lease renewal of job" in log and "succeeded for 3.2 s" in log, log[-3000:]
        # dead before the database clock lets anyone take the job: the lease (from the last renewal that landed)
        # has not run out when the process is already gone
        assert died_at < last["heartbeat_at"] + lease_s, (cut_at, died_at, last["heartbeat_at"])
        assert store.db_now() - last["heartbeat_at"] < lease_s + 1.0
        time.sleep(lease_s)
        assert store.get_job(job["id"])["heartbeat_at"] == last["heartbeat_at"]  # nothing renewed it since
        assert store.requeue(job["id"], "lease expired", stale_after=lease_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        link.close()
        store.close()


def test_fencing_settings(tmp_path):
    """Defaults: a generous stall limit (30 min), a 30 s lease and, derived from it, 2 s heartbeats, a margin of a
    fifth of the lease, a start grace of one lease; a shorter lease shortens them all, so the margin always leaves
    a lease (the fence's check never trips)."""
    settings = Settings(data_dir=tmp_path)
    assert settings.job_stall_s == 1800 and settings.job_lease_s == 30
    assert (settings.job_heartbeat_s, settings.lease_margin_s, settings.job_start_grace_s) == pytest.approx((2, 6, 30))
    short = Settings(data_dir=tmp_path, job_lease_s=3)
    assert (short.job_heartbeat_s, short.lease_margin_s, short.job_start_grace_s) == pytest.approx((0.2, 0.6, 3))
    watch = Fence(None, Lease("j", 1, short.job_lease_s), heartbeat_s=short.job_heartbeat_s,
                  margin_s=short.lease_margin_s)  # refuses a margin that leaves no lease
    assert watch.budget_s == pytest.approx(2.4) and watch.every_s == pytest.approx(0.2)
