"""The SQLite store: one row per identity, many operations per commit.

``SQLiteStore`` is the seam (``Store``) over one SQLite database in WAL mode. It is
made of the rooms beside it: ``opening`` makes the file privately and checks the schema
(``schema``: the tables, whose database it is, migration); the writer batches operations
(``writer``: the queue and the thread that serves it; ``batch``: one transaction and one commit for
every operation of a batch); ``reads`` holds the statements of scans, the tally and the
ages, and ``pool`` the reader connections and the reads over them; ``connection`` makes
every connection and reads SQLite's errors. The store itself holds the seam's awaited
calls; its blocking face (``BlockingStore``) is ``blocking``, and ``forking`` keeps a
forked child from using what it inherited.

Across processes, SQLite's own write lock (``BEGIN IMMEDIATE``) keeps read-decide-write
atomic, so claims stay exclusive and no transition is lost; ``open`` and every batch
wait for another process's lock (on the event loop, cancellably, or in the blocking
caller's thread) for at most ``busy_timeout`` seconds.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import AsyncGenerator, Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import anyio
import anyio.lowlevel

from ..._model.errors import InvalidArgument, RecordInvalid, StorageFailed
from ..._model.identity import Identity
from ..._model.records import Record
from ..owners import ProcessOwners
from ..seam import StepFunction, Tally
from ..threads import run_in_thread
from .blocking import BlockingFace
from .connection import connect
from .opening import OpenRetry, _Opening, open_step
from .operation import _Operation
from .reads import _Bound

__all__ = ["SQLiteStore"]

T = TypeVar("T")


class SQLiteStore(BlockingFace, ProcessOwners):
    """Record documents in one SQLite database (WAL, ``synchronous=FULL``).

    ``busy_timeout`` (seconds) bounds how long ``open`` and each write wait while
    another process holds a lock they need (``STORAGE_FAILED``, ``ETIMEDOUT``); the
    waits are cancellable (interruptible, in the blocking face). ``trust_shared_root=True``
    skips the check that the database and its directory are this user's alone. A store
    opened before ``os.fork`` works in the child too (``forking``).
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
        self._closed = False
        self._track_forks()

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
        retry = OpenRetry(self.path, self.busy_timeout, anyio.current_time())
        try:
            while not await run_in_thread(self._open_step, opening):
                delay = retry.next_delay(anyio.current_time())  # or ETIMEDOUT
                await anyio.sleep(delay)
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

    async def aclose(self) -> None:
        """Refuse new calls, let the calls under way finish (the blocking face's too: the
        queue holds their writes, ``_reading`` counts their reads), then close the
        connections."""
        if self._closed:
            await anyio.lowlevel.checkpoint()
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._stop()  # the writer thread ends once what was queued is done
            # Reads (and a blocking caller's write run alone) end in other threads, which
            # cannot set an event: poll.
            while self._reading or self._alone:  # noqa: ASYNC110
                await anyio.sleep(0.001)
            await run_in_thread(self._close_sync)

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
        key = self._setting_key(name, value)
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
        bound: _Bound | None = self._scan_start(after)
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

    async def ages(self, identities: Sequence[Identity]) -> list[timedelta | None]:
        """How long ago each row was last written, by the kernel's clock: ``written_at``
        is ``kernel_time()`` (``/proc``, no process's clock) taken once per write
        transaction, compared with it now. One read."""
        return await run_in_thread(self._ages_sync, list(identities))
