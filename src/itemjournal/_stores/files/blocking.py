"""The file store's blocking face, for ``itemjournal.sync``: each call in its caller's thread.

It exists because a synchronous journal has no event loop and starts no thread per
call, while the awaited face hands each operation's disk work to a worker thread and
waits for a held lock with sleeps on the event loop. Here the very same work functions
run in the caller's thread, and a held lock is waited for by sleeping that thread
(``locks.retry_while_busy_blocking``: the same backoff, timeout and error). Every call is
counted (``Trips.blocking``), so closing waits for it and a closed store refuses it.

A save here never uses the fan-out descriptors that the awaited face keeps open while
its saves overlap (``kept``): it opens the fan-out and its ``.lock`` for itself
(``FileStore._apply_fresh``). Its record lock is then on an open file description that
no other thread, no awaited save and no forked child shares, so the kernel excludes them
all from one another, in this process as across processes; and the awaited face's count
of saves under way, which only the event loop touches, is never touched from a thread.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from datetime import timedelta
from typing import Protocol, TypeVar, TypeVarTuple, Unpack

from ..._model.errors import RecordInvalid, StorageFailed
from ..._model.identity import Identity
from ..._model.records import Record
from ..seam import StepFunction, Tally
from ..threads import Trips
from .kept import KeptFanouts
from .locks import Busy, retry_while_busy_blocking
from .scans import ScanCursor, peek_record, record_ages
from .settings import check_setting_text
from .temps import find_strays

__all__ = ["BlockingFace"]

T = TypeVar("T")
R = TypeVar("R")
Args = TypeVarTuple("Args")


class _FileStoreParts(Protocol):
    """What the blocking face uses of the file store it is part of."""

    location: str
    lock_timeout: float
    trust_shared_root: bool
    _trips: Trips
    _fanouts: KeptFanouts

    def _open_sync(self) -> None: ...

    def _setting_sync(self, name: str, value: str) -> str | Busy: ...

    def _apply_fresh(self, identity: Identity, step: StepFunction[T]) -> T | Busy: ...

    def _scan_cursor(self, status: str | None, after: str | None, batch: int) -> ScanCursor: ...


def _counted(trips: Trips, function: Callable[[Unpack[Args]], R], *args: *Args) -> R:
    """``function(*args)`` in this thread, counted as one of the store's blocking calls."""
    with trips.blocking():
        return function(*args)


class BlockingFace:
    """The ``BlockingStore`` calls of ``FileStore``: each does what the awaited call of
    the same name does, in the caller's thread."""

    def open_blocking(self: _FileStoreParts) -> None:
        """``open`` in the caller's thread."""
        _counted(self._trips, self._open_sync)

    def setting_blocking(self: _FileStoreParts, name: str, value: str) -> str:
        """``setting`` in the caller's thread; a settings lock held elsewhere is waited for
        by sleeping it, for at most ``lock_timeout`` seconds."""
        check_setting_text(name, value)
        return retry_while_busy_blocking(
            self._trips.blocking,
            f"the settings lock of {self.location}",
            self.lock_timeout,
            self._setting_sync,
            name,
            value,
        )

    def apply_blocking(self: _FileStoreParts, identity: Identity, step: StepFunction[T]) -> T:
        """``apply`` in the caller's thread, through descriptors of its own (see the
        module's docstring); a record lock held elsewhere is waited for by sleeping the
        thread, for at most ``lock_timeout`` seconds."""
        save: Callable[[Identity, StepFunction[T]], T | Busy] = self._apply_fresh
        return retry_while_busy_blocking(
            self._trips.blocking,
            f"the record lock of {list(identity)}",
            self.lock_timeout,
            save,
            identity,
            step,
        )

    def peek_blocking(
        self: _FileStoreParts, identity: Identity, view: Callable[[Record | None], T]
    ) -> T:
        """``peek`` in the caller's thread."""
        return _counted(
            self._trips, peek_record, self.location, identity, view, self.trust_shared_root
        )

    def scan_blocking(
        self: _FileStoreParts,
        *,
        status: str | None = None,
        after: str | None = None,
        batch: int = 256,
    ) -> Generator[Record | RecordInvalid | StorageFailed, None, None]:
        """``scan`` in the caller's thread: the same items in the same order, read a batch
        at a time as the caller consumes them. Each batch is one counted call; between
        batches nothing is held, so closing does not wait for a caller that stopped."""
        cursor = self._scan_cursor(status, after, batch)
        _counted(self._trips, cursor.start)
        while not cursor.done:
            yield from _counted(self._trips, cursor.next_batch)

    def tally_blocking(self: _FileStoreParts) -> Tally | None:
        """None, as ``tally``: counting the file store's records is a full scan (refused,
        like every call, once the store is closed)."""
        with self._trips.blocking():
            return None

    def check_blocking(self: _FileStoreParts) -> list[str]:
        """``check`` in the caller's thread."""
        return _counted(self._trips, find_strays, self.location)

    def ages_blocking(
        self: _FileStoreParts, identities: Sequence[Identity]
    ) -> list[timedelta | None]:
        """``ages`` in the caller's thread."""
        return _counted(self._trips, record_ages, self.location, list(identities))

    def close_blocking(self: _FileStoreParts) -> None:
        """``aclose`` for a caller without an event loop: refuse new calls, wait for those
        under way (blocking or awaited), then close the kept fan-out descriptors."""
        try:
            self._trips.close_blocking()
        finally:
            self._fanouts.close_all()
