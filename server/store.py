"""The job store and model registry: one SQLite file (WAL) under the data dir, shared by the web process and the
job processes. Every call opens its own short connection, so any thread or process may use a Store.

jobs    one row a job: kind, status, config, progress, latest metrics, error, times, heartbeat, pid, attempts
events  the job's event history (train/eval/done/status...), replayed to late SSE subscribers
models  the registry: name -> folder, task
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

KINDS = ("finetune", "export")
STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL = ("succeeded", "failed", "cancelled")

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL CHECK (kind IN ('finetune', 'export')),
    status TEXT NOT NULL CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    config TEXT NOT NULL,
    progress TEXT NOT NULL DEFAULT '{}',
    metrics TEXT NOT NULL DEFAULT '{}',
    result TEXT,
    error TEXT,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    heartbeat_at REAL,
    pid INTEGER,
    attempts INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status, created_at);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
);
CREATE TABLE IF NOT EXISTS models (
    name TEXT PRIMARY KEY,
    path TEXT NOT NULL,
    task TEXT,
    source TEXT NOT NULL DEFAULT 'registered',
    created_at REAL NOT NULL
);
"""

_JSON_COLUMNS = ("config", "progress", "metrics", "result")


class Store:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        try:
            db.execute("PRAGMA busy_timeout=30000")
            db.execute("PRAGMA journal_mode=WAL")  # readers never block the writer, across processes
            db.executescript(SCHEMA)
        finally:
            db.close()

    @contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        """A connection in one transaction (committed on success, rolled back on error), closed afterwards."""
        db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA busy_timeout=30000")
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("PRAGMA synchronous=NORMAL")
        try:
            db.execute("BEGIN IMMEDIATE")
            yield db
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        finally:
            db.close()

    # --- jobs -------------------------------------------------------------------------------------------------

    @staticmethod
    def _job(row: sqlite3.Row | None) -> dict[str, Any] | None:
        if row is None:
            return None
        job = dict(row)
        for key in _JSON_COLUMNS:
            job[key] = json.loads(job[key]) if job[key] is not None else None
        job["cancel_requested"] = bool(job["cancel_requested"])
        return job

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex[:12]

    def create_job(self, kind: str, config: dict[str, Any], job_id: str | None = None) -> dict[str, Any]:
        if kind not in KINDS:
            raise ValueError(f"job kind {kind!r}; valid: {KINDS}")
        job_id = job_id or self.new_id()
        with self.connect() as db:
            db.execute("INSERT INTO jobs (id, kind, status, config, created_at) VALUES (?, ?, 'queued', ?, ?)",
                       (job_id, kind, json.dumps(config), time.time()))
            self._append(db, job_id, {"type": "status", "status": "queued"})
        return self.get_job(job_id)

    def get_job(self, job_id: str) -> dict[str, Any] | None:
        with self.connect() as db:
            return self._job(db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())

    def list_jobs(self, status: str | None = None, limit: int = 200) -> list[dict[str, Any]]:
        with self.connect() as db:
            if status:
                rows = db.execute("SELECT * FROM jobs WHERE status = ? ORDER BY created_at DESC LIMIT ?",
                                  (status, limit))
            else:
                rows = db.execute("SELECT * FROM jobs ORDER BY created_at DESC LIMIT ?", (limit,))
            return [self._job(r) for r in rows.fetchall()]

    def count_by_status(self) -> dict[str, int]:
        with self.connect() as db:
            return {r[0]: r[1] for r in db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()}

    def claim_next(self) -> dict[str, Any] | None:
        """The oldest queued job, switched to running (attempts + 1) in one transaction; None when none waits."""
        with self.connect() as db:
            row = db.execute("SELECT id FROM jobs WHERE status = 'queued' ORDER BY created_at LIMIT 1").fetchone()
            if row is None:
                return None
            now = time.time()
            db.execute("UPDATE jobs SET status = 'running', started_at = COALESCE(started_at, ?), heartbeat_at = ?, "
                       "attempts = attempts + 1, pid = NULL, error = NULL WHERE id = ?", (now, now, row["id"]))
            self._append(db, row["id"], {"type": "status", "status": "running"})
            return self._job(db.execute("SELECT * FROM jobs WHERE id = ?", (row["id"],)).fetchone())

    def set_pid(self, job_id: str, pid: int | None) -> None:
        with self.connect() as db:
            db.execute("UPDATE jobs SET pid = ?, heartbeat_at = ? WHERE id = ?", (pid, time.time(), job_id))

    def heartbeat(self, job_id: str) -> None:
        with self.connect() as db:
            db.execute("UPDATE jobs SET heartbeat_at = ? WHERE id = ?", (time.time(), job_id))

    def update_progress(self, job_id: str, progress: dict[str, Any] | None = None,
                        metrics: dict[str, Any] | None = None) -> None:
        with self.connect() as db:
            job = self._job(db.execute("SELECT progress, metrics, config, result, cancel_requested FROM jobs "
                                       "WHERE id = ?", (job_id,)).fetchone())
            if job is None:
                return
            db.execute("UPDATE jobs SET progress = ?, metrics = ?, heartbeat_at = ? WHERE id = ?",
                       (json.dumps({**job["progress"], **(progress or {})}),
                        json.dumps({**job["metrics"], **(metrics or {})}), time.time(), job_id))

    def finish(self, job_id: str, status: str, *, error: str | None = None, result: dict[str, Any] | None = None,
               only_if: tuple[str, ...] = ("running", "queued")) -> bool:
        """Move a job to a terminal status (once: a job already finished keeps its status). True if it moved."""
        assert status in TERMINAL
        with self.connect() as db:
            marks = ",".join("?" * len(only_if))
            cur = db.execute(f"UPDATE jobs SET status = ?, error = ?, result = COALESCE(?, result), finished_at = ?, "
                             f"pid = NULL WHERE id = ? AND status IN ({marks})",
                             (status, error, json.dumps(result) if result is not None else None, time.time(), job_id,
                              *only_if))
            if cur.rowcount:
                event: dict[str, Any] = {"type": "status", "status": status}
                if error:
                    event["error"] = error
                self._append(db, job_id, event)
            return bool(cur.rowcount)

    def requeue(self, job_id: str, reason: str) -> None:
        """A running job whose process is gone goes back to the queue; its next run resumes from a checkpoint."""
        with self.connect() as db:
            cur = db.execute("UPDATE jobs SET status = 'queued', pid = NULL WHERE id = ? AND status = 'running'",
                             (job_id,))
            if cur.rowcount:
                self._append(db, job_id, {"type": "status", "status": "queued", "reason": reason})

    def request_cancel(self, job_id: str) -> dict[str, Any] | None:
        """Queued: cancelled at once. Running: flagged for the worker to stop. Returns the job after."""
        with self.connect() as db:
            job = self._job(db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())
            if job is None or job["status"] in TERMINAL:
                return job
            if job["status"] == "queued":
                db.execute("UPDATE jobs SET status = 'cancelled', finished_at = ?, cancel_requested = 1 WHERE id = ?",
                           (time.time(), job_id))
                self._append(db, job_id, {"type": "status", "status": "cancelled"})
            else:
                db.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))
            return self._job(db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())

    # --- events -----------------------------------------------------------------------------------------------

    @staticmethod
    def _append(db: sqlite3.Connection, job_id: str, event: dict[str, Any]) -> int:
        seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM events WHERE job_id = ?", (job_id,)).fetchone()[0]
        db.execute("INSERT INTO events (job_id, seq, data) VALUES (?, ?, ?)",
                   (job_id, seq, json.dumps({**event, "time": round(time.time(), 3)})))
        return seq

    def add_event(self, job_id: str, event: dict[str, Any]) -> int:
        with self.connect() as db:
            return self._append(db, job_id, event)

    def events_after(self, job_id: str, seq: int = 0) -> list[tuple[int, dict[str, Any]]]:
        with self.connect() as db:
            rows = db.execute("SELECT seq, data FROM events WHERE job_id = ? AND seq > ? ORDER BY seq",
                              (job_id, seq)).fetchall()
        return [(r["seq"], json.loads(r["data"])) for r in rows]

    def drop_events_past(self, job_id: str, step: int) -> None:
        """On resume: train/eval events after the checkpoint's step are redone, so the history drops them."""
        with self.connect() as db:
            rows = db.execute("SELECT seq, data FROM events WHERE job_id = ?", (job_id,)).fetchall()
            stale = [r["seq"] for r in rows if (e := json.loads(r["data"])).get("type") in ("train", "eval")
                     and e.get("step", 0) > step]
            db.executemany("DELETE FROM events WHERE job_id = ? AND seq = ?", [(job_id, s) for s in stale])

    # --- models -----------------------------------------------------------------------------------------------

    def register_model(self, name: str, path: str, task: str | None, source: str = "registered",
                       replace: bool = False) -> dict[str, Any]:
        with self.connect() as db:
            verb = "INSERT OR REPLACE" if replace else "INSERT"
            db.execute(f"{verb} INTO models (name, path, task, source, created_at) VALUES (?, ?, ?, ?, ?)",
                       (name, path, task, source, time.time()))
            return dict(db.execute("SELECT * FROM models WHERE name = ?", (name,)).fetchone())

    def get_model(self, name: str) -> dict[str, Any] | None:
        with self.connect() as db:
            row = db.execute("SELECT * FROM models WHERE name = ?", (name,)).fetchone()
            return dict(row) if row else None

    def list_models(self) -> list[dict[str, Any]]:
        with self.connect() as db:
            return [dict(r) for r in db.execute("SELECT * FROM models ORDER BY name").fetchall()]

    def delete_model(self, name: str) -> bool:
        with self.connect() as db:
            return bool(db.execute("DELETE FROM models WHERE name = ?", (name,)).rowcount)
