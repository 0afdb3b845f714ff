"""PostgreSQL, selected by HFPORT_DATABASE_URL=postgresql://…: one database shared by API processes and workers on
any number of hosts. psycopg 3 (the `postgres` extra); a few pooled connections per process.

Claims use `SELECT … FOR UPDATE SKIP LOCKED` (two workers never take the same job, and neither waits on the other's
claim); timestamps and lease comparisons use the server's `clock_timestamp()`, so worker clocks do not matter.
Opening a store retries an unreachable server with backoff, for a bounded time, logging once; a server that answers
with a refusal retrying cannot fix (a wrong password, an unknown role or database) stops it at once, naming the reason.

A client cut off in the middle of a transaction (a network partition) would keep its row locks until the server
noticed it was gone (TCP keepalive: hours), blocking the worker that must requeue its job. Every session therefore
runs with idle_in_transaction_session_timeout: the store's transactions never wait between statements, so a session
idle inside one for that long is a client that is gone; the server ends it and its locks are released (its writes
rolled back, never committed).

The client side needs a bound too: a statement sent over a link that went silent (a partition, a hung server or
proxy) waits for its answer until TCP gives up (about 15 minutes of retransmissions on Linux; forever when a proxy
in between still acknowledges). Every transaction therefore has a deadline (transaction_timeout_s, 10 s): past it,
one watchdog thread shuts the connection's socket down, the blocked call returns, and the caller gets
StoreUnavailable as for a refused connection; the connection is dropped. So an API request answers, and a worker's
loop notices the outage, within the deadline whatever the network does.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .base import BaseStore
from .errors import DatabaseRefused, MissingDriver, StoreUnavailable
from .migrations import migrate

log = logging.getLogger("hfport.server.store")

_MIGRATION_LOCK = 0x6866706F7274  # "hfport": the advisory lock key the migration holds
_NAME_LOCK = 0x6866  # "hf": the first key of a model name's advisory lock (two int4 keys: apart from the one above)
TRANSACTION_TIMEOUT_S = 10.0  # the store's transactions are a few short statements: one this slow has lost its server
MIGRATION_TIMEOUT_S = 300.0  # a migration may rewrite whole tables (and others starting together wait on its lock)
# the FATAL answers at connection time that pass by themselves, retried as an unreachable server is: a server starting
# up (docker compose starts the database and hfport together), shutting down or in recovery, or out of connection
# slots. libpq reports a failed connection as text only (no SQLSTATE), so these are told apart by the server's words
PASSING_REFUSALS = ("starting up", "shutting down", "in recovery", "accepting connections",
                    "too many clients", "too many connections", "connection slots are reserved")


def redact(url: str) -> str:
    """The URL without its password (for messages and logs)."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def refusal(error: str) -> str | None:
    """The server's reason when ERROR (a failed connection's message) is a refusal that retrying cannot fix: a FATAL
    answer other than PASSING_REFUSALS (a wrong password, an unknown role or database, no pg_hba.conf entry). None for
    a connection-level failure (refused, timed out, reset, a host name that does not resolve), where no server
    answered, and for a passing refusal."""
    _, fatal, reason = error.partition("FATAL:")
    reason = reason.strip().splitlines()[0] if reason.strip() else ""
    if not fatal or any(words in reason for words in PASSING_REFUSALS):
        return None
    return reason


class _Conn:
    """A psycopg connection that speaks the store's `?` placeholders (the SQL never contains a literal ?)."""

    def __init__(self, conn: Any):
        self.conn = conn

    def execute(self, sql: str, params: tuple | list | None = None) -> Any:
        if params is None:
            return self.conn.execute(sql)
        return self.conn.execute(sql.replace("?", "%s"), params)


class _Deadlines:
    """Transactions in flight, each with the moment it must have ended. One daemon thread for the process shuts down
    the socket of any still running past it (a dup of its descriptor: the connection's own is never closed here, so
    it cannot be reused under another connection), which makes the blocked libpq call fail at once."""

    def __init__(self) -> None:
        self._tokens = iter(range(1, 1 << 62))
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked child has no watchdog thread and owns no socket

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[int, tuple[float, int]] = {}  # token -> (monotonic deadline, socket descriptor)
        self._thread: threading.Thread | None = None

    def watch(self, fd: int, timeout_s: float) -> int:
        with self._cond:
            token = next(self._tokens)
            self._due[token] = (time.monotonic() + timeout_s, fd)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hfport-store-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()
            return token

    def release(self, token: int) -> bool:
        """Stop watching; False when the deadline had passed and the socket was shut down."""
        with self._cond:
            return self._due.pop(token, None) is not None

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for token, (deadline, fd) in list(self._due.items()):
                    if deadline <= now:
                        del self._due[token]  # under the lock: release() sees it fired; the fd is still open
                        _shut_down(fd)
                self._cond.wait(min((d for d, _ in self._due.values()), default=now + 60) - now)


def _shut_down(fd: int) -> None:
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


_DEADLINES = _Deadlines()


class PostgresStore(BaseStore):
    dialect = "postgresql"
    NOW = "extract(epoch from clock_timestamp())::double precision"
    SKIP_LOCKED = " FOR UPDATE SKIP LOCKED"
    FOR_UPDATE = " FOR UPDATE"

    def __init__(self, url: str, *, connect_timeout_s: float = 30.0, pool_size: int = 4,
                 idle_in_transaction_s: float = 5.0, transaction_timeout_s: float = TRANSACTION_TIMEOUT_S):
        try:
            import psycopg  # noqa: F401
        except ImportError as e:
            raise MissingDriver(f"HFPORT_DATABASE_URL is a PostgreSQL URL but psycopg is not installed ({e}); "
                                f"pip install 'hfport[postgres]'") from e
        self.url, self.pool_size, self.idle_in_transaction_s = url, pool_size, idle_in_transaction_s
        self.transaction_timeout_s = transaction_timeout_s
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
        at the first failure, none per retry; StoreUnavailable naming the server and the last error at the end.
        DatabaseRefused at once when the server refuses for a reason retrying cannot fix (refusal) or the URL is
        malformed."""
        import psycopg

        deadline, delay, attempts = time.monotonic() + budget_s, 0.25, 0
        while True:
            attempts += 1
            try:
                self._idle.append(self._new_connection(min(10.0, max(1.0, deadline - time.monotonic()))))
                if attempts > 1:
                    log.warning("%s answered after %d attempts", self.describe(), attempts)
                return
            except psycopg.ProgrammingError as e:  # a malformed URL (an unknown query parameter): no server was asked
                raise DatabaseRefused(f"{self.describe()}: {str(e).strip() or type(e).__name__}") from None
            except psycopg.OperationalError as e:
                if (reason := refusal(str(e))) is not None:
                    raise DatabaseRefused(f"the {self.describe()} refused the connection: {reason} (retrying cannot "
                                          "help: correct HFPORT_DATABASE_URL or the server's configuration)") from None
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
    def connect(self, timeout_s: float | None = None) -> Iterator[_Conn]:
        """A pooled connection in one transaction (committed on success, rolled back on error). StoreUnavailable
        when the server cannot be reached or the transaction has no answer within `timeout_s` (default
        transaction_timeout_s)."""
        import psycopg

        timeout_s = self.transaction_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        try:
            if conn is None or conn.closed:
                conn = self._new_connection(min(10.0, timeout_s))
        except psycopg.OperationalError as e:
            raise StoreUnavailable(f"{self.describe()}: {str(e).strip() or type(e).__name__}") from e
        healthy, fired, token = False, False, _DEADLINES.watch(conn.fileno(), timeout_s)
        try:
            with conn.transaction():
                yield _Conn(conn)
            healthy = True
        except (psycopg.OperationalError, psycopg.errors.IdleInTransactionSessionTimeout) as e:  # the session is gone
            fired, token = not _DEADLINES.release(token), None
            cause = f"no answer within {timeout_s:g} s; the transaction was abandoned" if fired else \
                str(e).strip() or type(e).__name__
            raise StoreUnavailable(f"{self.describe()}: {cause}") from e
        finally:
            # released before the connection can go back to the pool, so a deadline never fires on the next user's
            # transaction; one that fired left the socket shut down: that connection is dropped
            if token is not None:
                fired = not _DEADLINES.release(token)
            # a connection that failed mid-transaction is dropped rather than reused
            if not fired and (healthy or (not conn.closed and conn.info.transaction_status == 0)):  # 0: IDLE
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

    def migrate(self) -> list[int]:
        """As BaseStore.migrate, with a longer deadline (MIGRATION_TIMEOUT_S) than a request's transaction."""
        with self.connect(timeout_s=MIGRATION_TIMEOUT_S) as db:
            self._migration_lock(db)
            return migrate(db, self.dialect, self.describe())

    def _migration_lock(self, db: _Conn) -> None:
        db.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))

    def _name_lock(self, db: _Conn, name: str) -> None:
        # names whose hashes collide share a lock: they only wait on each other for a moment
        db.execute("SELECT pg_advisory_xact_lock(?::int4, hashtext(?::text))", (_NAME_LOCK, name))
