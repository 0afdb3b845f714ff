"""The job runner: takes queued jobs from the store and runs each in its own process (server/jobrun.py), at most
settings.max_concurrent_jobs at a time. It lives in a thread of the web process; HTTP handlers only enqueue.

- cancel: the job's process group gets SIGTERM, then SIGKILL after cancel_grace_s; the job ends `cancelled`.
- a process that exits without writing a final status (killed, crashed) fails the job with its exit code.
- on start: queued jobs stay queued; running jobs whose process is gone (the server died) go back to the queue,
  and their next run resumes from the last checkpoint. A job process left over from the dead server is killed
  first, so one job never trains twice.
- on shutdown: running jobs are stopped and requeued, to resume on the next start.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .settings import Settings
from .store import Store

log = logging.getLogger("hfport.server.worker")

REPO_ROOT = Path(__file__).resolve().parent.parent


def job_processes(job_id: str) -> list[int]:
    """Pids of live `server.jobrun JOB_ID` processes (Linux /proc; empty elsewhere)."""
    found = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"server.jobrun" in argv and job_id.encode() in argv:
            found.append(int(entry.name))
    return found


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


class Worker:
    def __init__(self, settings: Settings, store: Store):
        self.settings, self.store = settings, store
        self.procs: dict[str, subprocess.Popen] = {}
        self.terminating: dict[str, float] = {}  # job id -> when SIGTERM was sent
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_lease_check = 0.0

    # --- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.recover()
        self._thread = threading.Thread(target=self._loop, name="hfport-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop taking jobs; stop the running ones and put them back in the queue to resume next start."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for job_id, proc in list(self.procs.items()):
            self._signal(proc, signal.SIGTERM)
        deadline = time.time() + timeout
        for job_id, proc in list(self.procs.items()):
            try:
                proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self._signal(proc, signal.SIGKILL)
                proc.wait()
            job = self.store.get_job(job_id)
            if job and job["status"] == "running":
                if job["cancel_requested"]:
                    self.store.finish(job_id, "cancelled")
                else:
                    self.store.requeue(job_id, "server stopped; the job resumes from its last checkpoint")
        self.procs.clear()

    def recover(self) -> None:
        """Running jobs from an earlier server: kill leftover processes, then requeue (they resume)."""
        for job in self.store.list_jobs(status="running", limit=10_000):
            for pid in job_processes(job["id"]):
                log.warning("job %s: killing process %d left over from an earlier server", job["id"], pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = time.time() + 10
            while job_processes(job["id"]) and time.time() < deadline:
                time.sleep(0.05)
            if job["cancel_requested"]:
                self.store.finish(job["id"], "cancelled")
            else:
                self.store.requeue(job["id"], "the server restarted; the job resumes from its last checkpoint")
                log.info("job %s requeued after a restart", job["id"])

    # --- the loop ---------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("worker tick failed")
            self._stop.wait(0.2)

    def tick(self) -> None:
        self._reap()
        self._cancel()
        self._check_leases()
        while len(self.procs) < self.settings.max_concurrent_jobs and not self._stop.is_set():
            job = self.store.claim_next()
            if job is None:
                break
            self._spawn(job)

    def _spawn(self, job: dict[str, Any]) -> None:
        log_dir = self.settings.runs_dir / job["id"]
        log_dir.mkdir(parents=True, exist_ok=True)
        args = ["-m", "server.jobrun", job["id"], "--data-dir", str(self.settings.data_dir),
                "--parent-pid", str(os.getpid()), "--heartbeat", str(self.settings.job_heartbeat_s)]
        gpus = gpu_count() if job["kind"] == "finetune" else 0
        if gpus > 1:  # one process per GPU, the same engine `accelerate launch hfport finetune` runs
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(gpus),
                   *args]
        else:
            cmd = [sys.executable, *args]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                           os.environ.get("PYTHONPATH")]))}
        with open(log_dir / "job.log", "ab") as logfile:
            proc = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True, cwd=str(self.settings.data_dir))
        self.procs[job["id"]] = proc
        self.store.set_pid(job["id"], proc.pid)
        log.info("job %s (%s) started as pid %d", job["id"], job["kind"], proc.pid)

    def _reap(self) -> None:
        for job_id, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.procs[job_id]
            self.terminating.pop(job_id, None)
            job = self.store.get_job(job_id)
            if job is None or job["status"] != "running":
                continue  # the job process wrote its final status itself
            if job["cancel_requested"]:
                self.store.finish(job_id, "cancelled")
            else:
                self.store.finish(job_id, "failed", error=f"the job process exited with code {code} without a "
                                                          f"result; see {self.settings.runs_dir / job_id / 'job.log'}"
                                                          f"{_tail(self.settings.runs_dir / job_id / 'job.log')}")

    def _cancel(self) -> None:
        now = time.time()
        for job in self.store.list_jobs(status="running", limit=10_000):
            proc = self.procs.get(job["id"])
            if proc is None or not job["cancel_requested"]:
                continue
            sent = self.terminating.get(job["id"])
            if sent is None:
                self._signal(proc, signal.SIGTERM)
                self.terminating[job["id"]] = now
            elif now - sent > self.settings.cancel_grace_s:
                self._signal(proc, signal.SIGKILL)

    def _check_leases(self) -> None:
        """A running job with no process here and a stale heartbeat is presumed dead: requeue it."""
        now = time.time()
        if now - self._last_lease_check < 5.0:
            return
        self._last_lease_check = now
        for job in self.store.list_jobs(status="running", limit=10_000):
            if job["id"] in self.procs:
                continue
            if now - (job["heartbeat_at"] or 0) > self.settings.job_lease_s and not job_processes(job["id"]):
                self.store.requeue(job["id"], "lease expired; the job resumes from its last checkpoint")

    @staticmethod
    def _signal(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # the job and, under accelerate launch, its ranks
        except (ProcessLookupError, PermissionError):
            pass


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return (":\n" + "\n".join(text)) if text else ""
