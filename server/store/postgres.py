"""PostgreSQL, selected by HFPORT_DATABASE_URL=postgresql://…: one database shared by API processes and workers on
any number of hosts. psycopg 3 (the `postgres` extra); a few pooled connections per process.

Claims use `SELECT … FOR UPDATE SKIP LOCKED` (two workers never take the same job, and neither waits on the other's
claim); timestamps and lease comparisons use the server's `clock_timestamp()`, so worker clocks do not matter.
Opening a store retries an unreachable server with backoff, for a bounded time, logging once.

A client cut off in the middle of a transaction (a network partition) would keep its row locks until the server
noticed it was gone (TCP keepalive: hours), blocking the worker that must requeue its job. Every session therefore
runs with idle_in_transaction_session_timeout: the store's transactions never wait between statements, so a session
idle inside one for that long is a client that is gone; the server ends it and its locks are released (its writes
rolled back, never committed).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .base import BaseStore
from .errors import MissingDriver, StoreUnavailable

log = logging.getLogger("hfport.server.store")

_MIGRATION_LOCK = 0x6866706F7274  # "hfport": the advisory lock key the migration holds


def redact(url: str) -> str:
    """The URL without its password (for messages and logs)."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


class _Conn:
    """A psycopg connection that speaks the store's `?` placeholders (the SQL never contains a literal ?)."""

    def __init__(self, conn: Any):
        self.conn = conn

    def execute(self, sql: str, params: tuple | list | None = None) -> Any:
        if params is None:
            return self.conn.execute(sql)
        return self.conn.execute(sql.replace("?", "%s"), params)


class PostgresStore(BaseStore):
    dialect = "postgresql"
    NOW = "extract(epoch from clock_timestamp())::double precision"
    SKIP_LOCKED = " FOR UPDATE SKIP LOCKED"
    FOR_UPDATE = " FOR UPDATE"

    def __init__(self, url: str, *, connect_timeout_s: float = 30.0, pool_size: int = 4,
                 idle_in_transaction_s: float = 5.0):
        try:
            import psycopg  # noqa: F401
        except ImportError as e:
            raise MissingDriver(f"HFPORT_DATABASE_URL is a PostgreSQL URL but psycopg is not installed ({e}); "
                                f"pip install 'hfport[postgres]'") from e
        self.url, self.pool_size, self.idle_in_transaction_s = url, pool_size, idle_in_transaction_s
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        self._open_with_retry(connect_timeout_s)
        self.migrate()

    def describe(self) -> str:
        return f"PostgreSQL database {redact(self.url)}"

    # --- connections ------------------------------------------------------------------------------------------

    def _new_connection(self, timeout: float = 10.0) -> Any:
        import psycopg
        from psycopg.rows import dict_row

        idle_ms = int(self.idle_in_transaction_s * 1000)
        return psycopg.connect(self.url, autocommit=True, row_factory=dict_row,
                               connect_timeout=max(1, int(timeout)), application_name="hfport",
                               options=f"-c idle_in_transaction_session_timeout={idle_ms}")

    def _open_with_retry(self, budget_s: float) -> None:
        """Connect, retrying with exponential backoff (0.25 s doubling to 5 s) for at most `budget_s`. One warning
        at the first failure, none per retry; StoreUnavailable naming the server and the last error at the end."""
        import psycopg

        deadline, delay, attempts = time.monotonic() + budget_s, 0.25, 0
        while True:
            attempts += 1
            try:
                self._idle.append(self._new_connection(min(10.0, max(1.0, deadline - time.monotonic()))))
                if attempts > 1:
                    log.warning("%s answered after %d attempts", self.describe(), attempts)
                return
            except psycopg.OperationalError as e:
                error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreUnavailable(f"cannot reach the {self.describe()} after {attempts} attempts over "
                                           f"{budget_s:.0f} s: {error}") from None
                if attempts == 1:
                    log.warning("%s does not answer (%s); retrying for up to %.0f s", self.describe(), error,
                                budget_s)
                time.sleep(min(delay, left))
                delay = min(delay * 2, 5.0)

    @contextmanager
    def connect(self) -> Iterator[_Conn]:
        """A pooled connection in one transaction (committed on success, rolled back on error)."""
        import psycopg

        with self._lock:
            conn = self._idle.pop() if self._idle else None
        try:
            if conn is None or conn.closed:
                conn = self._new_connection()
        except psycopg.OperationalError as e:
            raise StoreUnavailable(f"{self.describe()}: {str(e).strip() or type(e).__name__}") from e
        healthy = False
        try:
            with conn.transaction():
                yield _Conn(conn)
            healthy = True
        except (psycopg.OperationalError, psycopg.errors.IdleInTransactionSessionTimeout) as e:  # the session is gone
            raise StoreUnavailable(f"{self.describe()}: {str(e).strip() or type(e).__name__}") from e
        finally:
            # a connection that failed mid-transaction is dropped rather than reused
            if healthy or (not conn.closed and conn.info.transaction_status == 0):  # 0: IDLE
                with self._lock:
                    if len(self._idle) < self.pool_size:
                        self._idle.append(conn)
                        conn = None
            if conn is not None:
                conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _migration_lock(self, db: _Conn) -> None:
        db.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
