"""The in-memory store: record documents in a dict, for unit tests.

It keeps each record as the exact bytes the durable stores would write
(``encode_record``) and reads them back through the same strict reader
(``decode_record``), so a journal over it refuses, accepts and answers exactly as it
would over a file or a database; only durability is missing. Nothing survives the
process, and nothing is shared with another one.

Nothing here touches a disk, so the store runs each step on the event loop, after one
checkpoint, with no worker thread: read, step and write happen with no ``await`` between
them, so nothing else on the loop can come between. One thing a step may ask does read
files: whether the owner of a ``started`` record is alive, when that owner is another
process (``/proc``), or when this process has not been named yet (its boot log). Such a
step is stopped before it decides anything and run again in a worker thread, where it
may read them; a step is a pure function of the record it is given, so running it again
changes nothing. A lock per identity, held for a read-step-write, keeps such a worker
trip and the steps on the loop apart for that identity, and the blocking face's calls
(``memory_blocking``), which run steps in their callers' threads.
"""

from __future__ import annotations

import bisect
import os
import secrets
import threading
import weakref
from collections.abc import AsyncGenerator, Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

from .._model.codec import decode_record, encode_record
from .._model.errors import InvalidArgument, RecordInvalid, StorageFailed
from .._model.identity import Identity, IdentityLike, coerce_identity, identity_digest
from .._model.records import STATUSES, Owner, Record
from .files.settings import check_setting_text
from .memory_blocking import MemoryBlockingFace, check_batch
from .owners import ProcessOwners, known_own_owner
from .seam import Step, StepFunction, Tally
from .threads import Trips

__all__ = ["MemoryStore"]

T = TypeVar("T")


class _ReadsFiles(Exception):
    """A step on the event loop asked what only files can tell: run it in a thread."""


_IN_A_THREAD = object()  # what ``_here`` answers for a step that must run in a thread


class MemoryStore(MemoryBlockingFace, ProcessOwners):
    """Record documents held in memory, for the unit tests of code that uses a journal.

    ``Journal(MemoryStore())`` is ready at once: no directory, no database, no
    ``await open()`` (``open`` may still be called; it does nothing). Every journal made
    over one ``MemoryStore`` sees the same records, as journals opened on one location
    would. The store keeps the record documents byte for byte and reads them as strictly
    as the durable stores, so the journal behaves the same over it; but nothing is
    written anywhere: **nothing survives the process**, and other processes cannot see
    it. Use a file or SQLite location for anything that must be remembered.

    ``document`` and ``put_document`` read and replace a record's stored bytes behind
    the journal's back, so that a test can see what was written or plant a damaged
    record (which the journal then reports as ``RECORD_INVALID``).
    """

    def __init__(self) -> None:
        self.location = f"memory:{secrets.token_hex(8)}"
        self._documents: dict[str, bytes] = {}  # identity digest -> record document
        self._settings: dict[str, str] = {}
        # What each document was last found to say: its status, or None when the strict
        # reader refused it, for as long as the document is that very bytes object (a
        # write or ``put_document`` stores a new one). ``tally`` reads only what changed.
        self._told: dict[str, tuple[bytes, str | None]] = {}
        # One lock per identity ever written, held for the whole read-step-write (on the
        # loop, in a worker trip, or in a blocking caller's thread). The dicts need no lock
        # of their own: each touch of them is one dict operation, atomic in Python, so
        # that nothing running on the event loop ever waits for a worker thread. A forked
        # child starts with none (``_forget_locks_in_child``).
        self._identity_locks: dict[str, threading.Lock] = {}
        _STORES.add(self)
        self._trips = Trips(self)  # worker trips under way; closing waits for them
        # Set in the thread that runs a step on its event loop, for as long as it does:
        # then an owner question that reads files stops the step (``_ReadsFiles``).
        self._on_loop = threading.local()

    def __repr__(self) -> str:
        return f"MemoryStore({self.location!r})"

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """Nothing to create or check: a memory store is open from the start.

        Refused (``STORAGE_FAILED``) once the store is closed, like every other call.
        """
        await anyio.lowlevel.checkpoint()
        self._check_open()

    async def aclose(self) -> None:
        """Refuse new calls, then wait for the calls under way (their worker trips) to end.

        The wait is shielded: a cancelled ``aclose`` still returns only after every trip
        under way has ended, and then lets the cancellation go on. The records stay in
        memory (``document`` still reads them) until the store itself is dropped.
        """
        await self._trips.close()

    def _check_open(self) -> None:
        self._trips.check_open()

    async def _trip(self, function: Callable[..., T], *args: Any) -> T:
        """One worker trip, counted so that ``aclose`` can wait for it."""
        return await self._trips.run(function, *args)

    # ------------------------------------------------------------------ the seam

    async def setting(self, name: str, value: str) -> str:
        """The store's recorded value of ``name``; records ``value`` first if none is."""
        check_setting_text(name, value)
        await anyio.lowlevel.checkpoint()
        self._check_open()
        return self._settings.setdefault(name, value)

    async def apply(self, identity: Identity, step: StepFunction[T]) -> T:
        """Read the record, run ``step``, keep what it writes, answer; see ``Store.apply``.

        On the event loop after one checkpoint; in a worker thread when the step must
        read files to judge an owner (see the module's docstring)."""
        await anyio.lowlevel.checkpoint()
        self._check_open()
        digest = identity_digest(identity)
        lock = self._identity_lock(digest)
        if lock.acquire(blocking=False):  # else a worker trip has it: wait in a thread
            try:
                answer = self._here(self._apply_locked, identity, digest, step)
            finally:
                lock.release()
            if answer is not _IN_A_THREAD:
                return answer  # type: ignore[return-value]
        return await self._trip(self._apply_sync, identity, step)

    async def peek(self, identity: Identity, view: Callable[[Record | None], T]) -> T:
        """Read the record and pass it to ``view``: on the event loop, or in a worker
        thread when ``view`` must read files to judge an owner."""
        await anyio.lowlevel.checkpoint()
        self._check_open()
        answer = self._here(self._peek_sync, identity, view)
        if answer is not _IN_A_THREAD:
            return answer  # type: ignore[return-value]
        return await self._trip(self._peek_sync, identity, view)

    def _here(self, function: Callable[..., T], *args: Any) -> T | object:
        """``function(*args)`` on the event loop; ``_IN_A_THREAD`` when it stopped to
        ask what only files can tell (it decided nothing: run it again in a thread)."""
        self._on_loop.active = True
        try:
            return function(*args)
        except _ReadsFiles:
            return _IN_A_THREAD
        finally:
            self._on_loop.active = False

    # What a step asks of owners: answered on the loop only when no file must be read.

    def _reads_files(self) -> bool:
        return getattr(self._on_loop, "active", False)

    def owner(self) -> Owner:
        if self._reads_files():
            me = known_own_owner()
            if me is None:
                raise _ReadsFiles
            return me
        return super().owner()

    def owner_alive(self, owner: Owner | None) -> bool | None:
        if self._reads_files():
            if owner is not None and owner == known_own_owner():
                return True  # the judge is that very process
            raise _ReadsFiles
        return super().owner_alive(owner)

    def gone_reason(self, owner: Owner | None) -> str:
        if self._reads_files():
            raise _ReadsFiles
        return super().gone_reason(owner)

    async def scan(
        self, *, status: str | None = None, after: str | None = None, batch: int = 256
    ) -> AsyncGenerator[Record | RecordInvalid | StorageFailed, None]:
        """Every record in the order of its identity digest (after ``after``, when given),
        ``batch`` at a time, with a checkpoint before each.

        The digests are taken when the scan starts: a record added later is not seen, one
        removed meanwhile is skipped, and one replaced is read as it is when its batch is
        read. A document that cannot be read strictly comes as ``RecordInvalid``, whatever
        ``status`` asks.
        """
        check_batch(batch)
        await anyio.lowlevel.checkpoint()
        self._check_open()
        digests = self._digests_sync(after)
        for start in range(0, len(digests), batch):
            await anyio.lowlevel.checkpoint()
            self._check_open()
            for item in self._load_sync(digests[start : start + batch], status):
                yield item

    async def ages(self, identities: Sequence[Identity]) -> list[timedelta | None]:
        """None for each: memory has no clock of its own apart from this process's, which
        is the very clock the journal already judged by."""
        await anyio.lowlevel.checkpoint()
        self._check_open()
        return [None] * len(identities)

    async def tally(self) -> Tally:
        """The records per status and ``invalid``, exactly as a full scan counts them: a
        document is read strictly once, and again only after it is replaced."""
        await anyio.lowlevel.checkpoint()
        self._check_open()
        return Tally(self._tally_sync(), exact=True)

    async def check(self) -> list[str]:
        """The store's own problems beyond its records: none. A memory store has no temp
        files, no metadata and no database to damage; each record is checked by ``scan``."""
        await anyio.lowlevel.checkpoint()
        self._check_open()
        return []

    # ------------------------------------------------------------------ for tests

    def document(self, identity: IdentityLike) -> bytes | None:
        """The stored bytes of the record of ``identity`` (None when there is none)."""
        return self._documents.get(identity_digest(coerce_identity(identity)))

    def put_document(self, identity: IdentityLike, data: bytes | None) -> None:
        """Store ``data`` as the record of ``identity`` as it is, unchecked (None removes it).

        For tests of what a journal does with a record it did not write: damaged bytes
        are kept as given and read back as ``RECORD_INVALID``.
        """
        digest = identity_digest(coerce_identity(identity))
        if data is not None and not isinstance(data, bytes):
            raise InvalidArgument(
                f"a record document is bytes, not {type(data).__name__}", code="INVALID_ARGUMENT"
            )
        self._told.pop(digest, None)  # read again by the next ``tally``
        if data is None:
            self._documents.pop(digest, None)
        else:
            self._documents[digest] = data

    # ------------------------------------------------------------------ steps (loop or thread)

    def _where(self, digest: str) -> str:
        return f"{self.location}#{digest}"

    def _identity_lock(self, digest: str) -> threading.Lock:
        lock = self._identity_locks.get(digest)
        if lock is None:
            lock = self._identity_locks.setdefault(digest, threading.Lock())
        return lock

    def _apply_sync(self, identity: Identity, step: StepFunction[T]) -> T:
        digest = identity_digest(identity)
        with self._identity_lock(digest):
            return self._apply_locked(identity, digest, step)

    def _apply_locked(self, identity: Identity, digest: str, step: StepFunction[T]) -> T:
        data = self._documents.get(digest)
        current = (
            None if data is None else decode_record(data, identity, location=self._where(digest))
        )
        decision: Step[T] = step(current)
        if decision.delete:
            self._documents.pop(digest, None)
            self._told.pop(digest, None)
            return decision.answer
        if decision.write is None:
            return decision.answer
        # Refuses (RECORD_INVALID) an oversize record, or text that is not Unicode.
        data = encode_record(decision.write)
        self._documents[digest] = data
        self._told[digest] = (data, decision.write.status)
        return decision.answer

    def _peek_sync(self, identity: Identity, view: Callable[[Record | None], T]) -> T:
        digest = identity_digest(identity)
        data = self._documents.get(digest)
        record = (
            None if data is None else decode_record(data, identity, location=self._where(digest))
        )
        return view(record)

    def _digests_sync(self, after: str | None = None) -> list[str]:
        digests = sorted(list(self._documents))  # one copy of the keys, then the sort
        if after is None:
            return digests
        return digests[bisect.bisect_right(digests, after) :]

    def _tally_sync(self) -> dict[str, int]:
        counted = dict.fromkeys((*STATUSES, "invalid"), 0)
        for digest, data in list(self._documents.items()):
            told = self._told.get(digest)
            if told is None or told[0] is not data:
                try:
                    status: str | None = decode_record(data, digest).status
                except RecordInvalid:
                    status = None
                told = (data, status)
                self._told[digest] = told
            counted["invalid" if told[1] is None else told[1]] += 1
        # A copy of the keys first: writes in other threads change ``_told`` meanwhile.
        for digest in [digest for digest in list(self._told) if digest not in self._documents]:
            self._told.pop(digest, None)
        return counted

    def _load_sync(
        self, digests: list[str], status: str | None
    ) -> list[Record | RecordInvalid | StorageFailed]:
        found = [(digest, self._documents.get(digest)) for digest in digests]
        page: list[Record | RecordInvalid | StorageFailed] = []
        for digest, data in found:
            if data is None:  # removed since the scan started
                continue
            try:
                record = decode_record(data, digest, location=self._where(digest))
            except RecordInvalid as error:
                page.append(error)
                continue
            if status is None or record.status == status:
                page.append(record)
        return page


_STORES: weakref.WeakSet[MemoryStore] = weakref.WeakSet()


def _forget_locks_in_child() -> None:
    """In a forked child, new identity locks: one held at the fork by another of the
    parent's threads (a step under way there) would never be released here, as that
    thread does not exist in the child. The child's records are those of the fork."""
    for store in list(_STORES):
        store._identity_locks = {}


os.register_at_fork(after_in_child=_forget_locks_in_child)
