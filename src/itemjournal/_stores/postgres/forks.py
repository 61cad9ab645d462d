"""The PostgreSQL store in a child made by ``fork`` (Celery's prefork pool, gunicorn's
``--preload``, ``multiprocessing``'s fork context): it works there as if opened there.

A child shares its parent's sockets. Closing an inherited libpq connection sends a
Terminate on the shared socket and ends the *parent's* server session: on the owner-lock
session, the parent's owner lock goes with it and its live claims look gone to every host.
A pooled connection used by both would mix two processes' statements in one session. And
a lock or a pool thread inherited from the parent may be held by a thread that does not
exist in the child. So, right after a fork, every store of the process starts over with
parts of its own (``PostgresStore._start_over``): a new pool, made at the child's first
use, and a new owner session, taken before the child's first claim, so that the child's
claims are vouched for by a session of its own. The inherited parts are kept here,
referenced for the rest of the child's life, so that nothing ever finalises them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import psycopg
import psycopg_pool

from ..threads import Trips
from .calls import Call
from .connections import Connections
from .location import Location

__all__ = ["ChildConnections", "is_pending", "watch"]


class _Forkable(Protocol):
    def _start_over(self) -> object:
        """Take parts of its own; answer the inherited ones."""
        ...


_STORES: weakref.WeakSet[_Forkable] = weakref.WeakSet()
# What the stores of this process inherited at each fork, never to be closed or finalised.
_INHERITED: list[object] = []


def watch(store: _Forkable) -> None:
    """Have ``store`` start over in every child forked from this process from now on."""
    _STORES.add(store)


def _in_child() -> None:  # pragma: no cover - runs in forked children (fork tests)
    # In the child, before anything else runs there: no I/O, nothing that could block.
    for store in list(_STORES):
        _INHERITED.append(store._start_over())


os.register_at_fork(after_in_child=_in_child)


def is_pending(connections: Connections) -> bool:
    """Whether ``connections`` are a child's whose pool is still to be made at first use."""
    return isinstance(connections, ChildConnections) and connections.pending


class ChildConnections(Connections):
    """The data connections, in a forked child, of a store its parent had opened: the pool
    is made at the first connection asked for (a child that never uses the store connects
    to nothing), with what the parent's open learnt of the server (``pooling``). A pool
    that could not be made is tried again at the next call."""

    def __init__(
        self, location: Location, lock_timeout: float, trips: Trips, name: str, pooling: str
    ) -> None:
        super().__init__(location, lock_timeout, trips, name)
        self.pooling = pooling
        self._opening = threading.Lock()
        self._pending = True  # no pool made yet, and none closed

    @property
    def pending(self) -> bool:
        return self._pending

    def open(self) -> None:
        self._open(pending_only=False)

    def _open(self, *, pending_only: bool) -> None:
        with self._opening:
            if self.pool is None and (self._pending or not pending_only):
                super().open()
            self._pending = False

    def detach(self) -> psycopg_pool.ConnectionPool[Any] | None:
        with self._opening:
            self._pending = False  # closed: no pool is made for a later call
            return super().detach()

    @contextlib.contextmanager
    def connection(self, call: Call | None = None) -> Iterator[psycopg.Connection[Any]]:
        if self._pending and not self._trips.closed:  # a closing store makes no pool
            self._open(pending_only=True)
        with super().connection(call) as connection:
            yield connection
