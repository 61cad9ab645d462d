"""The SQLite store's blocking face (``BlockingStore``), for ``itemjournal.sync``.

Each call does what the awaited call of the same name does, in its caller's thread: the
reads are the same functions (``pool``) that an awaited read runs in a worker thread;
a write is queued for the same writer (``writer``) and shares its batches, its one
transaction and its one commit, with awaited writes, its thread blocking until the
writer thread sets the operation's own waker; when nothing is queued or under way, a
caller outside the main thread runs its write as a batch of one itself. No event loop
is started or needed.

A ``KeyboardInterrupt`` while a write waits for its turn takes it out of the queue
(nothing was started); one that comes while its batch runs is held until the batch has
settled the write, then raised. Closing, from either face, waits for what either face
has under way: the queue holds every write, ``_reading`` counts every read.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable, Generator, Sequence
from datetime import timedelta
from typing import TypeVar

from ..._model.errors import RecordInvalid, StorageFailed
from ..._model.identity import Identity
from ..._model.records import Record
from ..seam import StepFunction, Tally
from .forking import ForkSafe
from .opening import OpenRetry, _Opening
from .operation import _Operation
from .reads import _Bound

__all__ = ["BlockingFace"]

T = TypeVar("T")


class BlockingFace(ForkSafe):
    """The ``_blocking`` calls of ``BlockingStore``, over the store's pool and writer."""

    @abc.abstractmethod
    def _open_step(self, opening: _Opening) -> bool:
        """One try at opening; False when another process holds a lock it needs."""

    def open_blocking(self) -> None:
        """``open``, waiting between tries in this thread (at most ``busy_timeout``)."""
        opening = _Opening()
        retry = OpenRetry(self.path, self.busy_timeout, time.monotonic())
        try:
            while not self._open_step(opening):
                time.sleep(retry.next_delay(time.monotonic()))
        except BaseException:
            if opening.connection is not None:
                opening.connection.close()
            raise
        self._writer = opening.connection

    def setting_blocking(self, name: str, value: str) -> str:
        key = self._setting_key(name, value)
        if self._closed:
            raise StorageFailed(f"{self!r} is closed")
        recorded = self._setting_sync(key)
        if recorded is not None:
            return recorded
        operation: _Operation[str] = _Operation(key, setting=(key, value))
        return self._submit_blocking(operation)

    def apply_blocking(self, identity: Identity, step: StepFunction[T]) -> T:
        return self._submit_blocking(_Operation.of(identity, step))

    def peek_blocking(self, identity: Identity, view: Callable[[Record | None], T]) -> T:
        return self._peek_sync(identity, view)

    def scan_blocking(
        self, *, status: str | None = None, after: str | None = None, batch: int = 256
    ) -> Generator[Record | RecordInvalid | StorageFailed, None, None]:
        """``scan``: a page per read, each read only when the one before is consumed."""
        bound: _Bound | None = self._scan_start(after)
        while bound is not None:
            page, bound = self._page_sync(bound, batch, status)
            yield from page

    def tally_blocking(self) -> Tally:
        return Tally(self._tally_sync(), exact=False)

    def check_blocking(self) -> list[str]:
        return self._check_sync()

    def ages_blocking(self, identities: Sequence[Identity]) -> list[timedelta | None]:
        return self._ages_sync(list(identities))

    def close_blocking(self) -> None:
        """``aclose`` in this thread: refuse new calls, let the writes queued (by either
        face) be done and the writer thread end, wait for the reads under way, then close
        the connections. Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        thread = self._request_stop()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        delay = 0.0002
        # Reads, and a write run alone by its caller, end in other threads: poll.
        while self._reading or self._alone:
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
        self._close_sync()
