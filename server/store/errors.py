"""What can go wrong opening or using a store, as types the CLI and the worker render (never string-matched)."""

from __future__ import annotations


class StoreError(RuntimeError):
    """The job store cannot be used as configured."""


class StoreUnavailable(StoreError):
    """The database does not answer (at start: after the bounded retries)."""


class SchemaTooNew(StoreError):
    """The database was migrated by a newer hfport; this one refuses to write to it."""


class DuplicateWorker(StoreError):
    """Another live worker holds this worker id."""


class MissingDriver(StoreError):
    """A postgresql:// URL without psycopg installed."""
