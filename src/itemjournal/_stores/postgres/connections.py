"""The store's connections to the server: the pool of data connections, and connections
of their own for the owner lock, the probes at open and the settling of lost commits.

Every operation runs on one pooled connection (``psycopg_pool.ConnectionPool``) in one
worker-thread trip: psycopg's own async connection runs on asyncio only, and the journal
runs on trio too. Each pooled connection is set up to wait for a locked row at most
``lock_timeout`` and to commit synchronously, and its server session's own name (pid,
start) is kept for fencing. Behind a transaction pooler, which hands each transaction to
any server session, every write transaction sets these for itself instead.

**A host that dies holding a row.** A transaction of ours holds its row locks until the
server ends it. Each pooled session asks the server to probe its client as the owner
session does (TCP keepalives and ``tcp_user_timeout``, about 11 s), so a vanished host's
session ends within that; and ``idle_in_transaction_session_timeout`` (``idle_limit``)
ends a transaction of ours that waits for its client longer than any live one does,
which covers a client whose kernel still answers but whose process has stopped, and the
server sessions behind a pooler, whose socket leads to the pooler, not to the host.

**A statement_timeout is left as the role sets it.** The server disarms it before it
commits (``finish_xact_command``), so it never cuts a ``COMMIT``'s wait for the
synchronous standbys short, and the store's other statements keep the operator's bound.
A cancel does cut that wait (``pg_cancel_backend``, a pooler's query timeout, a blocking
caller's interrupt): ``settle.heard_cut`` hears it.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Final, TypeVar

import psycopg
import psycopg_pool

from ..._model.errors import StorageFailed
from ..threads import Trips
from .calls import Call
from .failures import failure
from .location import Location

__all__ = [
    "IDLE_MARGIN",
    "Connections",
    "ServerSession",
    "StepConnection",
    "connect",
    "idle_limit",
    "roll_back",
]

T = TypeVar("T")

# The server's own name for the session behind a connection: its pid, when it started,
# when the transaction under way began (None when only the session is known), and the
# synchronous_commit its commits wait for (what a lost commit must be proven to have).
ServerSession = tuple[int, object, object, str]

# Every write commits synchronously: at least ``on`` (the WAL flushed before COMMIT
# returns), keeping ``remote_apply`` where the server or role asks for it. From the
# weakest: off < local < remote_write < on < remote_apply.
_DURABLE: Final = (
    "CASE WHEN current_setting('synchronous_commit') IN ('off', 'local', 'remote_write') "
    "THEN 'on' ELSE current_setting('synchronous_commit') END"
)
# The server's own name for the session running this statement (libpq's backend pid is
# the pooler's invention behind one) and, for a transaction, when it began.
# The server probes a silent client of a pooled session as it does the owner session's
# (settings the server lacks, tcp_user_timeout before 12, are left out).
_PROBE_CLIENT: Final = (
    "(SELECT count(set_config(name, value, false)) FROM (VALUES ('tcp_keepalives_idle', '5'), "
    "('tcp_keepalives_interval', '2'), ('tcp_keepalives_count', '3'), "
    "('tcp_user_timeout', '11000')) AS bound(name, value) JOIN pg_settings USING (name))"
)
_SERVER_ID: Final = (
    "pg_backend_pid(), (SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()), "
    "now()"
)


IDLE_MARGIN: Final = 30.0
"""Seconds a transaction of ours may wait for its client beyond ``lock_timeout``."""


def idle_limit(lock_timeout: float) -> int:
    """``idle_in_transaction_session_timeout`` for the store's transactions, in ms.

    Between two statements of a transaction of ours the client only computes, except when
    a step renews a lost owner session: a connection bounded by ``lock_timeout``. So a
    live transaction never waits ``lock_timeout`` plus a margin for a loaded machine."""
    return round((lock_timeout + IDLE_MARGIN) * 1000)


def connect(conninfo: str, where: str, lock_timeout: float) -> psycopg.Connection[Any]:
    """A connection of its own (autocommit, no prepared statements), or
    ``STORAGE_FAILED`` saying why there is none."""
    try:
        return psycopg.connect(
            conninfo,
            autocommit=True,
            prepare_threshold=None,
            connect_timeout=max(1, round(lock_timeout)),
        )
    except psycopg.Error as error:
        raise failure(f"cannot connect to {where}", error) from error


def roll_back(connection: psycopg.Connection[Any]) -> None:
    """Roll back what ``connection`` has under way; a connection already lost has nothing
    left to roll back, so its error is no news."""
    with contextlib.suppress(Exception):
        connection.rollback()


class StepConnection(threading.local):
    """The connection a journal step (or a peek's view) runs on, in this thread: an
    owner-liveness question asked inside the step is answered on it, in its transaction,
    rather than waiting for a second pooled connection."""

    def __init__(self) -> None:
        self.connection: psycopg.Connection[Any] | None = None

    @contextlib.contextmanager
    def lent(self, connection: psycopg.Connection[Any]) -> Iterator[None]:
        self.connection = connection
        try:
            yield
        finally:
            self.connection = None


class Connections:
    """The pool of data connections of one store, and the server's name of each one's
    session."""

    def __init__(self, location: Location, lock_timeout: float, trips: Trips, name: str) -> None:
        self._location = location
        self._lock_timeout = lock_timeout
        self._trips = trips
        self._name = name  # the store, as its "closed" error names it
        self.pool: psycopg_pool.ConnectionPool[Any] | None = None
        # How the data connections reach the server, found by open: "direct", "session"
        # (a pooler that keeps one server session per client) or "transaction" (one that
        # hands a client's transactions to any server session: transaction or statement
        # pooling); "" before open.
        self.pooling = ""
        # The server's own name of the session behind each pooled connection (read
        # through SQL at connect, or at each write's start behind a transaction pooler).
        self._servers: weakref.WeakKeyDictionary[psycopg.Connection[Any], ServerSession] = (
            weakref.WeakKeyDictionary()
        )

    def open(self) -> None:
        """Open the pool (at least one connection made within ``lock_timeout``)."""
        kwargs: dict[str, Any] = {
            "autocommit": False,
            "connect_timeout": max(1, round(self._lock_timeout)),
        }
        if self.pooling == "transaction":
            kwargs["prepare_threshold"] = None  # a prepared statement lives in one session
        pool: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
            self._location.conninfo,
            min_size=1,
            max_size=self._location.pool_size,
            open=False,
            timeout=self._lock_timeout,
            kwargs=kwargs,
            configure=self._configure,
            name=f"itemjournal-{secrets.token_hex(4)}",
        )
        try:
            pool.open(wait=True, timeout=self._lock_timeout)
        except psycopg_pool.PoolTimeout as error:
            pool.close(timeout=0)
            raise failure(f"cannot connect to {self._location.shown}", error) from error
        self.pool = pool

    def detach(self) -> psycopg_pool.ConnectionPool[Any] | None:
        """The pool, which no trip takes a connection from any more; the caller closes it."""
        pool, self.pool = self.pool, None
        return pool

    def _configure(self, connection: psycopg.Connection[Any]) -> None:
        if self.pooling == "transaction":
            # Session settings would land on whichever server session ran the SET: each
            # write transaction makes its own (``start_write``).
            return
        # Rows another session holds are waited for at most lock_timeout; every commit
        # is synchronous; and the server's own name for this session, for fencing.
        # Its transactions never sit idle on the server, and a vanished client is noticed.
        row = connection.execute(
            f"SELECT set_config('lock_timeout', %s, false), "
            f"set_config('synchronous_commit', {_DURABLE}, false), "
            f"set_config('idle_in_transaction_session_timeout', %s, false), {_PROBE_CLIENT}, "
            f"{_SERVER_ID}",
            (self._lock_timeout_ms(), str(idle_limit(self._lock_timeout))),
        ).fetchone()
        assert row is not None
        self._servers[connection] = (int(row[4]), row[5], None, str(row[1]))
        connection.commit()

    def _lock_timeout_ms(self) -> str:
        return str(max(1, round(self._lock_timeout * 1000)))

    def start_write(self, connection: psycopg.Connection[Any]) -> None:
        """Behind a transaction pooler, the first statement of a write transaction: its
        lock wait, synchronous commit and idle limit (for this transaction only, on
        whichever server session runs it) and that session's name for fencing."""
        if self.pooling != "transaction":
            return
        row = connection.execute(
            f"SELECT set_config('lock_timeout', %s, true), "
            f"set_config('synchronous_commit', {_DURABLE}, true), "
            f"set_config('idle_in_transaction_session_timeout', %s, true), {_SERVER_ID}",
            (self._lock_timeout_ms(), str(idle_limit(self._lock_timeout))),
        ).fetchone()
        assert row is not None
        self._servers[connection] = (int(row[3]), row[4], row[5], str(row[1]))

    def server_of(self, connection: psycopg.Connection[Any]) -> ServerSession | None:
        """The server's own name of ``connection``'s session (never libpq's backend pid,
        which a pooler invents), if it was read."""
        return self._servers.get(connection)

    @contextlib.contextmanager
    def connection(self, call: Call | None = None) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection for this trip, rolled back and given back after it. Waits
        for one at most ``lock_timeout``, and (for a ``call``) until its caller is gone."""
        pool = self.pool
        if pool is None or self._trips.closed:
            raise StorageFailed(f"{self._name} is closed")
        deadline = time.monotonic() + self._lock_timeout
        try:
            while True:
                remaining = deadline - time.monotonic()
                try:
                    connection = pool.getconn(
                        timeout=max(0.001, remaining if call is None else min(remaining, 0.05))
                    )
                    break
                except psycopg_pool.PoolTimeout:
                    if time.monotonic() >= deadline:
                        raise
                    if call is not None and call.cancelled:
                        raise StorageFailed(
                            "the call was cancelled while it waited for a connection"
                        ) from None
        except psycopg_pool.PoolTimeout as error:
            raise failure(
                f"no connection to {self._location.shown} became free within "
                f"{self._lock_timeout:g} s (pool_size={self._location.pool_size})",
                error,
            ) from error
        except psycopg_pool.PoolClosed as error:
            raise failure(f"{self._name} is closed", error) from error
        try:
            yield connection
        finally:
            if connection.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                roll_back(connection)
            pool.putconn(connection)

    def idempotent(self, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run ``work`` (which reads, or writes only what may be written twice) on a pooled
        connection. A connection the server dropped while it sat idle in the pool fails
        at its first statement: then ``work`` runs again, on another connection (after a
        server restart every idle connection is such a one, so up to the pool's size)."""
        size = self._location.pool_size
        for attempt in range(size + 1):
            with self.connection() as connection:
                try:
                    return work(connection)
                except psycopg.OperationalError:
                    if attempt == size or not connection.broken:
                        raise
        raise AssertionError("unreachable")  # pragma: no cover
