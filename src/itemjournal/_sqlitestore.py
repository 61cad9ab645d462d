"""The SQLite store: one row per identity, many operations per commit.

Operations that arrive while a commit is in flight wait in a queue; the next batch
takes all of them into ONE ``BEGIN IMMEDIATE`` transaction with ONE commit (one WAL
sync). Each step decides before its operation writes anything, so a refusal or a bad
record leaves nothing to undo and never costs the other operations of the batch. Every
caller is answered only after the commit returned. A lone operation runs at once: there
is no timer waiting for company.

Across processes, SQLite's own write lock (``BEGIN IMMEDIATE``) keeps read-decide-write
atomic, so claims stay exclusive and no transition is lost. While another process holds
that lock, the leader sleeps on the event loop (short, jittered, cancellable sleeps)
before it tries again; SQLite's own busy handler, whose sleeps lengthen to 100 ms, would
let a busy process starve a waiting one and could not be cancelled.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import sqlite3
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any, Final, Generic, TypeVar

import anyio

from ._dirs import make_dirs, sync_dir
from ._errors import InvalidArgument, RecordInvalid, StorageFailed
from ._fileio import FileSystem
from ._identity import Identity, identity_digest
from ._records import STATUSES as _STATUSES
from ._records import Record, decode_record, encode_record
from ._store import Step, StepFunction
from ._threads import run_in_thread

__all__ = ["SQLiteStore"]

T = TypeVar("T")

SCHEMA_VERSION: Final = 1
APPLICATION: Final = "itemjournal"
_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS itemjournal_meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS itemjournal_records (
    digest TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    document BLOB NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS itemjournal_records_open ON itemjournal_records (status)
    WHERE status IN ('started', 'needs_review');
"""

_OPEN: Final = ("started", "needs_review")  # the statuses in the partial index
_OPEN_CONDITION: Final = "status IN ('started', 'needs_review')"
_PENDING, _TAKEN, _DONE = 0, 1, 2
_UNSET: Final[Any] = object()


def _fail(what: str, error: sqlite3.Error | OSError) -> StorageFailed:
    code = getattr(error, "errno", None)
    return StorageFailed(f"{what}: {error}", errno=code if isinstance(code, int) else None)


def _page_query(status: str | None) -> str | None:
    """The SQL of one page of a scan (parameters: after digest, page size).

    The open statuses (what sweeps and review queues look for) have a partial index
    (status, digest); SQLite uses it when the query repeats the index's condition.
    """
    columns = "SELECT digest, status, document FROM itemjournal_records"
    if status is None:
        return f"{columns} WHERE digest > ? ORDER BY digest LIMIT ?"
    if status in _OPEN:
        return (
            f"{columns} INDEXED BY itemjournal_records_open WHERE {_OPEN_CONDITION} "
            f"AND status = '{status}' AND digest > ? ORDER BY digest LIMIT ?"
        )
    if status in _STATUSES:
        return f"{columns} WHERE status = '{status}' AND digest > ? ORDER BY digest LIMIT ?"
    return None


class _Operation(Generic[T]):
    """One caller's step, waiting for (or inside) a batch."""

    __slots__ = ("_done", "answer", "digest", "error", "identity", "leads", "state", "step")

    def __init__(self, identity: Identity, step: StepFunction[T]) -> None:
        self.identity = identity
        self.digest = identity_digest(identity)
        self.step = step
        self.state = _PENDING
        self.leads = False
        self._done: anyio.Event | None = None
        self.answer: T = _UNSET
        self.error: BaseException | None = None

    @property
    def done(self) -> anyio.Event:
        """Set when the operation is done, or when it is made the leader (made on demand:
        a lone operation never waits, so it never needs one)."""
        if self._done is None:
            self._done = anyio.Event()
        return self._done

    def wake(self) -> None:
        if self._done is not None:
            self._done.set()

    def result(self) -> T:
        if self.error is not None:
            raise self.error
        return self.answer


class SQLiteStore:
    """Record documents in one SQLite database (WAL, ``synchronous=FULL``)."""

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout: float = 30.0) -> None:
        text = os.fspath(path)
        if not os.path.isabs(text):
            raise InvalidArgument(
                f"the SQLite database needs an absolute path (sqlite:///abs/path.db), got {text!r}",
                code="ABSOLUTE_ROOT_REQUIRED",
            )
        self.path = os.path.normpath(text)
        self.location = f"sqlite://{self.path}"
        self.busy_timeout = busy_timeout
        self.commits = 0  # committed write transactions, for tests and benchmarks
        self._writer: sqlite3.Connection | None = None
        # Reader connections: a pool that worker trips check out and back in, so that
        # closing never pulls a connection from under a running read.
        self._idle_readers: list[sqlite3.Connection] = []
        self._reading = 0
        self._readers_lock = threading.Lock()
        self._queue: list[_Operation[Any]] = []
        self._leading = False
        self._closed = False

    def __repr__(self) -> str:
        return f"SQLiteStore({self.path!r})"

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        await run_in_thread(self._open_sync)

    def _connect(self, *, busy_timeout: float | None = None) -> sqlite3.Connection:
        timeout = self.busy_timeout if busy_timeout is None else busy_timeout
        connection = sqlite3.connect(
            self.path,
            timeout=timeout,
            isolation_level=None,  # we issue BEGIN/COMMIT ourselves
            check_same_thread=False,
        )
        try:
            connection.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
            connection.execute("PRAGMA synchronous = FULL")
        except sqlite3.Error:
            connection.close()
            raise
        return connection

    def _open_sync(self) -> None:
        directory = os.path.dirname(self.path)
        fs = FileSystem()
        try:
            make_dirs(directory, fs)
            # Create the file ourselves so that it (and SQLite's -wal and -shm, which
            # copy its mode) is private to the owner, and make its name durable.
            created = not os.path.exists(self.path)
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
            if created:
                sync_dir(fs, directory)
        except OSError as error:
            raise _fail(f"cannot create the journal database {self.path}", error) from error
        try:
            connection = self._connect()
        except sqlite3.Error as error:
            raise _fail(f"cannot open {self.path}", error) from error
        try:
            mode = connection.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StorageFailed(f"{self.path}: cannot switch to WAL mode (got {mode})")
            self._migrate(connection)
            # From now on the writer never waits inside SQLite: see _lead.
            connection.execute("PRAGMA busy_timeout = 0")
        except sqlite3.Error as error:
            connection.close()
            raise _fail(f"{self.path} is not a usable SQLite database", error) from error
        except BaseException:
            connection.close()
            raise
        self._writer = connection

    def _migrate(self, connection: sqlite3.Connection) -> None:
        """Create the schema, or check it is ours; idempotent, safe across processes."""
        connection.execute("BEGIN IMMEDIATE")
        try:
            tables = {
                row[0]
                for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
            ours = {"itemjournal_meta", "itemjournal_records"}
            if tables and not tables & ours:
                raise StorageFailed(
                    f"{self.path} is a SQLite database of something else "
                    f"(tables: {', '.join(sorted(tables))}); refusing to use it"
                )
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    connection.execute(statement)
            meta = dict(connection.execute("SELECT key, value FROM itemjournal_meta").fetchall())
            if not meta:
                connection.executemany(
                    "INSERT INTO itemjournal_meta (key, value) VALUES (?, ?)",
                    [("application", APPLICATION), ("schema_version", str(SCHEMA_VERSION))],
                )
            elif meta.get("application") != APPLICATION:
                raise StorageFailed(f"{self.path} was not made by itemjournal")
            elif meta.get("schema_version") != str(SCHEMA_VERSION):
                raise StorageFailed(
                    f"{self.path} has schema version {meta.get('schema_version')!r}; "
                    f"this itemjournal reads version {SCHEMA_VERSION}"
                )
            connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise

    async def aclose(self) -> None:
        """Refuse new calls, let the calls under way finish, then close the connections."""
        if self._closed:
            await anyio.lowlevel.checkpoint()
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            # Reads end in worker threads, which cannot set an event: poll.
            while self._leading or self._queue or self._reading:  # noqa: ASYNC110
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
        await anyio.lowlevel.checkpoint_if_cancelled()  # the only cancel point before queueing
        if self._closed:
            raise StorageFailed(f"{self!r} is closed")
        operation: _Operation[T] = _Operation(identity, step)
        self._queue.append(operation)
        if not self._leading:
            self._leading = True
            operation.leads = True
        else:
            await self._wait(operation)
            if operation.state == _DONE:
                return operation.result()
        await self._lead(operation)
        return operation.result()

    async def _lead(self, operation: _Operation[Any]) -> None:
        """Run batches until the leader's own operation is done, then hand over.

        While another process holds SQLite's write lock, the batch goes back to the
        queue and the leader sleeps on the event loop (cancellable) before it tries
        again, for at most ``busy_timeout`` seconds.
        """
        deadline = anyio.current_time() + self.busy_timeout
        delay = 0.0002
        try:
            while operation.state != _DONE:
                batch, self._queue = self._queue, []
                for member in batch:
                    member.state = _TAKEN
                began: list[bool] = []
                busy = False
                try:
                    busy = await run_in_thread(self._run_batch, batch, began)
                finally:
                    if began:
                        for member in batch:
                            if member.answer is _UNSET and member.error is None:
                                member.error = StorageFailed("the batch holding this call failed")
                            member.state = _DONE
                            member.wake()
                    elif not busy:  # cancelled before the batch began: give the rest back
                        self._give_back([m for m in batch if m is not operation])
                if not busy:
                    continue
                if anyio.current_time() >= deadline:
                    for member in batch:
                        member.error = StorageFailed(
                            f"another process held the write lock of {self.path} for "
                            f"{self.busy_timeout:g} s",
                            errno=errno.ETIMEDOUT,
                        )
                        member.state = _DONE
                        member.wake()
                    continue
                self._give_back(batch)
                try:
                    await anyio.sleep(delay * (0.5 + random.random()))
                except anyio.get_cancelled_exc_class():
                    self._queue.remove(operation)
                    raise
                delay = min(delay * 2, 0.005)
        finally:
            self._hand_over()

    def _give_back(self, members: list[_Operation[Any]]) -> None:
        for member in members:
            member.state = _PENDING
        self._queue[:0] = members

    async def _wait(self, operation: _Operation[Any]) -> None:
        """Wait until the operation was done by a batch, or was made the leader.

        Cancelled while queued, it leaves the queue and never runs. Cancelled while a
        batch holding it runs, it waits for that batch (shielded) so that its outcome is
        settled before the cancellation goes on.
        """
        try:
            await operation.done.wait()
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                while operation.state == _TAKEN:
                    try:
                        await operation.done.wait()
                    except anyio.get_cancelled_exc_class():  # a second, native cancel
                        continue
            if operation.state == _PENDING:
                self._queue.remove(operation)
                if operation.leads:
                    self._hand_over()
            raise

    def _hand_over(self) -> None:
        if self._queue:
            successor = self._queue[0]
            successor.leads = True
            successor.done.set()  # wakes it (or, not yet waiting, it finds it set); it leads
        else:
            self._leading = False

    async def peek(self, identity: Identity, view: Callable[[Record | None], T]) -> T:
        return await run_in_thread(self._peek_sync, identity, view)

    async def scan(
        self, *, status: str | None = None, batch: int = 256
    ) -> AsyncGenerator[Record | RecordInvalid, None]:
        after = ""
        while True:
            rows = await run_in_thread(self._page_sync, after, batch, status)
            for digest, item in rows:
                after = digest
                yield item
            if len(rows) < batch:
                return

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

    def _decode(self, digest: str, status: object, document: object) -> Record:
        location = f"{self.location}#{digest}"
        if not isinstance(document, bytes):
            raise RecordInvalid(f"record at {location} is not stored as bytes", location=location)
        record = decode_record(document, digest, location=location)
        if status != record.status:
            raise RecordInvalid(
                f"record at {location} has status column {status!r} but document "
                f"status {record.status!r}",
                location=location,
            )
        return record

    def _peek_sync(self, identity: Identity, view: Callable[[Record | None], T]) -> T:
        digest = identity_digest(identity)
        try:
            with self._reader() as reader:
                row = reader.execute(
                    "SELECT status, document FROM itemjournal_records WHERE digest = ?", (digest,)
                ).fetchone()
        except sqlite3.Error as error:
            raise _fail(f"cannot read {self.location}", error) from error
        record = None if row is None else self._decode(digest, row[0], row[1])
        return view(record)

    def _page_sync(
        self, after: str, size: int, status: str | None
    ) -> list[tuple[str, Record | RecordInvalid]]:
        query = _page_query(status)
        if query is None:
            return []
        try:
            with self._reader() as reader:
                rows = reader.execute(query, (after, size)).fetchall()
        except sqlite3.Error as error:
            raise _fail(f"cannot read {self.location}", error) from error
        page: list[tuple[str, Record | RecordInvalid]] = []
        for digest, column, document in rows:
            try:
                page.append((digest, self._decode(digest, column, document)))
            except RecordInvalid as error:
                page.append((digest, error))
        return page

    def _run_batch(self, batch: list[_Operation[Any]], began: list[bool]) -> bool:
        """One transaction, one commit, for every operation of the batch.

        Returns True, having done nothing, when another process holds the write lock.
        """
        connection = self._writer
        if connection is None:
            for operation in batch:
                operation.error = StorageFailed(f"{self!r} is closed")
            began.append(True)
            return False
        try:
            connection.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as error:
            code = getattr(error, "sqlite_errorcode", 0)
            if isinstance(error, sqlite3.OperationalError) and code & 0xFF == sqlite3.SQLITE_BUSY:
                return True
            self._fail_each(batch, f"cannot start a write transaction on {self.path}", error)
            began.append(True)
            return False
        began.append(True)
        writes: list[_Operation[Any]] = []
        try:
            for operation in batch:
                writes.append(operation)
                if not self._run_one(connection, operation):
                    writes.pop()
            connection.execute("COMMIT")
            self.commits += 1
        except sqlite3.Error as error:
            if connection.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    connection.execute("ROLLBACK")
            # Writes are lost with the transaction; so is any operation not yet run.
            # Refusals and reads decided before the failure stay as they were.
            lost = [
                operation
                for operation in batch
                if operation in writes or (operation.answer is _UNSET and operation.error is None)
            ]
            for operation in lost:
                operation.answer = _UNSET
            self._fail_each(lost, f"cannot commit to {self.path}; nothing was written", error)
        return False

    @staticmethod
    def _fail_each(batch: list[_Operation[Any]], message: str, cause: sqlite3.Error) -> None:
        """Give every caller its own error (their tracebacks and notes must not mix)."""
        for operation in batch:
            failure = _fail(message, cause)
            failure.__cause__ = cause
            operation.error = failure

    def _run_one(self, connection: sqlite3.Connection, operation: _Operation[Any]) -> bool:
        """Read, decide, write one operation inside the batch; True when it wrote.

        The step decides before anything of its own is written, so a refusal (or a bad
        record) leaves nothing to undo and the batch's other operations stand; a failing
        SQL statement fails the whole transaction instead (see ``_run_batch``).
        """
        row = connection.execute(
            "SELECT status, document FROM itemjournal_records WHERE digest = ?",
            (operation.digest,),
        ).fetchone()
        try:
            current = None if row is None else self._decode(operation.digest, row[0], row[1])
            decision: Step[Any] = operation.step(current)
            data = None if decision.write is None else encode_record(decision.write)
        except Exception as error:
            operation.error = error
            return False
        if decision.delete:
            connection.execute(
                "DELETE FROM itemjournal_records WHERE digest = ?", (operation.digest,)
            )
        elif decision.write is not None:
            connection.execute(
                "INSERT INTO itemjournal_records (digest, status, document) VALUES (?, ?, ?) "
                "ON CONFLICT (digest) DO UPDATE SET "
                "status = excluded.status, document = excluded.document",
                (operation.digest, decision.write.status, data),
            )
        else:
            operation.answer = decision.answer
            return False
        operation.answer = decision.answer
        return True
