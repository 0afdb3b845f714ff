"""The embedded default: one SQLite file (WAL) under the data dir, shared by the processes of one host. Every call
opens its own short connection, so any thread or process may use a Store. `BEGIN IMMEDIATE` takes the write lock
up front, which is what serialises claims here (PostgreSQL uses row locks instead)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .base import BaseStore


class SQLiteStore(BaseStore):
    dialect = "sqlite"
    NOW = "((julianday('now') - 2440587.5) * 86400.0)"  # the host's clock (one host shares one SQLite file)

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        try:
            db.execute("PRAGMA busy_timeout=30000")
            db.execute("PRAGMA journal_mode=WAL")  # readers never block the writer, across processes
        finally:
            db.close()
        self.migrate()

    def describe(self) -> str:
        return f"SQLite database {self.path}"

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
