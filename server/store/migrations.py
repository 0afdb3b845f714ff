"""The schema, as ordered migrations per dialect, and the runner that applies them on start.

Why a small versioned-SQL runner and not alembic: the schema is four tables, the store writes plain SQL (no ORM
models for alembic to diff against), and migrations must run inside `hfport serve` on start, on SQLite and
PostgreSQL alike, under a lock so that several processes starting together migrate once. That is ~40 lines here;
alembic would add SQLAlchemy, an env.py and a config file to the install for the same effect.

Rules: a migration is never edited once released, only appended; version N is the same schema change in every
dialect. `schema_version` holds one row per applied version. A database whose version is above the code's newest is
refused (SchemaTooNew): an older hfport must not write to a schema it does not know.
"""

from __future__ import annotations

from typing import NamedTuple

from .errors import SchemaTooNew


class Migration(NamedTuple):
    version: int
    name: str
    statements: tuple[str, ...]


def _base(real: str) -> tuple[str, ...]:
    """Version 1: the single-host schema (IF NOT EXISTS: a database made before versioning adopts it as is)."""
    return (
        f"""CREATE TABLE IF NOT EXISTS jobs (
            id TEXT PRIMARY KEY,
            kind TEXT NOT NULL CHECK (kind IN ('finetune', 'export')),
            status TEXT NOT NULL CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
            config TEXT NOT NULL,
            progress TEXT NOT NULL DEFAULT '{{}}',
            metrics TEXT NOT NULL DEFAULT '{{}}',
            result TEXT,
            error TEXT,
            created_at {real} NOT NULL,
            started_at {real},
            finished_at {real},
            heartbeat_at {real},
            pid INTEGER,
            attempts INTEGER NOT NULL DEFAULT 0,
            cancel_requested INTEGER NOT NULL DEFAULT 0)""",
        "CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status, created_at)",
        """CREATE TABLE IF NOT EXISTS events (
            job_id TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
            seq INTEGER NOT NULL,
            data TEXT NOT NULL,
            PRIMARY KEY (job_id, seq))""",
        f"""CREATE TABLE IF NOT EXISTS models (
            name TEXT PRIMARY KEY,
            path TEXT NOT NULL,
            task TEXT,
            source TEXT NOT NULL DEFAULT 'registered',
            created_at {real} NOT NULL)""",
    )


def _scale_out(real: str) -> tuple[str, ...]:
    """Version 2: many workers. jobs.worker_id is the lease holder; jobs.event_seq numbers events per job without a
    MAX() race (and never reuses a number after a resume drops events, so Last-Event-ID stays meaningful);
    models.kind leaves room for adapters; workers holds one heartbeat row per live worker id."""
    return (
        "ALTER TABLE jobs ADD COLUMN worker_id TEXT",
        "ALTER TABLE jobs ADD COLUMN event_seq INTEGER NOT NULL DEFAULT 0",
        "UPDATE jobs SET event_seq = (SELECT COALESCE(MAX(seq), 0) FROM events WHERE events.job_id = jobs.id)",
        "CREATE INDEX jobs_worker ON jobs (worker_id, status)",
        "ALTER TABLE models ADD COLUMN kind TEXT NOT NULL DEFAULT 'model' CHECK (kind IN ('model', 'adapter'))",
        f"""CREATE TABLE workers (
            id TEXT PRIMARY KEY,
            host TEXT NOT NULL,
            pid INTEGER NOT NULL,
            started_at {real} NOT NULL,
            heartbeat_at {real} NOT NULL)""",
    )


def _adapters() -> tuple[str, ...]:
    """Version 3: a LoRA adapter (kind 'adapter') runs over a base model folder, kept in models.base."""
    return ("ALTER TABLE models ADD COLUMN base TEXT",)


def _idempotency(real: str) -> tuple[str, ...]:
    """Version 4: Idempotency-Key -> job, per route. The primary key is what makes two concurrent submissions with
    one key create one job (the loser's insert conflicts and its job row rolls back with it); the body hash tells a
    retry (same body) from a misuse of the key (another body)."""
    return (
        f"""CREATE TABLE idempotency_keys (
            route TEXT NOT NULL,
            key TEXT NOT NULL,
            body_hash TEXT NOT NULL,
            job_id TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
            created_at {real} NOT NULL,
            PRIMARY KEY (route, key))""",
        "CREATE INDEX idempotency_keys_created ON idempotency_keys (created_at)",
    )


def _evaluate_jobs() -> tuple[str, ...]:
    """Version 5: evaluate jobs. jobs.kind's CHECK takes 'evaluate' too. Neither dialect alters a CHECK in place
    (SQLite cannot; a table rebuild would cascade-delete the events), so the column is replaced: the old one renamed,
    a new one added with the wider CHECK, the values copied, the old one dropped (with its CHECK). The default only
    fills the existing rows before the copy; every insert names its kind."""
    return (
        "ALTER TABLE jobs RENAME COLUMN kind TO kind_v4",
        "ALTER TABLE jobs ADD COLUMN kind TEXT NOT NULL DEFAULT 'finetune' "
        "CHECK (kind IN ('finetune', 'export', 'evaluate'))",
        "UPDATE jobs SET kind = kind_v4",
        "ALTER TABLE jobs DROP COLUMN kind_v4",
    )


def _reserved_names() -> tuple[str, ...]:
    """Version 6: jobs.register_as, the model name a fine-tune registers when it succeeds, reserved while the job is
    queued or running: the partial unique index is what refuses a second live job with the name (two API processes
    racing included), not a check before the insert. Jobs queued before this version are not backfilled (two of
    them may share a name already, and the index would not build); they keep the old behaviour."""
    return ("ALTER TABLE jobs ADD COLUMN register_as TEXT",
            "CREATE UNIQUE INDEX jobs_register_as_live ON jobs (register_as) WHERE status IN ('queued', 'running')")


def _migrations(real: str) -> tuple[Migration, ...]:
    return (Migration(1, "jobs, events, models", _base(real)),
            Migration(2, "workers, leases, event counter, model kind", _scale_out(real)),
            Migration(3, "adapter base model", _adapters()),
            Migration(4, "idempotency keys", _idempotency(real)),
            Migration(5, "evaluate jobs", _evaluate_jobs()),
            Migration(6, "model names reserved by live jobs", _reserved_names()))


MIGRATIONS: dict[str, tuple[Migration, ...]] = {
    "sqlite": _migrations("REAL"),
    "postgresql": _migrations("DOUBLE PRECISION"),
}
LATEST = MIGRATIONS["sqlite"][-1].version
assert all(m[-1].version == LATEST for m in MIGRATIONS.values()), "every dialect migrates to the same version"


def migrate(db, dialect: str, where: str) -> list[int]:
    """Apply the pending migrations on `db` (a connection inside one transaction that the caller holds, with any
    cross-process lock already taken). Returns the versions applied. `where` names the database in errors."""
    db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY, name TEXT NOT NULL)")
    current = db.execute("SELECT COALESCE(MAX(version), 0) AS v FROM schema_version").fetchone()["v"]
    if current > LATEST:
        raise SchemaTooNew(f"{where}: the database schema is version {current}, newer than this hfport knows "
                           f"(version {LATEST}); a newer hfport migrated it. Upgrade hfport on this host, or point "
                           f"HFPORT_DATABASE_URL at another database")
    applied = []
    for migration in MIGRATIONS[dialect]:
        if migration.version <= current:
            continue
        for statement in migration.statements:
            db.execute(statement)
        db.execute("INSERT INTO schema_version (version, name) VALUES (?, ?)", (migration.version, migration.name))
        applied.append(migration.version)
    return applied
