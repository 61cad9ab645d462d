"""The SQLite store across ``os.fork``: a child works as if it had opened the store itself.

SQLite keeps what a process knows of a database file (its POSIX locks, the shared memory
of the write-ahead log) in the process, shared by every connection to that file, and a
forked child inherits it: with a connection open across the fork, SQLite in the child
believes it holds the locks its parent held. A new connection of the child's then waits
forever for a write lock that a transaction of its parent held at the fork, or writes
without really holding the shared lock that keeps the write-ahead log alive, into a log
that the parent deletes when it closes its last connection: commits the child was told
are durable would be lost.

So, before a fork, each store (``ForkSafe``) waits for its batch and its reads under way
(at most its ``busy_timeout``), holds off new ones, and closes its connections; after it,
both sides make new connections on first use (the writer's as after a failed rollback,
see ``batch``). In the child every store also gets new locks, an empty queue and no
writer thread: the calls under way at the fork are the parent's. A store that could not
be made idle in time keeps its connections in the parent; the child takes them out of use
without closing them (closing one there could checkpoint the log or drop locks that are
the parent's), and keeps them referenced forever, so they are never finalised.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
import weakref

from .pool import ReaderPool
from .writer import BatchWriter

__all__ = ["ForkSafe"]


class ForkSafe(ReaderPool, BatchWriter):
    """The connections of a store, closed (all of them idle) before a fork, and the
    writer's and readers' state, made anew in a forked child."""

    def _track_forks(self) -> None:
        """From now on (the store fully made), made ready for each fork."""
        _STORES.add(self)

    def _take_connections(self) -> list[sqlite3.Connection]:
        """Every connection not in use, taken out of use (``_readers_lock`` held: no read
        checks one out meanwhile; the writer's only between batches)."""
        connections, self._idle_readers = self._idle_readers, []
        if self._writer is not None:
            connections.append(self._writer)
            self._writer = None
        return connections

    def _close_sync(self) -> None:
        """Close every connection: the store is closed, and its writer not reopened."""
        with self._readers_lock:
            connections = self._take_connections()
        for connection in connections:
            connection.close()

    def _quiesce_for_fork(self) -> bool:
        """Before a fork: wait for the batch and the reads under way, hold off new ones
        (until ``_resume_after_fork``, or in the child for good) and close every
        connection. False, with nothing held, when they did not end within
        ``busy_timeout``."""
        deadline = time.monotonic() + self.busy_timeout
        if not self._gate.acquire(timeout=self.busy_timeout):
            return False
        while True:
            self._readers_lock.acquire()
            if not self._reading:
                break
            self._readers_lock.release()  # reads end by giving their connection back
            if time.monotonic() >= deadline:
                self._gate.release()
                return False
            time.sleep(0.0002)
        had_writer = self._writer is not None
        for connection in self._take_connections():
            with contextlib.suppress(Exception):  # a fork goes on whatever closing says
                connection.close()
        if had_writer:
            self._writer_lost = True  # made anew by the next batch, on either side
        return True

    def _resume_after_fork(self) -> None:
        """In the parent, after a fork that ``_quiesce_for_fork`` prepared."""
        self._readers_lock.release()
        self._gate.release()

    def _restart_in_child(self) -> None:  # pragma: no cover - runs in forked children
        """In a forked child: new locks, no writer thread, no connection of the parent's."""
        self._writer_after_fork()
        self._readers_lock = threading.Lock()
        self._reading = 0  # the reads under way are the parent's
        had_writer = self._writer is not None
        _INHERITED.extend(self._take_connections())
        if had_writer:
            self._writer_lost = True


# Every store made in this process (weakly: a store that is gone needs nothing at a fork).
_STORES: weakref.WeakSet[ForkSafe] = weakref.WeakSet()
# The stores idle for the fork under way, in this process.
_QUIESCED: list[ForkSafe] = []
# Connections a child inherited but must neither use nor close (see above).
_INHERITED: list[sqlite3.Connection] = []


def _before_fork() -> None:
    for store in list(_STORES):
        if store._quiesce_for_fork():
            _QUIESCED.append(store)


def _after_fork_in_parent() -> None:
    while _QUIESCED:
        _QUIESCED.pop()._resume_after_fork()


def _after_fork_in_child() -> None:  # pragma: no cover - runs in forked children
    _QUIESCED.clear()
    for store in list(_STORES):
        store._restart_in_child()


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)
