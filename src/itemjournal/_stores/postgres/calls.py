"""One operation's worker trip, as its caller's cancellation sees it.

A trip blocks in psycopg (waiting for a row lock, a pooled connection, the server), where
anyio's cancellation cannot reach. The event loop marks the ``Call`` cancelled and a thread
of its own asks the server to cancel the statement under way; once the commit has begun,
nothing interrupts it, so that the outcome of a write is never cut in half.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import psycopg

from ..._model.errors import StorageFailed

__all__ = ["Call"]


class Call:
    """One operation's worker trip, as its caller's cancellation sees it: while the trip
    waits (for a row lock, a connection, the server), a cancel interrupts the statement
    under way; once the commit has begun, nothing interrupts it."""

    __slots__ = ("cancelled", "committing", "connection", "done", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.connection: psycopg.Connection[Any] | None = None
        self.cancelled = False
        self.committing = False
        self.done = threading.Event()

    def cancel(self) -> None:
        """On the event loop: the caller is gone. Interrupt what runs, from a thread of its
        own (asking the server to cancel means connecting to it)."""
        with self.lock:
            if self.cancelled:
                return
            self.cancelled = True
        threading.Thread(target=self._interrupt, daemon=True).start()

    def _interrupt(self) -> None:
        # A cancel request that reaches the server between two statements is lost, so it
        # is repeated until the trip ends or its commit begins.
        while not self.done.is_set():
            with self.lock:
                connection = None if self.committing else self.connection
            if connection is not None:
                with contextlib.suppress(Exception):
                    connection.cancel_safe(timeout=5.0)
            self.done.wait(0.02)

    def use(self, connection: psycopg.Connection[Any] | None) -> None:
        """The trip holds ``connection`` now (None: none); raises if the caller is gone."""
        with self.lock:
            self.connection = connection
            if connection is not None and self.cancelled:
                raise StorageFailed("the call was cancelled before it began; nothing was written")

    def may_commit(self) -> bool:
        """Called just before ``COMMIT``: False when the caller is gone (then roll back)."""
        with self.lock:
            self.committing = not self.cancelled
            return self.committing
