"""The PostgreSQL store's blocking face (``BlockingStore``), for ``itemjournal.sync``.

Each call runs the very worker function that its awaited twin hands to a worker thread,
here in the caller's own thread, counted by ``Trips.blocking`` so that closing waits for
it. No event loop and no thread is involved: a call beyond the pool's connections waits
in the pool itself (``Connections.connection``), for at most ``lock_timeout``, and then
fails with the same ``STORAGE_FAILED`` (``ETIMEDOUT``) as an awaited one. Blocking calls
take no turn among the awaited trips (``Trips``' ``at_once``): those turns keep worker
threads from idling in the pool, and a blocking caller's thread is its own.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from datetime import timedelta
from typing import Protocol, TypeVar

from ..._model.errors import RecordInvalid, StorageFailed
from ..._model.identity import Identity
from ..._model.records import Record
from ..seam import StepFunction, Tally
from ..threads import Trips
from .calls import Call
from .reads import Reads

__all__ = ["BlockingFace"]

T = TypeVar("T")


class _Store(Protocol):
    """What of the store the blocking face calls: its awaited face's worker functions."""

    _trips: Trips
    _reads: Reads

    def _open_sync(self) -> None: ...

    def _close_sync(self) -> None: ...

    def _record_setting(self, name: str, value: str) -> str: ...

    def _apply_sync(
        self, identity: Identity, step: StepFunction[T], call: Call, *, blocking: bool = False
    ) -> T: ...

    def _tally_sync(self) -> Tally: ...

    def _check_sync(self) -> list[str]: ...

    def _ages_sync(self, identities: Sequence[Identity]) -> list[timedelta | None]: ...

    @staticmethod
    def _scan_start(status: str | None, after: str | None) -> str: ...


class BlockingFace:
    """``PostgresStore``'s ``*_blocking`` calls (see ``BlockingStore``)."""

    def open_blocking(self: _Store) -> None:
        with self._trips.blocking():
            self._open_sync()

    def setting_blocking(self: _Store, name: str, value: str) -> str:
        with self._trips.blocking():
            return self._record_setting(name, value)

    def apply_blocking(self: _Store, identity: Identity, step: StepFunction[T]) -> T:
        # A call of its own, never cancelled: a blocking caller is interrupted only by a
        # KeyboardInterrupt, which psycopg turns into a cancel of the statement under way.
        with self._trips.blocking():
            return self._apply_sync(identity, step, Call(), blocking=True)

    def peek_blocking(self: _Store, identity: Identity, view: Callable[[Record | None], T]) -> T:
        with self._trips.blocking():
            return self._reads.peek(identity, view)

    def scan_blocking(
        self: _Store, *, status: str | None = None, after: str | None = None, batch: int = 256
    ) -> Generator[Record | RecordInvalid | StorageFailed, None, None]:
        bound: str | None = self._scan_start(status, after)
        while bound is not None:
            # Counted while a page is read, not while the caller holds the generator: a
            # scan left unfinished must not keep close waiting.
            with self._trips.blocking():
                page, bound = self._reads.page(bound, batch, status)
            yield from page

    def tally_blocking(self: _Store) -> Tally:
        with self._trips.blocking():
            return self._tally_sync()

    def check_blocking(self: _Store) -> list[str]:
        with self._trips.blocking():
            return self._check_sync()

    def ages_blocking(self: _Store, identities: Sequence[Identity]) -> list[timedelta | None]:
        with self._trips.blocking():
            return self._ages_sync(identities)

    def close_blocking(self: _Store) -> None:
        self._trips.close_blocking()
        self._close_sync()
