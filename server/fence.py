"""Self-fencing of a job process: it stops writing (to the database AND the shared run folder) before another worker
can take its job over.

The database half is enforced by the store: every write carries the attempt's Lease and lands only while that
attempt holds the job by the database clock (server/store/base.py). The run folder has no such guard, so the job
process guards it by dying in time. `Fence` runs two threads in the job process (rank 0):

- the renewer sends a lease renewal every `heartbeat_s` (at most a third of the budget below). It remembers, on
  its own monotonic clock, the moment it SENT the last renewal that succeeded (t0). A refused renewal (the lease is
  lost) kills the process at once; a database error is logged and retried.
- the watchdog kills the process (SIGKILL to the other processes of its process group: its ranks and children,
  then os._exit) as soon as its monotonic clock passes t0 + (lease_s - margin_s). It never waits on the database,
  so a renewal hanging on a cut network link cannot delay it.

Why no write of this attempt follows the loss of its lease. Let D(t) be the database clock's reading at real time
t. The database stamped the renewal heartbeat_at = H when it executed it, after it was sent: H >= D(t0). Another
worker can only take the job after requeueing it, and requeue is conditional in SQL on D(now) - heartbeat_at >
lease_s, so the takeover starts at a real time T with D(T) > H + lease_s >= D(t0) + lease_s. The watchdog fires
when this process's clock has advanced lease_s - margin_s past t0 and the process is gone k seconds later (k: the
thread's wake-up latency plus the kill, milliseconds). If the two clocks' rates differ by at most a factor
(1 + rho), this process is dead at real time t0 + (lease_s - margin_s)(1 + rho) + k, before T whenever
margin_s > rho * lease_s + k (1 + rho) — in words: the margin covers the rate difference over one lease plus the
time to die. So every write the process made, to the database or to the run folder, happened before any other
attempt existed; and whatever it sends later, the database refuses.

Assumptions: (1) clock RATES agree within rho (offsets do not matter: each side only measures intervals on its own
clock); quartz drifts ~1e-4, so the default margin (a fifth of the lease) leaves seconds for k. (2) The process is
not frozen (SIGSTOP, a paused VM, a swap storm) for longer than the margin: a frozen watchdog cannot fire, and the
training thread would resume first. (3) A write() that returned before the kill is visible to the next attempt (a
local file system, or a network one without a client-side write-back delay that outlives the process).

Start-up: `python -m server.jobrun` imports the whole engine (seconds, more on a loaded host) before it could
renew anything, and a lease shorter than that would run out between the claim and the first renewal. So the worker
starts `python -m server.fence server.jobrun JOB ARGS`: this module's `main` (light: the store only) renews at once
and starts the threads, and then imports and runs server.jobrun with the fence it holds.

Parent death: every process of a job dies with the worker that started it, kill -9 included (PR_SET_PDEATHSIG,
die_with_parent). A multi-process job (HFPORT_JOB_PROCESSES) runs under `accelerate launch`, whose ranks are
the launcher's children, each in a session of its own: the worker starts the launcher through `--exec-under`
(exec_with_parent_death), so the launcher dies with the worker, and each rank dies with the launcher. Rank 0 holds
the fence; when it stops itself, it kills the other ranks first.

Liveness is progress, not pulse: with `stall_s`, a fine-tune that makes no step progress (no train/eval event)
for that long stops renewing, records a `stalled` event while it still holds the lease, and kills itself; the
worker requeues it, saying why (it resumes from its last checkpoint)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .settings import Settings
from .store import BaseStore, Lease, LeaseLost, StoreUnavailable, open_store

log = logging.getLogger("hfport.server.fence")

FENCED = 75   # exit code: the lease could not be renewed in time (or was lost); the worker requeues the job
STALLED = 76  # exit code: no step progress within stall_s; the worker requeues the job, saying why
PROGRESS_EVENTS = ("train", "eval")
LAUNCHER = "accelerate.commands.launch"  # the module the worker runs (python -m) for a multi-process job


def _die(code: int, reason: str) -> None:
    """SIGKILL the other processes of this job (its process group: its children; under `accelerate launch`, the
    other ranks and their groups too), then exit at once: no cleanup handler runs (the training loop's `finally`
    would complete a checkpoint save into the run folder)."""
    try:
        os.write(2, f"job process {os.getpid()} at {time.time():.3f}: {reason}; stopping now (exit {code})\n".encode())
    except OSError:
        pass
    group, me = os.getpgrp(), os.getpid()
    if os.getsid(0) == group:  # the worker (or the launcher) started this process as its own session
        table = _process_table()
        # the launcher starts each rank as its own session: its siblings are the other ranks, each a group leader
        ranks = {pid for pid, (ppid, _) in table.items() if ppid == os.getppid()} if under_launcher() else set()
        for pid, (_, pgrp) in table.items():
            if pid != me and (pgrp == group or pgrp in ranks):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
    os._exit(code)


def under_launcher() -> bool:
    """This process is a rank that the worker's `accelerate launch` (torch elastic) started: its parent is the
    launcher (read from /proc, not from the environment, which a worker itself started by a launcher would pass on
    to its single-process jobs)."""
    try:
        return LAUNCHER.encode() in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False


def _stat(pid: int) -> tuple[int, int]:
    """(parent pid, process group) of a process; (-1, -1) when it is gone (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        return int(fields[1]), int(fields[2])
    except (OSError, IndexError, ValueError):
        return -1, -1


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every live process (Linux /proc; empty elsewhere)."""
    proc = Path("/proc")
    pids = [int(e.name) for e in proc.iterdir() if e.name.isdigit()] if proc.is_dir() else []
    return {pid: stat for pid in pids if (stat := _stat(pid))[0] != -1}


class Fence:
    """The lease of one attempt, renewed and watched from inside the job process (see the module docstring)."""

    def __init__(self, store: BaseStore, lease: Lease, *, heartbeat_s: float, margin_s: float,
                 stall_s: float | None = None, die=_die):
        if not 0 <= margin_s < lease.lease_s:
            raise ValueError(f"lease margin {margin_s:g} s must be at least 0 and below the lease "
                             f"({lease.lease_s:g} s)")
        self.store, self.lease, self.stall_s, self._die = store, lease, stall_s, die
        self.budget_s = lease.lease_s - margin_s
        self.every_s = min(heartbeat_s, self.budget_s / 3)
        self._sent_ok = 0.0  # monotonic time the last successful renewal was sent
        self._progress = time.monotonic()
        self._stalls = False  # from begin(): the engine's import is no stall
        self._lock = threading.Lock()

    def start(self) -> None:
        """Renew once, synchronously (the first deadline counts from it; a lost lease exits here), then start the
        renewer and the watchdog."""
        sent = time.monotonic()
        try:
            held = self.store.heartbeat(self.lease.job_id, lease=self.lease)
        except StoreUnavailable as e:
            held = False
            log.warning("job %s: cannot renew the lease at start (%s)", self.lease.job_id, e)
        if not held:
            self._die(FENCED, f"attempt {self.lease.attempt} does not hold job {self.lease.job_id} at start")
        self._sent_ok = sent
        threading.Thread(target=self._renew, name="lease-renewer", daemon=True).start()
        threading.Thread(target=self._watch, name="lease-watchdog", daemon=True).start()

    def begin(self) -> None:
        """The job itself starts (the engine is imported): the stall clock starts now."""
        self._progress = time.monotonic()
        self._stalls = self.stall_s is not None

    def progress(self) -> None:
        self._progress = time.monotonic()

    def done(self) -> None:
        """The job's steps are over (the result is being registered): no more stall checks."""
        self._stalls = False

    def kill(self, code: int, reason: str) -> None:
        self._die(code, reason)

    def _renew(self) -> None:
        failing = False
        while True:
            time.sleep(self.every_s)
            idle = time.monotonic() - self._progress
            if self._stalls and idle > self.stall_s:
                self._stalled(idle)
                return
            sent = time.monotonic()
            try:
                held = self.store.heartbeat(self.lease.job_id, lease=self.lease)
            except Exception as e:  # noqa: BLE001 - an unreachable database: the watchdog decides, in time
                if not failing:
                    log.warning("job %s: lease renewal failed (%s); retrying, and stopping if none succeeds within "
                                "%.1f s of the last", self.lease.job_id, e, self.budget_s)
                failing = True
                continue
            if not held:
                self._die(FENCED, f"attempt {self.lease.attempt} lost its lease on job {self.lease.job_id}")
            failing = False
            with self._lock:
                self._sent_ok = max(self._sent_ok, sent)

    def _watch(self) -> None:
        while True:
            with self._lock:
                left = self._sent_ok + self.budget_s - time.monotonic()
            if left <= 0:
                self._die(FENCED, f"no lease renewal of job {self.lease.job_id} succeeded for {self.budget_s:.1f} s "
                                  f"(lease {self.lease.lease_s:g} s minus the margin)")
            time.sleep(min(left, 0.05))

    def _stalled(self, idle: float) -> None:
        reason = f"no step progress for {idle:.0f} s (HFPORT_JOB_STALL_S={self.stall_s:g})"
        try:  # while the lease still holds: the worker reads it to requeue the job and say why
            self.store.add_event(self.lease.job_id, {"type": "stalled", "idle_s": round(idle, 1),
                                                     "stall_s": self.stall_s}, lease=self.lease)
        except Exception as e:  # noqa: BLE001 - the exit code still tells the worker
            log.warning("job %s: could not record the stall (%s)", self.lease.job_id, e)
        self._die(STALLED, reason)


class FencedStore:
    """The store as one attempt sees it: the writes a job makes carry its lease. A refused write (LeaseLost) kills
    the process at once; an unreachable database blocks the write and retries, while the watchdog decides whether
    the lease outlives the outage. Reads pass through. train/eval events count as progress for the stall rule."""

    def __init__(self, store: BaseStore, fence: Fence):
        self._store, self._fence, self._lease = store, fence, fence.lease

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _write(self, fn, *args: Any, **kw: Any) -> Any:
        while True:
            try:
                return fn(*args, lease=self._lease, **kw)
            except LeaseLost as e:
                self._fence.kill(FENCED, str(e))
            except StoreUnavailable:
                time.sleep(0.2)

    def add_event(self, job_id: str, event: dict[str, Any]) -> int:
        if event.get("type") in PROGRESS_EVENTS:
            self._fence.progress()
        return self._write(self._store.add_event, job_id, event)

    def update_progress(self, job_id: str, progress: dict[str, Any] | None = None,
                        metrics: dict[str, Any] | None = None) -> None:
        self._write(self._store.update_progress, job_id, progress, metrics)

    def drop_events_past(self, job_id: str, step: int) -> None:
        self._write(self._store.drop_events_past, job_id, step)

    def register_model(self, *args: Any, **kw: Any) -> dict[str, Any]:
        self._fence.done()
        return self._write(self._store.register_model, *args, **kw)

    def finish(self, job_id: str, status: str, **kw: Any) -> bool:
        kw.pop("attempt", None)  # the lease is the stronger fence
        self._fence.done()
        return self._write(self._store.finish, job_id, status, **kw)



def die_with_parent(parent_pid: int | None) -> None:
    """Linux: SIGKILL this process when the process that started it dies, so no orphan keeps training; exit at once
    if the worker `parent_pid` is gone already. Under `accelerate launch` the parent is the launcher, which itself
    dies with the worker (`exec_with_parent_death`): the chain worker -> launcher -> rank holds when the worker is
    this process's grandparent."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: survives exec, fires when the parent (thread) exits
    except OSError:
        return
    # checked after prctl: a parent that died before it took effect left this process reparented already
    parent = os.getppid()
    if parent != parent_pid and not (under_launcher() and _stat(parent)[0] == parent_pid):
        os._exit(143)


def exec_with_parent_death(parent_pid: int, argv: list[str]) -> None:
    """`python -m server.fence --exec-under PID -- PROGRAM ARGS`: PROGRAM (here `accelerate launch`, whose code
    cannot ask for it) replaces this process and dies with the worker PID; its ranks die with it (die_with_parent)."""
    die_with_parent(parent_pid)
    os.execvp(argv[0], argv)


def start(argv: list[str]) -> tuple[Fence | None, int | None]:
    """Parse the lease arguments of a jobrun command line, open the store, check the attempt still holds the job and
    start its fence (rank 0 only). (None, exit code) when there is nothing to run."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("job_id")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--heartbeat", type=float, default=2.0)
    parser.add_argument("--attempt", type=int, default=None)
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--lease-margin-s", type=float, default=None)
    parser.add_argument("--stall-s", type=float, default=None)
    args, _ = parser.parse_known_args(argv)
    die_with_parent(args.parent_pid)
    if os.environ.get("RANK", "0") != "0":
        return None, None
    # the worker passes a PostgreSQL URL in the environment (never argv); otherwise the data dir's SQLite file
    store = open_store(Settings.env_value("database_url") or os.path.join(args.data_dir, "hfport.db"))
    job = store.get_job(args.job_id)
    if job is None:
        print(f"no job {args.job_id} in {store.describe()}", file=sys.stderr)
        return None, 2
    attempt = job["attempts"] if args.attempt is None else args.attempt
    if job["attempts"] != attempt or job["status"] != "running":
        print(f"job {args.job_id}: attempt {attempt} no longer holds it ({job['status']}, attempt "
              f"{job['attempts']})", file=sys.stderr)
        return None, 0
    margin = 0.2 * args.lease_s if args.lease_margin_s is None else args.lease_margin_s
    fence = Fence(store, Lease(job["id"], attempt, args.lease_s), heartbeat_s=args.heartbeat, margin_s=margin,
                  stall_s=args.stall_s if job["kind"] == "finetune" else None)  # an export has no steps
    fence.start()
    return fence, None


JOB_MODULE = "server.jobrun"  # what `python -m server.fence` runs once the lease is safe


def main(argv: list[str] | None = None) -> int:
    """`python -m server.fence server.jobrun JOB ARGS`: fence first, then the job (`--exec-under PID -- PROGRAM
    ARGS`: exec_with_parent_death). The job module is imported by name
    only after the lease is safe (it imports the whole engine), and so this module never imports it: the job
    module imports the fence, not the reverse."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--exec-under"] and argv[2:3] == ["--"]:
        exec_with_parent_death(int(argv[1]), argv[3:])
    if argv[:1] == [JOB_MODULE]:
        argv = argv[1:]
    fence, code = start(argv)
    if code is not None:
        return code
    return importlib.import_module(JOB_MODULE).main(argv, fence=fence)


if __name__ == "__main__":
    sys.exit(main())
