"""The one seam between the journal and the bytes: the ``Store`` interface.

A store knows how to read, create and replace record documents atomically and
durably; it does not know what the statuses mean. The journal hands it a *step*:
a pure function of the current record that says what to write (or nothing) and
what to answer. The store runs the step and the write as one atomic unit, in one
worker-thread trip (file store) or one transaction (database stores), and re-runs
the step if it lost a race. A step may raise to refuse; then nothing is written.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Generic, Protocol, TypeVar

from .._model.errors import RecordInvalid, StorageFailed
from .._model.identity import Identity
from .._model.records import Owner, Record

__all__ = ["BlockingStore", "Step", "StepFunction", "Store", "Tally"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True, slots=True)
class Step(Generic[T_co]):
    """What a step decided: the record to write (``None``: write nothing), the answer,
    and, rarely, that the record is to be removed (to take back a claim never handed out)."""

    write: Record | None
    answer: T_co
    delete: bool = False


StepFunction = Callable[[Record | None], Step[T]]


@dataclass(frozen=True, slots=True)
class Tally:
    """What a store can tell of its record counts without reading every record strictly.

    ``counts`` has every status and ``invalid``. ``exact`` says whether they are the
    counts a full scan would give (``Journal.counts``); when it is False, a record that
    the store's own status check passes but that is damaged elsewhere is counted under
    the status it names instead of as ``invalid``.
    """

    counts: dict[str, int]
    exact: bool


class Store(Protocol):
    """Storage for record documents, one per identity."""

    location: str

    async def open(self) -> None:
        """Create the location if needed, check it is this user's alone (unless the store
        was made with ``trust_shared_root=True``) and that it is a journal of this kind."""
        ...

    async def setting(self, name: str, value: str) -> str:
        """The location's recorded value of ``name``; records ``value`` first if none is.

        Atomic across processes and durable before it returns: of two first openers with
        different values, one value wins and both are told which. Settings are opaque
        strings to the store (the journal keeps its input digest kind here).
        """
        ...

    async def apply(self, identity: Identity, step: StepFunction[T]) -> T:
        """Read the record, run ``step`` on it, durably write what it returns, answer.

        Atomic with respect to every other ``apply`` on the same identity, in this
        process and in others. Acknowledges (returns) only after the write is durable;
        on any failure nothing is acknowledged and the previous record is intact.
        """
        ...

    async def peek(self, identity: Identity, view: Callable[[Record | None], T]) -> T:
        """Read the record and pass it to ``view`` (in the same worker trip)."""
        ...

    def scan(
        self, *, status: str | None = None, after: str | None = None
    ) -> AsyncGenerator[Record | RecordInvalid | StorageFailed, None]:
        """Every stored record (with ``status``, only those), in the order of its key (the
        identity digest); with ``after`` (a key), only those whose key sorts after it.

        A record that cannot be read strictly comes as ``RecordInvalid``: in a full scan
        always, and in a ``status`` scan whenever its status cannot be told (it may be the
        one asked for); one that is damaged elsewhere but plainly names another status is
        left to that status's scans and to full scans. A part of the store that cannot be
        read at all (a directory that cannot be listed) comes as ``StorageFailed``. Neither
        stops the scan. A problem whose key is known is left out when it sorts at or
        before ``after``; one without a key (a part of the store) may come on any scan.
        Reads in batches (one worker trip each) and only as far as it is consumed: a
        caller that stops early has not paid for the rest. Records may change while it
        runs.
        """
        ...

    async def tally(self) -> Tally | None:
        """The records per status (and ``invalid``), from what the store can count
        without reading every record; None when it has no cheaper way than a full scan.
        Reads only."""
        ...

    async def check(self) -> list[str]:
        """The store's own consistency problems, one line each (orphan temp files, its
        metadata, the database's integrity); empty when all is well. Reads only."""
        ...

    def owner(self) -> Owner:
        """Who owns the claims made through this store now (in a worker thread): this
        process, and for a store shared by many hosts the session that vouches for it."""
        ...

    def owner_alive(self, owner: Owner | None) -> bool | None:
        """Whether ``owner`` (of a started record) still lives: True, False, or None when
        this store cannot tell from here. Runs in a worker thread, also inside a step."""
        ...

    def gone_reason(self, owner: Owner | None) -> str:
        """Why ``owner``, which ``owner_alive`` judged gone, is gone, in words for a review
        reason ("owner process gone", "owner's machine rebooted since"). Worker thread."""
        ...

    async def ages(self, identities: Sequence[Identity]) -> list[timedelta | None]:
        """For each identity, how long ago its record was last written by the store's own
        clock (the kernel's file times, the database server's clock), in one read; None
        where the store keeps no such witness or holds no record. ``prune`` removes only
        what both this and the journal's clock call old."""
        ...

    async def aclose(self) -> None:
        """Refuse new calls, wait for the calls under way, then release what is held."""
        ...


class BlockingStore(Store, Protocol):
    """A store's blocking face, for ``itemjournal.sync``: each call does what the awaited
    call of the same name (without ``_blocking``) does, in the caller's thread.

    Any number of threads may call at once, beside the store's awaited calls (in this
    process or others: the same locks exclude them). No event loop is involved and none
    is started; a call waits (for a record lock, another process's write lock, a batch's
    commit) by blocking its thread, for at most the store's lock timeout. A
    ``KeyboardInterrupt`` (the only interruption a thread gets) leaves what a crash of
    the call at that moment would: a write is whole or absent, never torn; a call still
    waiting for its turn (a lock, a batch) started nothing; one whose write was under way
    may have written, and the journal above checks the record again. In a forked child
    the store works as if opened there: it uses no lock, connection, thread or file
    position it inherited.
    """

    def open_blocking(self) -> None: ...

    def setting_blocking(self, name: str, value: str) -> str: ...

    def apply_blocking(self, identity: Identity, step: StepFunction[T]) -> T: ...

    def peek_blocking(self, identity: Identity, view: Callable[[Record | None], T]) -> T: ...

    def scan_blocking(
        self, *, status: str | None = None, after: str | None = None
    ) -> Generator[Record | RecordInvalid | StorageFailed, None, None]: ...

    def tally_blocking(self) -> Tally | None: ...

    def check_blocking(self) -> list[str]: ...

    def ages_blocking(self, identities: Sequence[Identity]) -> list[timedelta | None]: ...

    def close_blocking(self) -> None:
        """Refuse new calls, wait for the calls under way (blocking or awaited), then
        release what is held. Closing twice is harmless."""
        ...
