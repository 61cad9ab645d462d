"""The in-memory store's blocking face, for ``itemjournal.sync``: each call in its caller's
thread.

It exists because a synchronous journal has no event loop: where the awaited face runs a
step on the loop (and in a worker thread only when the step must read files), this one
runs it in the caller's thread, holding the identity's lock for the read-step-write, as
a worker trip does. That lock also keeps it apart from the awaited face's steps, which
never wait for it on the loop (they go to a worker thread when it is held). Every call is
counted (``Trips.blocking``), so closing waits for it and a closed store refuses it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from datetime import timedelta
from typing import Protocol, TypeVar

from .._model.errors import InvalidArgument, RecordInvalid, StorageFailed
from .._model.identity import Identity
from .._model.records import Record
from .files.settings import check_setting_text
from .seam import StepFunction, Tally
from .threads import Trips

__all__ = ["MemoryBlockingFace", "check_batch"]

T = TypeVar("T")


def check_batch(batch: int) -> None:
    """Refuse (``INVALID_ARGUMENT``) a scan's batch that is not a positive integer."""
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise InvalidArgument(
            f"a scan's batch is a positive integer, not {batch!r}", code="INVALID_ARGUMENT"
        )


class _MemoryStoreParts(Protocol):
    """What the blocking face uses of the memory store it is part of."""

    _trips: Trips
    _settings: dict[str, str]

    def _apply_sync(self, identity: Identity, step: StepFunction[T]) -> T: ...

    def _peek_sync(self, identity: Identity, view: Callable[[Record | None], T]) -> T: ...

    def _digests_sync(self, after: str | None = None) -> list[str]: ...

    def _load_sync(
        self, digests: list[str], status: str | None
    ) -> list[Record | RecordInvalid | StorageFailed]: ...

    def _tally_sync(self) -> dict[str, int]: ...


class MemoryBlockingFace:
    """The ``BlockingStore`` calls of ``MemoryStore``: each does what the awaited call of
    the same name does, in the caller's thread."""

    def open_blocking(self: _MemoryStoreParts) -> None:
        """Nothing to open; refused (``STORAGE_FAILED``) once the store is closed."""
        with self._trips.blocking():
            return

    def setting_blocking(self: _MemoryStoreParts, name: str, value: str) -> str:
        """``setting`` in the caller's thread."""
        check_setting_text(name, value)
        with self._trips.blocking():
            return self._settings.setdefault(name, value)

    def apply_blocking(self: _MemoryStoreParts, identity: Identity, step: StepFunction[T]) -> T:
        """``apply`` in the caller's thread: the identity's lock is taken (waiting for it
        by blocking the thread), then the record read, ``step`` run and its write kept."""
        with self._trips.blocking():
            return self._apply_sync(identity, step)

    def peek_blocking(
        self: _MemoryStoreParts, identity: Identity, view: Callable[[Record | None], T]
    ) -> T:
        """``peek`` in the caller's thread."""
        with self._trips.blocking():
            return self._peek_sync(identity, view)

    def scan_blocking(
        self: _MemoryStoreParts,
        *,
        status: str | None = None,
        after: str | None = None,
        batch: int = 256,
    ) -> Generator[Record | RecordInvalid | StorageFailed, None, None]:
        """``scan`` in the caller's thread: the digests taken when it starts, then read a
        batch at a time as the caller consumes them. Each batch is one counted call;
        between batches nothing is held, so closing does not wait for a caller that
        stopped, and the next batch after a close is refused."""
        check_batch(batch)
        with self._trips.blocking():
            digests = self._digests_sync(after)
        for start in range(0, len(digests), batch):
            with self._trips.blocking():
                page = self._load_sync(digests[start : start + batch], status)
            yield from page

    def tally_blocking(self: _MemoryStoreParts) -> Tally:
        """``tally`` in the caller's thread: exact."""
        with self._trips.blocking():
            return Tally(self._tally_sync(), exact=True)

    def check_blocking(self: _MemoryStoreParts) -> list[str]:
        """None of the store's own problems: a memory store has none (see ``check``)."""
        with self._trips.blocking():
            return []

    def ages_blocking(
        self: _MemoryStoreParts, identities: Sequence[Identity]
    ) -> list[timedelta | None]:
        """None for each, as ``ages``: memory keeps no clock of its own."""
        with self._trips.blocking():
            return [None] * len(identities)

    def close_blocking(self: _MemoryStoreParts) -> None:
        """``aclose`` for a caller without an event loop: refuse new calls, then wait for
        those under way (blocking or awaited). The records stay in memory."""
        self._trips.close_blocking()
