"""The store's one interface: every query, written once. A backend (sqlite.py, postgres.py) supplies a connection
in one transaction (`connect()`, `?` placeholders, rows readable by column name) and a few dialect fragments.

jobs     one row a job: kind, status, config, progress, latest metrics, error, times, heartbeat, pid, attempts,
         the worker holding its lease, its event counter
events   the job's event history (train/eval/done/status...), replayed to late or reconnecting SSE subscribers
models   the registry: name -> folder, task, kind ('model' | 'adapter'), base (an adapter's base folder)
workers  one heartbeat row per live worker id

Time: every timestamp the store writes, and every lease comparison, uses the DATABASE's clock (`NOW` below), never
the caller's. Workers on hosts whose clocks disagree, or a worker whose clock jumps, still agree on whose lease ran
out, because the only clock consulted is the database server's.

Fencing: every write a job attempt makes (lease renewal, progress, events, the final status, the model it
registers) takes a `Lease` (job id, attempt, lease_s) and lands only if, in the same transaction, that attempt still
holds the job: status running, attempts equal to its token, and heartbeat_at within lease_s of the database clock.
Otherwise nothing is written: heartbeat/finish return False, the others raise LeaseLost. The row is locked while
checked (FOR UPDATE on PostgreSQL, the write lock on SQLite), so a requeue cannot slip in between check and write.
"""

from __future__ import annotations

import json
import uuid
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

from hfport import PERF

from .errors import DuplicateWorker, IdempotencyKeyUsed, LeaseLost, ModelNameTaken
from .migrations import migrate

KINDS = ("finetune", "export", "evaluate")
STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL = ("succeeded", "failed", "cancelled")
# the events a training step writes, which a resumed attempt writes again from its checkpoint on: the losses, the
# evaluations, and the monitor's speed and resources (hfport.PERF), which the dashboard plots per step too
STEP_EVENTS = ("train", "eval", PERF)
LIVE = "status IN ('queued', 'running')"  # SQL: the jobs whose register_as is reserved (jobs_register_as_live)
_JSON_COLUMNS = ("config", "progress", "metrics", "result")


class Lease(NamedTuple):
    """One attempt's hold on a job: its fencing token (jobs.attempts at the claim) and the lease length the
    database clock judges it by."""
    job_id: str
    attempt: int
    lease_s: float


class IdempotencyKey(NamedTuple):
    """A submission's Idempotency-Key: unique per route while younger than ttl_s (database clock)."""
    route: str
    key: str
    body_hash: str
    ttl_s: float


class BaseStore:
    dialect: str = ""
    NOW: str = ""           # SQL: the database clock, seconds since the epoch (float)
    SKIP_LOCKED: str = ""   # SQL: appended to the claim's SELECT so concurrent claimers pass over each other's row
    FOR_UPDATE: str = ""    # SQL: appended to a read-then-write SELECT to lock the row until commit

    def connect(self) -> AbstractContextManager[Any]:
        """A connection in one transaction (committed on success, rolled back on error)."""
        raise NotImplementedError

    def describe(self) -> str:
        """The database, for messages (never with a password)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release pooled connections (a no-op where there are none)."""

    def _migration_lock(self, db: Any) -> None:
        """Held for the migration's transaction, so processes starting together migrate once."""

    def _name_lock(self, db: Any, name: str) -> None:
        """Held for the transaction, per model name: create_job (register_as) checks `models` and inserts into `jobs`,
        register_model checks `jobs` and inserts into `models`, so no unique index sees both; two of them for one name
        must not interleave, or both checks pass before either insert. A no-op where every write transaction is
        serialised already (SQLite's BEGIN IMMEDIATE)."""

    def migrate(self) -> list[int]:
        with self.connect() as db:
            self._migration_lock(db)
            return migrate(db, self.dialect, self.describe())

    def schema_version(self) -> int:
        with self.connect() as db:
            return db.execute("SELECT COALESCE(MAX(version), 0) AS v FROM schema_version").fetchone()["v"]

    def db_now(self) -> float:
        with self.connect() as db:
            return float(db.execute(f"SELECT {self.NOW} AS now").fetchone()["now"])

    # --- jobs -------------------------------------------------------------------------------------------------

    @staticmethod
    def _job(row: Any) -> dict[str, Any] | None:
        if row is None:
            return None
        job = dict(row)
        for key in _JSON_COLUMNS:
            if key in job:
                job[key] = json.loads(job[key]) if job[key] is not None else None
        if "cancel_requested" in job:
            job["cancel_requested"] = bool(job["cancel_requested"])
        return job

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex[:12]

    def create_job(self, kind: str, config: dict[str, Any], job_id: str | None = None,
                   idempotency: IdempotencyKey | None = None, register_as: str | None = None) -> dict[str, Any]:
        """Queue a job. With `idempotency`: the key is inserted in the same transaction, and when a live row for it
        exists already (a concurrent or earlier submission) the job is rolled back and IdempotencyKeyUsed names the
        job the key holds: the unique key decides, not a check before the insert. `register_as`: the model name a
        fine-tune registers when it succeeds, reserved while it is queued or running; ModelNameTaken when a model
        holds it or another live job reserves it (a unique index decides between jobs, the name's lock (_name_lock)
        between a job and a registration)."""
        if kind not in KINDS:
            raise ValueError(f"job kind {kind!r}; valid: {KINDS}")
        job_id = job_id or self.new_id()
        with self.connect() as db:
            if register_as is not None:
                self._name_lock(db, register_as)
                if db.execute("SELECT name FROM models WHERE name = ?", (register_as,)).fetchone() is not None:
                    raise ModelNameTaken(register_as, None)
            row = db.execute(f"INSERT INTO jobs (id, kind, status, config, created_at, register_as) "
                             f"VALUES (?, ?, 'queued', ?, {self.NOW}, ?) ON CONFLICT DO NOTHING RETURNING id",
                             (job_id, kind, json.dumps(config), register_as)).fetchone()
            if row is None:  # another live job reserves the name (on PostgreSQL: after waiting for its commit)
                if idempotency is not None:
                    self._key_holder(db, idempotency)  # a concurrent submission with this key: its job, not a 409
                holder = db.execute(f"SELECT id FROM jobs WHERE register_as = ? AND {LIVE}",
                                    (register_as,)).fetchone()
                if register_as is None or holder is None:
                    raise ValueError(f"job id {job_id!r} exists")
                raise ModelNameTaken(register_as, holder["id"])
            if idempotency is not None:
                self._take_key(db, idempotency, job_id)
            self._append(db, job_id, {"type": "status", "status": "queued"})
        return self.get_job(job_id)

    def _take_key(self, db: Any, idem: IdempotencyKey, job_id: str) -> None:
        db.execute(f"DELETE FROM idempotency_keys WHERE created_at < {self.NOW} - ?", (idem.ttl_s,))  # expired ones
        row = db.execute(f"INSERT INTO idempotency_keys (route, key, body_hash, job_id, created_at) "
                         f"VALUES (?, ?, ?, ?, {self.NOW}) ON CONFLICT (route, key) DO NOTHING RETURNING job_id",
                         (idem.route, idem.key, idem.body_hash, job_id)).fetchone()
        if row is None:  # raising rolls the job row back with it
            self._key_holder(db, idem)

    def _key_holder(self, db: Any, idem: IdempotencyKey) -> None:
        """IdempotencyKeyUsed naming the job the key holds, if it holds one."""
        held = db.execute(f"SELECT job_id, body_hash FROM idempotency_keys WHERE route = ? AND key = ? "
                          f"AND created_at >= {self.NOW} - ?", (idem.route, idem.key, idem.ttl_s)).fetchone()
        if held is not None:
            raise IdempotencyKeyUsed(idem.route, idem.key, held["job_id"], held["body_hash"])

    def idempotent_job(self, route: str, key: str, ttl_s: float) -> tuple[str, str] | None:
        """(job id, body hash) the key names on `route`, if it was used within ttl_s (database clock)."""
        with self.connect() as db:
            row = db.execute(f"SELECT job_id, body_hash FROM idempotency_keys WHERE route = ? AND key = ? "
                             f"AND created_at >= {self.NOW} - ?", (route, key, ttl_s)).fetchone()
            return (row["job_id"], row["body_hash"]) if row else None

    def get_job(self, job_id: str) -> dict[str, Any] | None:
        with self.connect() as db:
            return self._job(db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())

    def list_jobs(self, status: str | None = None, limit: int = 200) -> list[dict[str, Any]]:
        with self.connect() as db:
            if status:
                rows = db.execute("SELECT * FROM jobs WHERE status = ? ORDER BY created_at DESC, id LIMIT ?",
                                  (status, limit))
            else:
                rows = db.execute("SELECT * FROM jobs ORDER BY created_at DESC, id LIMIT ?", (limit,))
            return [self._job(r) for r in rows.fetchall()]

    def count_by_status(self) -> dict[str, int]:
        with self.connect() as db:
            rows = db.execute("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status").fetchall()
            return {r["status"]: r["n"] for r in rows}

    def claim_next(self, worker_id: str | None = None, start_grace_s: float = 0.0) -> dict[str, Any] | None:
        """The oldest queued job, switched to running (attempts + 1, lease to `worker_id`) in one statement; None
        when none waits. On PostgreSQL the inner SELECT skips rows another worker is claiming right now.
        `start_grace_s`: the first lease runs that much longer (heartbeat_at in the future), to cover the start of
        the job's process until its own first renewal, which overwrites it. Nothing of the job writes before."""
        with self.connect() as db:
            row = db.execute(
                f"UPDATE jobs SET status = 'running', started_at = COALESCE(started_at, {self.NOW}), "
                f"heartbeat_at = {self.NOW} + ?, attempts = attempts + 1, pid = NULL, error = NULL, worker_id = ? "
                f"WHERE id = (SELECT id FROM jobs WHERE status = 'queued' ORDER BY created_at, id LIMIT 1"
                f"{self.SKIP_LOCKED}) AND status = 'queued' RETURNING *", (start_grace_s, worker_id)).fetchone()
            if row is None:
                return None
            self._append(db, row["id"], {"type": "status", "status": "running", "worker": worker_id})
            return self._job(row)

    def set_pid(self, job_id: str, pid: int | None, attempt: int | None = None) -> None:
        """Record the job's process (of `attempt`, if given). The lease is left as the claim set it."""
        fence, args = ("", ()) if attempt is None else (" AND attempts = ? AND status = 'running'", (attempt,))
        with self.connect() as db:
            db.execute(f"UPDATE jobs SET pid = ? WHERE id = ?{fence}", (pid, job_id, *args))

    def _held(self, lease: Lease) -> tuple[str, tuple]:
        """SQL condition (and its arguments): `lease`'s attempt still holds the job by the database clock."""
        return (f" AND attempts = ? AND status = 'running' AND heartbeat_at >= {self.NOW} - ?",
                (lease.attempt, lease.lease_s))

    def _hold(self, db: Any, lease: Lease, job_id: str | None = None) -> None:
        """Lock the job row if `lease` still holds it, in this transaction; LeaseLost (nothing written) if not."""
        if job_id is not None and job_id != lease.job_id:
            raise ValueError(f"a lease on job {lease.job_id} cannot write to job {job_id}")
        cond, args = self._held(lease)
        if db.execute(f"SELECT id FROM jobs WHERE id = ?{cond}{self.FOR_UPDATE}", (lease.job_id, *args)).fetchone() \
                is None:
            raise LeaseLost(f"job {lease.job_id}: attempt {lease.attempt} no longer holds the job (requeued, claimed "
                            f"again, finished, or its {lease.lease_s:g} s lease ran out by the database clock); "
                            f"the write was refused")

    def heartbeat(self, job_id: str, attempt: int | None = None, *, lease: Lease | None = None) -> bool:
        """Renew the job's lease. With `attempt` (the fencing token) only while that attempt is the job's; with
        `lease` also only while its lease has not run out (an expired lease is never revived: whoever noticed it
        may be requeueing the job). False means the lease was lost and the caller must stop."""
        with self.connect() as db:
            cond, args = "", ()
            if lease is not None:
                cond, args = self._held(lease)
                job_id = lease.job_id
            elif attempt is not None:
                cond, args = " AND attempts = ? AND status = 'running'", (attempt,)
            cur = db.execute(f"UPDATE jobs SET heartbeat_at = {self.NOW} WHERE id = ?{cond}", (job_id, *args))
            return bool(cur.rowcount)

    def update_progress(self, job_id: str, progress: dict[str, Any] | None = None,
                        metrics: dict[str, Any] | None = None, *, lease: Lease | None = None) -> None:
        """Merge into the job's progress and metrics (and renew its heartbeat). With `lease`: LeaseLost unless
        that attempt still holds the job."""
        with self.connect() as db:
            if lease is not None:
                self._hold(db, lease, job_id)
            job = self._job(db.execute(f"SELECT progress, metrics FROM jobs WHERE id = ?{self.FOR_UPDATE}",
                                       (job_id,)).fetchone())
            if job is None:
                return
            db.execute(f"UPDATE jobs SET progress = ?, metrics = ?, heartbeat_at = {self.NOW} WHERE id = ?",
                       (json.dumps({**job["progress"], **(progress or {})}),
                        json.dumps({**job["metrics"], **(metrics or {})}), job_id))

    def finish(self, job_id: str, status: str, *, error: str | None = None, result: dict[str, Any] | None = None,
               only_if: tuple[str, ...] = ("running", "queued"), attempt: int | None = None,
               lease: Lease | None = None) -> bool:
        """Move a job to a terminal status (once: a job already finished keeps its status). True if it moved.
        With `attempt`: only if that attempt is the job's (a run that lost its lease cannot finish it); with `lease`:
        and only while its lease has not run out by the database clock."""
        assert status in TERMINAL
        marks = ",".join("?" * len(only_if))
        fence, args = ("", ()) if attempt is None else (" AND attempts = ?", (attempt,))
        if lease is not None:
            fence, args = self._held(lease)
        with self.connect() as db:
            cur = db.execute(f"UPDATE jobs SET status = ?, error = ?, result = COALESCE(?, result), "
                             f"finished_at = {self.NOW}, pid = NULL WHERE id = ? AND status IN ({marks}){fence}",
                             (status, error, json.dumps(result) if result is not None else None, job_id, *only_if,
                              *args))
            if cur.rowcount:
                event: dict[str, Any] = {"type": "status", "status": status}
                if error:
                    event["error"] = error
                self._append(db, job_id, event)
            return bool(cur.rowcount)

    def requeue(self, job_id: str, reason: str, *, stale_after: float | None = None,
                worker_id: str | None = None, attempt: int | None = None) -> str | None:
        """A running job whose process is gone goes back to the queue; its next run resumes from a checkpoint. One
        whose cancel was requested (from any API process, while the attempt that should have acted on it died)
        ends `cancelled` instead: it is never run again. `stale_after`: only if its heartbeat is older than that
        many seconds by the database clock; `worker_id`: only if that worker holds it; `attempt`: only if it is
        still that attempt. Conditional in SQL, so of two workers noticing the same stale lease one moves it. The
        status it moved to ('queued' or 'cancelled'), None if it did not move."""
        cond, args = "", []
        if attempt is not None:
            cond += " AND attempts = ?"
            args.append(attempt)
        if stale_after is not None:
            cond += f" AND (heartbeat_at IS NULL OR heartbeat_at < {self.NOW} - ?)"
            args.append(stale_after)
        if worker_id is not None:
            cond += " AND worker_id = ?"
            args.append(worker_id)
        cancelled = "cancel_requested = 1"
        with self.connect() as db:
            row = db.execute(f"UPDATE jobs SET status = CASE WHEN {cancelled} THEN 'cancelled' ELSE 'queued' END, "
                             f"finished_at = CASE WHEN {cancelled} THEN {self.NOW} ELSE finished_at END, pid = NULL, "
                             f"worker_id = CASE WHEN {cancelled} THEN worker_id ELSE NULL END "
                             f"WHERE id = ? AND status = 'running'{cond} RETURNING status", (job_id, *args)).fetchone()
            if row is None:
                return None
            event = {"type": "status", "status": "queued", "reason": reason} if row["status"] == "queued" else \
                {"type": "status", "status": "cancelled"}
            self._append(db, job_id, event)
            return row["status"]

    def stale_running(self, lease_s: float) -> list[dict[str, Any]]:
        """Running jobs whose heartbeat is older than `lease_s` by the database clock."""
        with self.connect() as db:
            rows = db.execute(f"SELECT * FROM jobs WHERE status = 'running' AND (heartbeat_at IS NULL OR "
                              f"heartbeat_at < {self.NOW} - ?) ORDER BY created_at", (lease_s,)).fetchall()
            return [self._job(r) for r in rows]

    def running_for(self, worker_id: str | None, include_unowned: bool = False) -> list[dict[str, Any]]:
        """Running jobs whose lease `worker_id` holds (include_unowned: and those nobody holds)."""
        with self.connect() as db:
            extra = " OR worker_id IS NULL" if include_unowned else ""
            rows = db.execute(f"SELECT * FROM jobs WHERE status = 'running' AND (worker_id = ?{extra})",
                              (worker_id,)).fetchall()
            return [self._job(r) for r in rows]

    def request_cancel(self, job_id: str) -> dict[str, Any] | None:
        """Queued: cancelled at once. Running: flagged; the worker holding it (on any host) polls the flag and
        stops the job. Returns the job after."""
        with self.connect() as db:
            job = self._job(db.execute(f"SELECT * FROM jobs WHERE id = ?{self.FOR_UPDATE}", (job_id,)).fetchone())
            if job is None or job["status"] in TERMINAL:
                return job
            if job["status"] == "queued":
                db.execute(f"UPDATE jobs SET status = 'cancelled', finished_at = {self.NOW}, cancel_requested = 1 "
                           f"WHERE id = ?", (job_id,))
                self._append(db, job_id, {"type": "status", "status": "cancelled"})
            else:
                db.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))
            return self._job(db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())

    # --- events -----------------------------------------------------------------------------------------------

    def _append(self, db: Any, job_id: str, event: dict[str, Any]) -> int:
        # the job row's counter hands out numbers: the UPDATE locks the row, so concurrent writers (the job process,
        # a cancel from any API process) serialise instead of racing on MAX(seq) + 1
        row = db.execute("UPDATE jobs SET event_seq = event_seq + 1 WHERE id = ? RETURNING event_seq",
                         (job_id,)).fetchone()
        if row is None:
            raise KeyError(f"no job {job_id!r}")
        seq = row["event_seq"]
        now = db.execute(f"SELECT {self.NOW} AS now").fetchone()["now"]
        db.execute("INSERT INTO events (job_id, seq, data) VALUES (?, ?, ?)",
                   (job_id, seq, json.dumps({**event, "time": round(float(now), 3)})))
        return seq

    def add_event(self, job_id: str, event: dict[str, Any], *, lease: Lease | None = None) -> int:
        """Append to the job's history; with `lease`, LeaseLost unless that attempt still holds the job."""
        with self.connect() as db:
            if lease is not None:
                self._hold(db, lease, job_id)
            return self._append(db, job_id, event)

    def events_after(self, job_id: str, seq: int = 0) -> list[tuple[int, dict[str, Any]]]:
        with self.connect() as db:
            rows = db.execute("SELECT seq, data FROM events WHERE job_id = ? AND seq > ? ORDER BY seq",
                              (job_id, seq)).fetchall()
        return [(r["seq"], json.loads(r["data"])) for r in rows]

    def drop_events_past(self, job_id: str, step: int, *, lease: Lease | None = None) -> None:
        """On resume: the per-step events after the checkpoint's step (STEP_EVENTS) are redone, so the history
        drops them."""
        with self.connect() as db:
            if lease is not None:
                self._hold(db, lease, job_id)
            rows = db.execute("SELECT seq, data FROM events WHERE job_id = ?", (job_id,)).fetchall()
            stale = [r["seq"] for r in rows if (e := json.loads(r["data"])).get("type") in STEP_EVENTS
                     and e.get("step", 0) > step]
            for s in stale:
                db.execute("DELETE FROM events WHERE job_id = ? AND seq = ?", (job_id, s))

    # --- models -----------------------------------------------------------------------------------------------

    def register_model(self, name: str, path: str, task: str | None, source: str = "registered",
                       replace: bool = False, kind: str = "model", base: str | None = None, *,
                       lease: Lease | None = None) -> dict[str, Any]:
        """kind 'adapter': `path` is a LoRA adapter folder and `base` the base model's folder it runs over. With
        `lease` (a job registering its result): LeaseLost unless that attempt still holds the job. Without it and
        without `replace`: ModelNameTaken while a queued or running job reserves the name (create_job)."""
        with self.connect() as db:
            self._name_lock(db, name)  # first: create_job takes it before the job row, so no two wait on each other
            if lease is not None:
                self._hold(db, lease)
            elif not replace and (job := db.execute(f"SELECT id FROM jobs WHERE register_as = ? AND {LIVE}",
                                                    (name,)).fetchone()) is not None:
                raise ModelNameTaken(name, job["id"])  # that job would replace this registration when it succeeds
            upsert = (" ON CONFLICT (name) DO UPDATE SET path = excluded.path, task = excluded.task, "
                      "source = excluded.source, kind = excluded.kind, base = excluded.base, "
                      "created_at = excluded.created_at" if replace else "")
            db.execute(f"INSERT INTO models (name, path, task, source, kind, base, created_at) "
                       f"VALUES (?, ?, ?, ?, ?, ?, {self.NOW}){upsert}", (name, path, task, source, kind, base))
            return dict(db.execute("SELECT * FROM models WHERE name = ?", (name,)).fetchone())

    def get_model(self, name: str) -> dict[str, Any] | None:
        with self.connect() as db:
            row = db.execute("SELECT * FROM models WHERE name = ?", (name,)).fetchone()
            return dict(row) if row else None

    def list_models(self, kind: str | None = None) -> list[dict[str, Any]]:
        with self.connect() as db:
            if kind:
                rows = db.execute("SELECT * FROM models WHERE kind = ? ORDER BY name", (kind,))
            else:
                rows = db.execute("SELECT * FROM models ORDER BY name")
            return [dict(r) for r in rows.fetchall()]

    def delete_model(self, name: str) -> bool:
        with self.connect() as db:
            return bool(db.execute("DELETE FROM models WHERE name = ?", (name,)).rowcount)

    # --- workers ----------------------------------------------------------------------------------------------

    def register_worker(self, worker_id: str, host: str, pid: int, lease_s: float, *,
                        take_over: bool = False) -> dict[str, Any] | None:
        """Claim `worker_id` for this process. Returns None when claimed; the holding row when another worker with
        this id heartbeat within `lease_s` (by the database clock) and `take_over` is not set."""
        with self.connect() as db:
            row = db.execute(f"SELECT *, {self.NOW} - heartbeat_at AS age FROM workers WHERE id = ?{self.FOR_UPDATE}",
                             (worker_id,)).fetchone()
            if row is not None and row["age"] < lease_s and not take_over:
                return dict(row)
            db.execute("DELETE FROM workers WHERE id = ?", (worker_id,))
            db.execute(f"INSERT INTO workers (id, host, pid, started_at, heartbeat_at) "
                       f"VALUES (?, ?, ?, {self.NOW}, {self.NOW})", (worker_id, host, pid))
            return None

    def worker_beat(self, worker_id: str, pid: int) -> bool:
        """Renew the worker's row; False when another process took the id over (this one must stop)."""
        with self.connect() as db:
            return bool(db.execute(f"UPDATE workers SET heartbeat_at = {self.NOW} WHERE id = ? AND pid = ?",
                                   (worker_id, pid)).rowcount)

    def unregister_worker(self, worker_id: str, pid: int) -> None:
        with self.connect() as db:
            db.execute("DELETE FROM workers WHERE id = ? AND pid = ?", (worker_id, pid))

    def list_workers(self) -> list[dict[str, Any]]:
        with self.connect() as db:
            rows = db.execute(f"SELECT *, {self.NOW} - heartbeat_at AS age FROM workers ORDER BY id").fetchall()
            return [dict(r) for r in rows]

    def workers_on(self, host: str) -> list[dict[str, Any]]:
        with self.connect() as db:
            return [dict(r) for r in db.execute("SELECT * FROM workers WHERE host = ?", (host,)).fetchall()]


def duplicate_worker_error(row: dict[str, Any]) -> DuplicateWorker:
    return DuplicateWorker(f"worker id {row['id']!r} is held by a live worker (host {row['host']}, pid {row['pid']}, "
                           f"last heartbeat {row['age']:.1f} s ago by the database clock); give this worker another "
                           f"HFPORT_WORKER_ID, or stop the other one")

