"""The job runner: takes queued jobs from the store and runs each in its own process (server/jobrun.py), at most
settings.max_concurrent_jobs at a time. It lives in a thread of the web process (role `all`) or alone in a worker
process (role `worker`, `run_worker` below); HTTP handlers only enqueue. Any number of workers, on any hosts, may
share one PostgreSQL store.

- identity: a worker claims its id (HFPORT_WORKER_ID, default hostname-pid) in the `workers` table and heartbeats
  it; a second worker with the id of a live one is refused at start (DuplicateWorker, naming the holder).
- leases: a claim makes this worker the job's lease holder (jobs.worker_id) and bumps jobs.attempts, the fencing
  token; the job process renews the lease for that attempt only, every write it makes is fenced by it, and it kills
  itself before the lease can run out unrenewed (server/fence.py). A running job whose heartbeat is older than
  job_lease_s BY THE DATABASE'S CLOCK is presumed dead and requeued by whichever worker notices first; its next
  run resumes from the last checkpoint. A worker that finds one of its own jobs taken from it (it was silent too
  long) kills that job's process: the newer attempt owns the job, and the old one can no longer write to it. A job
  process of this worker that stops renewing while alive (hung) is killed and requeued.
- liveness is progress: a fine-tune with no step progress within job_stall_s stops itself (exit STALLED) and is
  requeued with the reason; one that lost or could not renew its lease (exit FENCED) is requeued too.
- cancel: the worker holding a job polls its cancel_requested flag, so a cancel sent to any API process reaches a
  job on any host: SIGTERM to the process group, SIGKILL after CANCEL_GRACE_S; the job ends `cancelled`.
- a process that exits without writing a final status (killed, crashed) fails the job with its exit code.
- on start: jobs held by this worker id, by nobody, or by a dead worker process of this host (a server killed and
  restarted) go back to the queue at once; a job process left over from it is killed first, so one job never
  trains twice. Jobs of workers elsewhere are left to the lease rule.
- on shutdown: running jobs are stopped and requeued, to resume on the next start (on any worker).
- a database outage: logged once, retried with backoff, logged again when it answers.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hfport.settings import Settings as LibrarySettings
from hfport.settings import settings as library_settings

from . import uploads
from .fence import FENCED, LAUNCHER, STALLED
from .launch import free_port
from .settings import Settings
from .store import BaseStore, StoreUnavailable, duplicate_worker_error

log = logging.getLogger("hfport.server.worker")

REPO_ROOT = Path(__file__).resolve().parent.parent
CANCEL_GRACE_S = 5.0  # SIGTERM to SIGKILL when cancelling: a job process exits at once on SIGTERM (server/jobrun.py),
# so this only covers one that is stuck


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


def job_process_count(settings: Settings, kind: str, job: dict[str, Any] | None = None) -> int:
    """How many processes a job of this kind runs: a fine-tune JOB as many as its first attempt ran (its progress's
    num_processes, which server.jobrun records), so a requeued job resumes as the same run on any worker (batch_size
    is per process: with another count, the resume is refused); else HFPORT_JOB_PROCESSES (auto: one per visible
    GPU, else 1). An export is one process."""
    if kind != "finetune":
        return 1
    started = ((job or {}).get("progress") or {}).get("num_processes")
    if started is not None:
        return int(started)
    return max(1, gpu_count()) if settings.job_processes == "auto" else settings.job_processes


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Worker:
    def __init__(self, settings: Settings, store: BaseStore, verbosity: str | None = None):
        """verbosity: the level job processes log at, given to each in its environment (the server's resolved level:
        `serve -q` or `-vv` over HFPORT_VERBOSITY); None: they read HFPORT_VERBOSITY as this process has it."""
        self.settings, self.store, self.verbosity = settings, store, verbosity
        self.id, self.host, self.pid = settings.worker_id, socket.gethostname(), os.getpid()
        self.procs: dict[str, subprocess.Popen] = {}
        self.attempts: dict[str, int] = {}  # job id -> the attempt (fencing token) this worker runs
        self.terminating: dict[str, float] = {}  # job id -> when SIGTERM was sent
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_lease_check = 0.0
        self._last_beat = 0.0
        self._last_sweep = -float("inf")  # the first tick sweeps
        self._outage: float | None = None  # when the database stopped answering (None: it answers)

    # --- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.register()
        self.recover()
        self._thread = threading.Thread(target=self._loop, name="hfport-worker", daemon=True)
        self._thread.start()
        log.info("worker %s started (up to %d job(s) at once; lease %.0f s)", self.id,
                 self.settings.max_concurrent_jobs, self.settings.job_lease_s)

    def register(self) -> None:
        """Claim this worker's id; DuplicateWorker while another live worker holds it. A row left by a dead process
        of this host under the same id (a restart that kept the id) is taken over."""
        holder = self.store.register_worker(self.id, self.host, self.pid, self.settings.job_lease_s)
        if holder is not None:
            if holder["host"] == self.host and (holder["pid"] == self.pid or not pid_alive(holder["pid"])):
                self.store.register_worker(self.id, self.host, self.pid, self.settings.job_lease_s, take_over=True)
            else:
                raise duplicate_worker_error(holder)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop taking jobs; stop the running ones and put them back in the queue to resume (on any worker)."""
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
            try:
                job = self.store.get_job(job_id)
                if job and job["status"] == "running" and job["worker_id"] == self.id:
                    if job["cancel_requested"]:
                        self.store.finish(job_id, "cancelled", attempt=self.attempts.get(job_id))
                    else:
                        self.store.requeue(job_id, "server stopped; the job resumes from its last checkpoint",
                                           worker_id=self.id)
            except StoreUnavailable as e:
                log.warning("job %s: not requeued at shutdown (%s); the lease rule will requeue it", job_id, e)
        self.procs.clear()
        try:
            self.store.unregister_worker(self.id, self.pid)
        except StoreUnavailable:
            pass

    def recover(self) -> None:
        """Jobs left running by this worker id, by nobody, or by a dead worker process of this host: kill leftover
        processes, then requeue (they resume)."""
        dead = [w for w in self.store.workers_on(self.host) if w["id"] != self.id
                and (w["pid"] == self.pid or not pid_alive(w["pid"]))]
        jobs = self.store.running_for(self.id, include_unowned=True)
        for other in dead:
            jobs += self.store.running_for(other["id"])
        for job in jobs:
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
                self.store.finish(job["id"], "cancelled", attempt=job["attempts"])
            elif self.store.requeue(job["id"], "the server restarted; the job resumes from its last checkpoint",
                                    worker_id=job["worker_id"]):
                log.info("job %s requeued after a restart", job["id"])
        for other in dead:
            self.store.unregister_worker(other["id"], other["pid"])

    # --- the loop ---------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        delay = 0.2
        while not self._stop.is_set():
            try:
                self.tick()
                if self._outage is not None:
                    log.warning("the job store answers again (after %.0f s)", time.monotonic() - self._outage)
                    self._outage, delay = None, 0.2
            except StoreUnavailable as e:
                if self._outage is None:  # once per outage, not once per tick
                    self._outage = time.monotonic()
                    log.warning("the job store does not answer (%s); retrying with backoff", e)
                delay = min(delay * 2, 5.0)
            except Exception:
                log.exception("worker tick failed")
            self._stop.wait(delay if self._outage is not None else 0.2)

    def tick(self) -> None:
        self._beat()
        self._reap()
        self._sweep_uploads()
        self._sync_held()
        self._check_leases()
        while len(self.procs) < self.settings.max_concurrent_jobs and not self._stop.is_set():
            job = self.store.claim_next(self.id, self.settings.job_start_grace_s)
            if job is None:
                break
            self._spawn(job)

    def _beat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat < self.settings.job_heartbeat_s:
            return
        self._last_beat = now
        if not self.store.worker_beat(self.id, self.pid):
            # our row is gone or another process holds the id: claim it back if free, else stop taking jobs
            try:
                self.register()
            except Exception as e:  # noqa: BLE001 - DuplicateWorker: the message names the holder
                log.error("%s; this worker stops taking jobs", e)
                self._stop.set()

    def _sweep_uploads(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep < uploads.SWEEP_S:
            return
        self._last_sweep = now
        uploads.sweep(self.store, self.settings.uploads_dir, uploads.GRACE_S)

    def _spawn(self, job: dict[str, Any]) -> None:
        log_dir = self.settings.runs_dir / job["id"]
        log_dir.mkdir(parents=True, exist_ok=True)
        cmd = self._command(job)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                           os.environ.get("PYTHONPATH")])),
               # the cache this process uses: a relative HFPORT_CACHE_DIR would name another folder from the job's
               # working directory (the data dir), and the job's int8 verdicts and hardware.json would not be shared
               LibrarySettings.env_name("cache_dir"): str(library_settings().cache_dir.absolute())}
        if self.verbosity is not None:  # the environment reaches every rank of an `accelerate launch` too
            env[LibrarySettings.env_name("verbosity")] = self.verbosity
        if self.settings.database_url:  # in the environment, not argv: a password stays out of `ps`
            env["HFPORT_DATABASE_URL"] = self.settings.database_url
        with open(log_dir / "job.log", "ab") as logfile:
            logfile.write(f"--- attempt {job['attempts']} on worker {self.id}\n".encode())
            logfile.flush()
            proc = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True, cwd=str(self.settings.data_dir))
        self.procs[job["id"]] = proc
        self.attempts[job["id"]] = job["attempts"]
        self.store.set_pid(job["id"], proc.pid, attempt=job["attempts"])
        log.info("job %s (%s) attempt %d started as pid %d (%d process(es))", job["id"], job["kind"],
                 job["attempts"], proc.pid, job_process_count(self.settings, job["kind"], job))

    def _command(self, job: dict[str, Any]) -> list[str]:
        """The job's command line. server.fence renews the lease before the engine is imported, then runs
        server.jobrun (job_processes finds it by "server.jobrun" and the job id in its argv). More than one
        process: the same engine under `accelerate launch` (what `accelerate launch -m hfport finetune` runs),
        started through server.fence --exec-under so the launcher dies with this worker, and its ranks with it."""
        args = ["-m", "server.fence", "server.jobrun", job["id"], "--data-dir", str(self.settings.data_dir),
                "--parent-pid", str(os.getpid()), "--heartbeat", str(self.settings.job_heartbeat_s),
                "--attempt", str(job["attempts"]), "--lease-s", str(self.settings.job_lease_s),
                "--lease-margin-s", str(self.settings.lease_margin_s), "--stall-s", str(self.settings.job_stall_s)]
        n = job_process_count(self.settings, job["kind"], job)
        if n == 1:
            return [sys.executable, *args]
        # --multi_gpu is torch elastic's launcher on the CPU too: the engine's Accelerator(cpu=True) picks gloo
        # there (accelerate's --cpu runs one process); a port of its own, so two jobs on one host do not collide
        launch = [sys.executable, "-m", LAUNCHER, "--multi_gpu", "--num_processes", str(n), "--num_machines", "1",
                  "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no"]
        return [sys.executable, "-m", "server.fence", "--exec-under", str(os.getpid()), "--", *launch, *args]

    def _mine(self, job: dict[str, Any] | None) -> bool:
        """The job is running under this worker's lease, for the attempt this worker started."""
        return (job is not None and job["status"] == "running" and job["worker_id"] == self.id
                and job["attempts"] == self.attempts.get(job["id"]))

    def _forget(self, job_id: str) -> None:
        self.procs.pop(job_id, None)
        self.attempts.pop(job_id, None)
        self.terminating.pop(job_id, None)

    def _reap(self) -> None:
        for job_id, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            attempt = self.attempts.get(job_id)
            job = self.store.get_job(job_id)
            self._forget(job_id)
            if not (job is not None and job["status"] == "running" and job["worker_id"] == self.id
                    and job["attempts"] == attempt):
                continue  # the job process wrote its final status itself, or the job is another attempt's now
            if job["cancel_requested"]:
                self.store.finish(job_id, "cancelled", attempt=attempt)
            elif (why := self._requeue_reason(job, code)) is not None:
                if self.store.requeue(job_id, why, worker_id=self.id, attempt=attempt):
                    log.warning("job %s: %s", job_id, why)
            else:
                self.store.finish(job_id, "failed", attempt=attempt,
                                  error=f"the job process exited with code {code} without a result; see "
                                        f"{self.settings.runs_dir / job_id / 'job.log'}"
                                        f"{_tail(self.settings.runs_dir / job_id / 'job.log')}")

    def _requeue_reason(self, job: dict[str, Any], code: int) -> str | None:
        """Why a job process that ended without a result goes back to the queue (None: it failed)."""
        last = self.store.events_after(job["id"], max(0, job["event_seq"] - 1))
        if code == STALLED or (last and last[-1][1].get("type") == "stalled"):  # under accelerate: the launcher's code
            return (f"no step progress within {self.settings.job_stall_s:g} s (HFPORT_JOB_STALL_S): attempt "
                    f"{job['attempts']} was killed; the job resumes from its last checkpoint")
        if code == FENCED or self._renewed_nothing_for_the_budget(job):
            return (f"attempt {job['attempts']} could not renew its lease in time and stopped itself; the job resumes "
                    f"from its last checkpoint")
        return None

    def _renewed_nothing_for_the_budget(self, job: dict[str, Any]) -> bool:
        """No renewal of the job landed for the fence's budget (the lease minus the margin, by the database clock):
        its watchdog stopped it (server/fence.py). Under `accelerate launch` rank 0's exit code FENCED reaches this
        worker as the launcher's 1, so the lease says it instead; a crash renews up to its end and is not taken
        for it (unless this worker could only reap it after an outage that long: then the job runs again)."""
        budget = self.settings.job_lease_s - self.settings.lease_margin_s
        return any(j["id"] == job["id"] for j in self.store.stale_running(budget))

    def _sync_held(self) -> None:
        """For the jobs this worker runs: pass on a cancel request (sent to any API process), and kill a job whose
        lease was taken from this worker."""
        if not self.procs:
            return
        held = {j["id"]: j for j in self.store.running_for(self.id)}
        now = time.time()
        for job_id, proc in list(self.procs.items()):
            job = held.get(job_id)
            if job is None or job["attempts"] != self.attempts.get(job_id):
                current = self.store.get_job(job_id)
                if current is not None and current["status"] in ("succeeded", "failed", "cancelled"):
                    continue  # it finished itself; _reap collects the process
                log.warning("job %s: the lease of attempt %s was lost (the job is %s now); stopping its process",
                            job_id, self.attempts.get(job_id), current and current["status"])
                self._signal(proc, signal.SIGKILL)
                proc.wait()
                self._forget(job_id)
                continue
            if not job["cancel_requested"]:
                continue
            sent = self.terminating.get(job_id)
            if sent is None:
                self._signal(proc, signal.SIGTERM)
                self.terminating[job_id] = now
            elif now - sent > CANCEL_GRACE_S:
                self._signal(proc, signal.SIGKILL)

    def _check_leases(self) -> None:
        """A running job whose heartbeat is older than the lease (by the database clock), not run here and with no
        process on this host, is presumed dead: requeue it (conditionally: one worker wins if several notice)."""
        now = time.monotonic()
        if now - self._last_lease_check < min(5.0, self.settings.job_lease_s / 2):
            return
        self._last_lease_check = now
        for job in self.store.stale_running(self.settings.job_lease_s):
            proc = self.procs.get(job["id"])
            if proc is not None and self._mine(job):  # alive but silent (hung): it cannot be trusted to stop itself
                self._signal(proc, signal.SIGKILL)
                proc.wait()
                self._forget(job["id"])
                if self.store.requeue(job["id"], "the job process stopped renewing its lease (hung); killed, the "
                                      "job resumes from its last checkpoint", worker_id=self.id,
                                      attempt=job["attempts"]):
                    log.warning("job %s: its process stopped renewing its lease; killed and requeued", job["id"])
                continue
            if proc is not None or job_processes(job["id"]):
                continue
            moved = self.store.requeue(job["id"], "lease expired; the job resumes from its last checkpoint",
                                       stale_after=self.settings.job_lease_s)
            if moved:  # 'cancelled' when a cancel was requested while the dead worker held it
                log.warning("job %s: lease of worker %s expired; %s", job["id"], job["worker_id"],
                            "requeued" if moved == "queued" else moved)

    @staticmethod
    def _signal(proc: subprocess.Popen, sig: int) -> None:
        try:
            # the job and its children; under accelerate launch, the launcher, which passes SIGTERM on to its
            # ranks (each in a session of its own) and whose death (SIGKILL) kills them (die_with_parent)
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def run_worker(settings: Settings, store: BaseStore, verbosity: str | None = None) -> None:
    """Role `worker`: the worker loop alone, no HTTP, until SIGTERM or SIGINT (then running jobs are requeued)."""
    worker = Worker(settings, store, verbosity=verbosity)
    worker.start()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(0.5):
        if worker._stop.is_set():  # it gave up its id (another process took it over)
            break
    worker.stop()
    store.close()


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return (":\n" + "\n".join(text)) if text else ""
