"""The SQLite store: one row per identity, many operations per commit.

``SQLiteStore`` is the seam (``Store``) over one SQLite database in WAL mode. It is
made of the rooms beside it: ``opening`` makes the file privately and checks the schema
(``schema``: the tables, whose database it is, migration); the writer batches operations
(``writer``: the queue and the thread that serves it; ``batch``: one transaction and one commit for
every operation of a batch); ``reads`` holds the statements of scans, the tally and the
ages; ``connection`` makes every connection and reads SQLite's errors. The store itself
holds the connections (one writer, a pool of readers) and the seam's calls.

Across processes, SQLite's own write lock (``BEGIN IMMEDIATE``) keeps read-decide-write
atomic, so claims stay exclusive and no transition is lost; ``open`` and every batch
wait for another process's lock on the event loop, cancellably, for at most
``busy_timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import sqlite3
import threading
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from datetime import timedelta
from typing import TypeVar

import anyio
import anyio.lowlevel

from ..._model.codec import decode_row
from ..._model.errors import InvalidArgument, RecordInvalid, StorageFailed
from ..._model.identity import Identity, identity_digest
from ..._model.records import Record
from ..kernelclock import kernel_time
from ..owners import ProcessOwners
from ..seam import StepFunction, Tally
from ..threads import run_in_thread
from . import reads
from .connection import _failure, _Undecodable, connect
from .opening import _Opening, open_step
from .operation import _Operation
from .reads import _FIRST, _Bound
from .schema import _ROW, _SETTING_PREFIX, meta_problems, setting_text
from .writer import BatchWriter

__all__ = ["SQLiteStore"]

T = TypeVar("T")


class SQLiteStore(BatchWriter, ProcessOwners):
    """Record documents in one SQLite database (WAL, ``synchronous=FULL``).

    ``busy_timeout`` (seconds) bounds how long ``open`` and each write wait while
    another process holds a lock they need (``STORAGE_FAILED``, ``ETIMEDOUT``); the
    waits are cancellable. ``trust_shared_root=True`` skips the check that the database
    and its directory are this user's alone.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout: float = 30.0,
        trust_shared_root: bool = False,
    ) -> None:
        text = os.fspath(path)
        if not isinstance(text, str):
            raise InvalidArgument(
                "the SQLite database path must be text, not bytes",
                code="ABSOLUTE_ROOT_REQUIRED",
            )
        if not os.path.isabs(text):
            raise InvalidArgument(
                f"the SQLite database needs an absolute path (sqlite:///abs/path.db), got {text!r}",
                code="ABSOLUTE_ROOT_REQUIRED",
            )
        super().__init__()
        self.path = os.path.normpath(text)
        self.location = f"sqlite://{self.path}"
        self.busy_timeout = busy_timeout
        self.trust_shared_root = trust_shared_root
        # Reader connections: a pool that worker trips check out and back in, so that
        # closing never pulls a connection from under a running read.
        self._idle_readers: list[sqlite3.Connection] = []
        self._reading = 0
        self._readers_lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_location(
        cls, location: str, *, lock_timeout: float, trust_shared_root: bool
    ) -> SQLiteStore:
        """The store for ``Journal.open``'s location, ``sqlite:///absolute/path.db``."""
        if not location.startswith("sqlite://"):
            raise InvalidArgument(
                f"a SQLite location looks like sqlite:///absolute/path.db, not {location!r}",
                code="ABSOLUTE_ROOT_REQUIRED",
            )
        return cls(
            location[len("sqlite://") :],
            busy_timeout=lock_timeout,
            trust_shared_root=trust_shared_root,
        )

    def __repr__(self) -> str:
        return f"SQLiteStore({self.path!r})"

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """Create or check the database; wait (cancellably, at most ``busy_timeout``)
        while another process holds a lock that opening needs."""
        opening = _Opening()
        deadline = anyio.current_time() + self.busy_timeout
        delay = 0.0002
        try:
            while not await run_in_thread(self._open_step, opening):
                if anyio.current_time() >= deadline:
                    raise StorageFailed(
                        f"another process held a lock on {self.path} for "
                        f"{self.busy_timeout:g} s, so it could not be opened",
                        errno=errno.ETIMEDOUT,
                    )
                await anyio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 0.005)
        except BaseException:
            connection = opening.connection
            if connection is not None:
                with anyio.CancelScope(shield=True):
                    await run_in_thread(connection.close)
            raise
        self._writer = opening.connection

    def _connect(self, *, busy_timeout: float | None = None) -> sqlite3.Connection:
        return connect(self.path, self.busy_timeout if busy_timeout is None else busy_timeout)

    def _open_step(self, opening: _Opening) -> bool:
        return open_step(
            opening,
            self.path,
            trust_shared_root=self.trust_shared_root,
            connect=lambda: self._connect(busy_timeout=0),
        )

    async def check(self) -> list[str]:
        """SQLite's own integrity check and this journal's metadata, one line per problem."""
        return await run_in_thread(self._check_sync)

    def _check_sync(self) -> list[str]:
        problems: list[str] = []
        try:
            with self._reader() as reader:
                rows = reader.execute("PRAGMA quick_check").fetchall()
                meta = dict(reader.execute("SELECT key, value FROM itemjournal_meta").fetchall())
        except sqlite3.Error as error:
            raise _failure(f"cannot check {self.location}", error) from error
        for (line,) in rows:
            if line != "ok":
                problems.append(f"STORAGE_FAILED: {self.location}: integrity check: {line}")
        return problems + meta_problems(meta, self.location)

    async def aclose(self) -> None:
        """Refuse new calls, let the calls under way finish, then close the connections."""
        if self._closed:
            await anyio.lowlevel.checkpoint()
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._stop()  # the writer thread ends once what was queued is done
            # Reads end in worker threads, which cannot set an event: poll.
            while self._reading:  # noqa: ASYNC110
                await anyio.sleep(0.001)
            await run_in_thread(self._close_sync)

    def _close_sync(self) -> None:
        with self._readers_lock:
            connections = [*self._idle_readers, *([self._writer] if self._writer else [])]
            self._idle_readers.clear()
            self._writer = None
        for connection in connections:
            connection.close()

    # ------------------------------------------------------------------ the seam

    async def apply(self, identity: Identity, step: StepFunction[T]) -> T:
        return await self._submit(_Operation.of(identity, step))

    async def setting(self, name: str, value: str) -> str:
        """The database's recorded value of ``name``; records ``value`` first if none is.

        Kept in the meta table under ``setting.<name>``, apart from the keys that say
        whose database it is. A recorded value is read without taking the write lock;
        otherwise one write transaction (through the batch queue, so it waits for
        another process's lock like every write) inserts it if still absent and reads
        back the winner.
        """
        if not isinstance(name, str) or not isinstance(value, str):
            raise InvalidArgument("a setting's name and value are text", code="INVALID_ARGUMENT")
        key = _SETTING_PREFIX + name
        await anyio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            raise StorageFailed(f"{self!r} is closed")
        recorded = await run_in_thread(self._setting_sync, key)
        if recorded is not None:
            return recorded
        operation: _Operation[str] = _Operation(key, setting=(key, value))
        return await self._submit(operation)

    async def peek(self, identity: Identity, view: Callable[[Record | None], T]) -> T:
        return await run_in_thread(self._peek_sync, identity, view)

    async def scan(
        self, *, status: str | None = None, after: str | None = None, batch: int = 256
    ) -> AsyncGenerator[Record | RecordInvalid | StorageFailed, None]:
        """Every row in digest order (after ``after``), a page per worker trip; see
        ``Store.scan``.

        A row that cannot be read comes as ``RecordInvalid`` (or, for an unexpected
        error reading it, ``StorageFailed``). A scan of ``succeeded``, ``released`` (or
        any status without an index) reads every row, so it returns every unreadable
        one. A scan of an open status (``started``, ``needs_review``) reads that
        status's rows through its index, and with them every row whose status SQL
        cannot vouch for (see ``schema._SUSPECT_CONDITION``); a row whose digest, status column
        and document status all agree on another status, but that is invalid in some
        other way, is left to the scans of that status and the full scan. A page that
        cannot be read at all raises ``StorageFailed``: the scan cannot go past it.
        """
        bound: _Bound | None = (
            _FIRST if after is None else _Bound(blob=False, raw=after.encode(), inclusive=False)
        )
        while bound is not None:
            page, bound = await run_in_thread(self._page_sync, bound, batch, status)
            for item in page:
                yield item

    async def tally(self) -> Tally:
        """The records per status from the indexes, in one read transaction: no document
        is read but the suspect rows' (see ``schema._SUSPECT_CONDITION``), each read strictly.

        Not exact (``Tally.exact`` is False): a row whose digest, status column and
        document's status all agree, but that is damaged elsewhere, is counted under its
        status; only a full scan (``Journal.counts``) reads every row strictly.
        """
        return Tally(await run_in_thread(self._tally_sync), exact=False)

    def _tally_sync(self) -> dict[str, int]:
        try:
            with self._reader() as reader:
                total, by_column, suspects = reads.fetch_tally(reader)
        except sqlite3.Error as error:
            raise _failure(f"cannot count the records in {self.location}", error) from error
        return reads.count(total, by_column, suspects, self._read_row)

    # ------------------------------------------------------------------ worker-thread code

    @contextlib.contextmanager
    def _reader(self) -> Iterator[sqlite3.Connection]:
        """A reader connection for this worker trip, from the pool and back into it."""
        with self._readers_lock:
            if self._closed:
                raise StorageFailed(f"{self!r} is closed")
            connection = self._idle_readers.pop() if self._idle_readers else None
            self._reading += 1
        try:
            if connection is None:
                connection = self._connect()
            yield connection
        finally:
            with self._readers_lock:
                self._reading -= 1
                if connection is not None:
                    self._idle_readers.append(connection)

    def _decode(self, digest: object, status: object, document: object) -> Record:
        location = f"{self.location}#{digest}"
        if not isinstance(digest, str) or isinstance(digest, _Undecodable):
            raise RecordInvalid(
                f"record at {location} is stored under a key that is not a text digest",
                location=location,
            )
        return decode_row(document, digest, status, location=location)

    def _read_row(self, digest: object, status: object, document: object) -> Record:
        """The row's record; ``RECORD_INVALID``, or for anything unexpected
        ``STORAGE_FAILED``, about this row alone."""
        try:
            return self._decode(digest, status, document)
        except RecordInvalid:
            raise
        except Exception as error:
            raise _failure(f"cannot read the record at {self.location}#{digest}", error) from error

    async def ages(self, identities: Sequence[Identity]) -> list[timedelta | None]:
        """How long ago each row was last written, by the kernel's clock: ``written_at``
        is ``kernel_time()`` (``/proc``, no process's clock) taken once per write
        transaction, compared with it now. One read."""
        return await run_in_thread(self._ages_sync, list(identities))

    def _ages_sync(self, identities: list[Identity]) -> list[timedelta | None]:
        digests = [identity_digest(identity) for identity in identities]
        try:
            with self._reader() as reader:
                found = reads.fetch_written_at(reader, digests)
        except sqlite3.Error as error:
            raise _failure(f"cannot read {self.location}", error) from error
        return reads.ages_of(digests, found, kernel_time())

    def _peek_sync(self, identity: Identity, view: Callable[[Record | None], T]) -> T:
        digest = identity_digest(identity)
        try:
            with self._reader() as reader:
                row = reader.execute(_ROW, (digest,)).fetchone()
        except sqlite3.Error as error:
            raise _failure(f"cannot read {self.location}", error) from error
        record = None if row is None else self._read_row(digest, row[0], row[1])
        return view(record)

    def _setting_sync(self, key: str) -> str | None:
        try:
            with self._reader() as reader:
                row = reader.execute(
                    "SELECT value FROM itemjournal_meta WHERE key = ?", (key,)
                ).fetchone()
        except sqlite3.Error as error:
            raise _failure(f"cannot read the settings of {self.location}", error) from error
        if row is None:
            return None
        return setting_text(key, row[0], self.location)

    def _page_sync(
        self, after: _Bound, size: int, status: str | None
    ) -> tuple[list[Record | RecordInvalid | StorageFailed], _Bound | None]:
        """One page of a scan and where the next starts (None: this was the last)."""
        try:
            with self._reader() as reader:
                rows = reads.fetch_page(reader, after, size, status)
        except sqlite3.Error as error:
            raise _failure(f"cannot read {self.location}", error) from error
        return reads.page_of(rows, size, status, self._read_row)
