"""The job store: one interface (base.BaseStore), two backends. SQLite is the embedded default (a file under the
data dir, one host); `HFPORT_DATABASE_URL=postgresql://…` selects PostgreSQL, shared by API processes and workers on
many hosts. The schema is versioned and migrated on open (migrations.py)."""

from __future__ import annotations

from pathlib import Path

from .base import KINDS, STATUSES, TERMINAL, BaseStore, IdempotencyKey, Lease, duplicate_worker_error
from .errors import (DatabaseRefused, DuplicateWorker, IdempotencyKeyUsed, LeaseLost, MissingDriver, ModelNameTaken,
                     SchemaTooNew, StoreError, StoreUnavailable)
from .migrations import LATEST as SCHEMA_VERSION
from .sqlite import SQLiteStore

Store = SQLiteStore  # the embedded default, by its historical name: Store(path)

__all__ = ["KINDS", "STATUSES", "TERMINAL", "SCHEMA_VERSION", "BaseStore", "SQLiteStore", "Store", "open_store",
           "Lease", "IdempotencyKey", "StoreError", "StoreUnavailable", "DatabaseRefused", "SchemaTooNew",
           "DuplicateWorker", "MissingDriver", "LeaseLost", "IdempotencyKeyUsed", "ModelNameTaken", "duplicate_worker_error"]

SCHEMES = ("postgresql://", "postgres://")


def open_store(target: str | Path, *, connect_timeout_s: float = 30.0) -> BaseStore:
    """A PostgreSQL URL opens PostgresStore (psycopg needed); anything else is a SQLite file path."""
    text = str(target)
    if text.startswith(SCHEMES):
        from .postgres import PostgresStore

        return PostgresStore(text, connect_timeout_s=connect_timeout_s)
    if "://" in text:
        raise StoreError(f"HFPORT_DATABASE_URL: unsupported scheme in {text.split('://')[0]!r}://…; "
                         f"use postgresql://user:password@host:port/dbname (or leave it unset for SQLite)")
    return SQLiteStore(text)
