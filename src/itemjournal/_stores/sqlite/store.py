"""The SQLite store: one row per identity, many operations per commit.

Operations that arrive while a commit is in flight wait in a queue; the next batch
takes all of them into ONE ``BEGIN IMMEDIATE`` transaction with ONE commit (one WAL
sync). Each step decides before its operation writes anything, so a refusal or a bad
record leaves nothing to undo and never costs the other operations of the batch. Every
answer is published only after the commit returned; if anything else goes wrong inside
the transaction (a statement fails, a step raises a ``BaseException``, memory runs
out), the transaction is rolled back and every caller whose write was lost hears that
nothing was written. A failed ``COMMIT`` is different: the write-ahead log may already
hold the transaction, so its callers hear that the outcome is unknown. A lone operation
runs at once: there is no timer waiting for company.

Across processes, SQLite's own write lock (``BEGIN IMMEDIATE``) keeps read-decide-write
atomic, so claims stay exclusive and no transition is lost. While another process holds
that lock, the leader sleeps on the event loop (short, jittered, cancellable sleeps)
before it tries again; SQLite's own busy handler, whose sleeps lengthen to 100 ms, would
let a busy process starve a waiting one and could not be cancelled. ``open`` waits for
the lock the same way.

The database file is never opened or closed outside SQLite: closing any descriptor of
it would drop every POSIX lock this process holds on it, SQLite's own included, and let
another process delete the write-ahead log from under a live connection. The file is
created under a temporary name and linked into place, and only ``stat`` looks at it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import secrets
import sqlite3
import stat
import sys
import threading
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, Final, Generic, NamedTuple, TypeVar

import anyio
import anyio.lowlevel

from ..._model.codec import decode_row, encode_record
from ..._model.errors import InvalidArgument, RecordInvalid, StorageFailed
from ..._model.identity import Identity, identity_digest
from ..._model.records import STATUSES as _STATUSES
from ..._model.records import Record
from ..dirs import make_dirs, sync_dir
from ..fileio import FileSystem
from ..kernelclock import kernel_time
from ..owners import ProcessOwners, current_owner
from ..seam import Step, StepFunction, Tally
from ..threads import run_in_thread
from ..trust import require_private

__all__ = ["SQLiteStore"]

T = TypeVar("T")


def sync_pragmas(platform: str = sys.platform) -> tuple[str, ...]:
    """What a connection sets so that a commit is on the disk when it returns.

    On macOS ``fsync`` leaves the data in the drive's own cache; SQLite then needs
    ``F_FULLFSYNC`` for its commits and for its checkpoints. Elsewhere ``synchronous =
    FULL`` is enough.
    """
    if platform == "darwin":
        return ("PRAGMA fullfsync = ON", "PRAGMA checkpoint_fullfsync = ON")
    return ()


SCHEMA_VERSION: Final = 3
APPLICATION: Final = "itemjournal"
_SETTING_PREFIX: Final = "setting."  # settings share the meta table with the keys above

_OPEN: Final = ("started", "needs_review")  # the statuses in the partial index
_OPEN_CONDITION: Final = "status IN ('started', 'needs_review')"
# A row whose status SQL cannot vouch for: its key is not a digest, its status column
# is not a known status, or its document is not a blob or does not say, as the journal
# writes it, that status: ``"status": "<column>", "updated_at": `` (the keys are
# sorted). Such a row belongs in every status scan (its true status is unknown); its own
# partial index, empty while the journal is healthy, finds it without reading every
# document. The test is a byte search, not a JSON parse (which cost about as much as the
# rest of a write). A document that the strict reader accepts and that holds that text
# has that status: inside the text a quote ends a string and a colon follows, so the
# text is a key ``status``, its value and the next key; no object of a record takes
# free keys, only the top one has ``updated_at``, and keys are unique. A document
# written some other way (spacing, key order) is suspect, which costs its scans nothing
# but a look at it. So a record whose status is open always has its own status column
# or is suspect; the reader still checks every row's column against its document.
_STATUS_MARK: Final = 'CAST(\'"status": "\' || status || \'", "updated_at": \' AS BLOB)'
_SUSPECT_CONDITION: Final = (
    "typeof(digest) != 'text' OR length(CAST(digest AS BLOB)) != 64 "
    "OR digest GLOB '*[^0-9a-f]*' "
    "OR typeof(status) != 'text' "
    # a CASE, not ``NOT IN (...)``: evaluated for every written row, the list cost more
    f"OR CASE status {' '.join(f'WHEN {s!r} THEN 0' for s in _STATUSES)} ELSE 1 END "
    "OR typeof(document) != 'blob' "
    f"OR instr(document, {_STATUS_MARK}) = 0"
)
# Rows live in a rowid table in the order they were claimed: a new record is appended to
# the table's last page and its transitions soon after land on the same few pages, so a
# commit of many operations writes few pages (a digest-keyed table put every record on a
# random page, one page written per operation, each page ~4 KiB in the write-ahead log).
# The digest is found through its own unique index, whose entries are small.
_RECORDS_DDL: Final = """
CREATE TABLE IF NOT EXISTS itemjournal_records (
    id INTEGER PRIMARY KEY,
    digest TEXT NOT NULL,
    status TEXT NOT NULL,
    document BLOB NOT NULL,
    written_at REAL
);
"""
_SCHEMA: Final = (
    """
CREATE TABLE IF NOT EXISTS itemjournal_meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;
"""
    + _RECORDS_DDL
    + """
CREATE UNIQUE INDEX IF NOT EXISTS itemjournal_records_digest ON itemjournal_records (digest);
CREATE INDEX IF NOT EXISTS itemjournal_records_open ON itemjournal_records (status, digest)
    WHERE status IN ('started', 'needs_review');
CREATE INDEX IF NOT EXISTS itemjournal_records_released ON itemjournal_records (digest)
    WHERE status = 'released';
"""
    + "CREATE INDEX IF NOT EXISTS itemjournal_records_suspect ON itemjournal_records (digest)\n"
    + f"    WHERE {_SUSPECT_CONDITION};\n"
)
_TABLES: Final = frozenset({"itemjournal_meta", "itemjournal_records"})
_INDEXES: Final = frozenset(
    {
        "itemjournal_records_digest",
        "itemjournal_records_open",
        "itemjournal_records_released",
        "itemjournal_records_suspect",
    }
)
# Versions this one migrates from (see ``_migrate``): 1 kept the rows in a table keyed
# by their digest (WITHOUT ROWID); 2 had no ``written_at``, the kernel's time of each
# row's last write (``ages``).
_MIGRATES_FROM: Final = frozenset({"1", "2"})
_ROW: Final = "SELECT status, document FROM itemjournal_records WHERE digest = ?"
# ``tally``: every status counted from an index, no document read. The rows whose status
# column is ``succeeded`` (the bulk of a journal) have no index of their own: they are
# what is left of the total, which SQLite counts on the smallest index (the digests).
# ``released`` has a partial index for this alone (few rows: a record leaves that status
# when it is claimed again). The suspect rows are read and each counted as the strict
# reader tells, moved out of the count its status column put it in.
_TALLY_TOTAL: Final = "SELECT count(*) FROM itemjournal_records"
_TALLY_OPEN: Final = (
    "SELECT status, count(*) FROM itemjournal_records INDEXED BY itemjournal_records_open "
    f"WHERE {_OPEN_CONDITION} GROUP BY status"
)
_TALLY_RELEASED: Final = (
    "SELECT count(*) FROM itemjournal_records INDEXED BY itemjournal_records_released "
    "WHERE status = 'released'"
)
_TALLY_SUSPECT: Final = (
    "SELECT digest, status, document, "
    "CASE WHEN status IN ('started', 'needs_review', 'released') THEN status END "
    f"FROM itemjournal_records INDEXED BY itemjournal_records_suspect WHERE {_SUSPECT_CONDITION}"
)

# Errors after which SQLite may have rolled the whole transaction back by itself, or
# that say something about the database rather than one row.
_TRANSACTION_ERRORS: Final = frozenset(
    {
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
        sqlite3.SQLITE_NOMEM,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_INTERRUPT,
    }
)

_PENDING, _TAKEN, _DONE = 0, 1, 2
_UNSET: Final[Any] = object()


class _Undecodable(str):
    """Text that SQLite holds but that is not UTF-8: readable with replacement
    characters, its bytes kept in ``raw`` (a scan must page past it exactly)."""

    raw: bytes


def _text(data: bytes) -> str:
    """Every connection's text factory: a row of bad text is that row's problem, never an
    error that stops the statement (and with it a whole batch or scan)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text = _Undecodable(data.decode("utf-8", "replace"))
        text.raw = data
        return text


def _describe(error: BaseException) -> str:
    if isinstance(error, sqlite3.Error | OSError):
        return str(error) or type(error).__name__
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _failure(what: str, error: BaseException) -> StorageFailed:
    """``STORAGE_FAILED`` saying ``what``, caused by ``error`` (each caller its own)."""
    code = getattr(error, "errno", None)
    failure = StorageFailed(
        f"{what}: {_describe(error)}", errno=code if isinstance(code, int) else None
    )
    failure.__cause__ = error
    return failure


def _primary_code(error: BaseException) -> int | None:
    code = getattr(error, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


def _busy(error: BaseException) -> bool:
    """True when another connection holds the lock that was asked for."""
    return isinstance(error, sqlite3.OperationalError) and _primary_code(error) in (
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
    )


class _Bound(NamedTuple):
    """Where the next page of a scan starts: after (or at) a digest, in SQLite's order
    (text, compared as UTF-8 bytes, before blobs)."""

    blob: bool
    raw: bytes
    inclusive: bool


_FIRST: Final = _Bound(blob=False, raw=b"", inclusive=True)  # the smallest text: every row


def _sort_key(digest: object) -> tuple[bool, bytes]:
    if isinstance(digest, bytes):
        return True, digest
    if isinstance(digest, _Undecodable):
        return False, digest.raw
    return False, str(digest).encode("utf-8")


def _page_queries(status: str | None, after: _Bound) -> list[str]:
    """The SQL of one page of a scan (parameters: bound, page size), one or two queries.

    The open statuses (what sweeps and review queues look for) have a partial index
    (status, digest); SQLite uses it when the query repeats the index's condition. Their
    scans also read the suspect rows (through their own partial index): a row whose
    status cannot be vouched for belongs in every status scan. Any other status has no
    index, so its scan reads every row (``_page_sync`` keeps the wanted status and every
    row that cannot be read).
    """
    columns = "SELECT digest, status, document FROM itemjournal_records"
    bound = f"digest {'>=' if after.inclusive else '>'} {'?' if after.blob else 'CAST(? AS TEXT)'}"
    tail = f"{bound} ORDER BY digest LIMIT ?"
    suspect = (
        f"{columns} INDEXED BY itemjournal_records_suspect WHERE ({_SUSPECT_CONDITION}) AND {tail}"
    )
    if status is None:
        return [f"{columns} WHERE {tail}"]
    if status in _OPEN:
        return [
            f"{columns} INDEXED BY itemjournal_records_open WHERE {_OPEN_CONDITION} "
            f"AND status = '{status}' AND {tail}",
            suspect,
        ]
    return [f"{columns} WHERE {tail}"]


class _Operation(Generic[T]):
    """One caller's step (or setting), waiting for (or inside) a batch.

    Inside the batch (in the worker thread) the outcome is only *decided*
    (``pending``); it is published (``answer``/``error``, ``settled``) when the batch's
    fate is known, and the caller is woken after the worker trip.
    """

    __slots__ = (
        "_done",
        "answer",
        "culprit",
        "depends",
        "error",
        "identity",
        "key",
        "leads",
        "pending",
        "setting",
        "settled",
        "state",
        "step",
        "wrote",
    )

    def __init__(
        self,
        key: str,
        *,
        identity: Identity | None = None,
        step: StepFunction[T] | None = None,
        setting: tuple[str, str] | None = None,
    ) -> None:
        self.key = key  # the row's digest, or the meta key of a setting
        self.identity = identity
        self.step = step
        self.setting = setting
        self.state = _PENDING
        self.leads = False
        self._done: anyio.Event | None = None
        self.answer: T = _UNSET
        self.error: BaseException | None = None
        self.settled = False
        self.pending: tuple[bool, Any] | None = None  # (is an error, value), decided
        self.wrote = False  # its write is part of the transaction
        self.depends = False  # it read a row an earlier member of its batch wrote
        self.culprit = False  # its step raised a BaseException that ended the batch

    @classmethod
    def of(cls, identity: Identity, step: StepFunction[T]) -> _Operation[T]:
        return cls(identity_digest(identity), identity=identity, step=step)

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

    def reset(self) -> None:
        self.pending = None
        self.wrote = self.depends = self.culprit = False

    def publish(self) -> None:
        """Make the decided outcome the caller's answer."""
        assert self.pending is not None
        is_error, value = self.pending
        if is_error:
            self.error = value
        else:
            self.answer = value
        self.settled = True

    def fail(self, error: BaseException) -> None:
        self.answer = _UNSET
        self.error = error
        self.settled = True

    def result(self) -> T:
        if self.error is not None:
            raise self.error
        return self.answer


class _Opening:
    """How far ``open`` got, across its tries (it retries while another process holds
    a lock it needs)."""

    def __init__(self) -> None:
        self.prepared = False
        self.connection: sqlite3.Connection | None = None
        self.checked = False
        self.complete = False
        self.wal = False


class SQLiteStore(ProcessOwners):
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
        self.path = os.path.normpath(text)
        self.location = f"sqlite://{self.path}"
        self.busy_timeout = busy_timeout
        self.trust_shared_root = trust_shared_root
        self.commits = 0  # committed write transactions, for tests and benchmarks
        self._stamp: float | None = None  # the kernel's time as the batch under way began
        self._writer: sqlite3.Connection | None = None
        self._writer_lost = False  # discarded after a failed rollback; reopened on demand
        # Reader connections: a pool that worker trips check out and back in, so that
        # closing never pulls a connection from under a running read.
        self._idle_readers: list[sqlite3.Connection] = []
        self._reading = 0
        self._readers_lock = threading.Lock()
        self._queue: list[_Operation[Any]] = []
        self._leading = False
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
        timeout = self.busy_timeout if busy_timeout is None else busy_timeout
        connection = sqlite3.connect(
            self.path,
            timeout=timeout,
            isolation_level=None,  # we issue BEGIN/COMMIT ourselves
            check_same_thread=False,
        )
        connection.text_factory = _text
        try:
            connection.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
            connection.execute("PRAGMA synchronous = FULL")
            for pragma in sync_pragmas():
                connection.execute(pragma)
        except sqlite3.Error:
            connection.close()
            raise
        return connection

    def _open_step(self, opening: _Opening) -> bool:
        current_owner()  # named now: a process short of descriptors later still names itself
        """One try at opening; False when another process holds a lock it needs.

        The writer connection never waits inside SQLite (busy timeout 0): ``open``
        waits between tries on the event loop, where a cancel reaches it.
        """
        if not opening.prepared:
            self._prepare()
            opening.prepared = True
        if opening.connection is None:
            try:
                opening.connection = self._connect(busy_timeout=0)
            except sqlite3.Error as error:
                if _busy(error):  # another opener is switching the new file to WAL
                    return False
                raise _failure(f"cannot open {self.path}", error) from error
        connection = opening.connection
        try:
            if not opening.checked:  # whose database is it? Read only, before any change
                opening.complete = self._check_schema(connection)
                opening.checked = True
            if not opening.wal:
                mode = connection.execute("PRAGMA journal_mode").fetchone()[0]
                if str(mode).lower() != "wal":
                    mode = connection.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                    if str(mode).lower() != "wal":
                        raise StorageFailed(f"{self.path}: cannot switch to WAL mode (got {mode})")
                opening.wal = True
            if not opening.complete:
                self._migrate(connection)
                opening.complete = True
        except sqlite3.Error as error:
            if _busy(error):
                return False
            raise _failure(f"{self.path} is not a usable SQLite database", error) from error
        return True

    def _prepare(self) -> None:
        """Make the directory, check who may write there, create the file if absent."""
        directory = os.path.dirname(self.path)
        fs = FileSystem()
        try:
            make_dirs(directory, fs)
            if not self.trust_shared_root:
                require_private(os.stat(directory), directory, "the journal's directory")
            try:
                info = os.stat(self.path)
            except FileNotFoundError:
                self._create(directory, fs)
                info = os.stat(self.path)
            if not stat.S_ISREG(info.st_mode):
                raise StorageFailed(
                    f"{self.path} is not a regular file, so it cannot be a journal database"
                )
            if not self.trust_shared_root:
                require_private(info, self.path, "the journal database")
        except StorageFailed:
            raise
        except OSError as error:
            raise _failure(f"cannot create the journal database {self.path}", error) from error

    def _create(self, directory: str, fs: FileSystem) -> None:
        """Create the database file 0600 (SQLite's -wal and -shm copy its mode), without
        ever holding a descriptor of it: a private temp file is linked into place."""
        temp = os.path.join(directory, f".{os.path.basename(self.path)}.{secrets.token_hex(8)}.new")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        os.close(os.open(temp, flags, 0o600))
        try:
            with contextlib.suppress(FileExistsError):  # another opener made it first
                os.link(temp, self.path, follow_symlinks=False)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
        sync_dir(fs, directory)  # made here or not, the name is durable before any write

    def _check_schema(self, connection: sqlite3.Connection) -> bool:
        """Whose database this is, read only: True when it is a complete journal, False
        when it is empty or a journal missing part of its schema; refused otherwise."""
        entries = connection.execute("SELECT type, name FROM sqlite_master").fetchall()
        names = {str(name) for _, name in entries if not str(name).startswith("sqlite_")}
        tables = {str(name) for kind, name in entries if kind == "table"}
        if not names:
            return False
        if "itemjournal_meta" not in tables:
            shown = ", ".join(sorted(tables - _TABLES)) or ", ".join(sorted(names))
            raise StorageFailed(
                f"{self.path} is a SQLite database of something else "
                f"(tables: {shown}); refusing to use it"
            )
        meta = dict(connection.execute("SELECT key, value FROM itemjournal_meta").fetchall())
        if not meta and not tables - _TABLES:
            return False  # our tables, never filled in: finish creating them
        if meta.get("application") != APPLICATION:
            raise StorageFailed(f"{self.path} was not made by itemjournal")
        version = meta.get("schema_version")
        if version in _MIGRATES_FROM:
            return False  # an earlier version's journal: ``_migrate`` brings it up to date
        if version != str(SCHEMA_VERSION):
            raise StorageFailed(
                f"{self.path} has schema version {version!r}; "
                f"this itemjournal reads version {SCHEMA_VERSION}"
            )
        return tables >= _TABLES and names >= _INDEXES

    def _migrate(self, connection: sqlite3.Connection) -> None:
        """Create what is missing of the schema; idempotent, safe across processes."""
        connection.execute("BEGIN IMMEDIATE")
        try:
            self._check_schema(connection)  # again, now that no one else can write
            version = None
            if connection.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'itemjournal_meta'"
            ).fetchone():
                version = connection.execute(
                    "SELECT value FROM itemjournal_meta WHERE key = 'schema_version'"
                ).fetchone()
            if version is not None and version[0] in _MIGRATES_FROM:
                self._upgrade(connection, version[0])
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    connection.execute(statement)
            if not connection.execute("SELECT 1 FROM itemjournal_meta LIMIT 1").fetchone():
                connection.executemany(
                    "INSERT INTO itemjournal_meta (key, value) VALUES (?, ?)",
                    [("application", APPLICATION), ("schema_version", str(SCHEMA_VERSION))],
                )
            connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    connection.execute("ROLLBACK")
            raise

    def _upgrade(self, connection: sqlite3.Connection, version: str) -> None:
        """Bring an earlier version's records table up to this version, every row kept as
        it was (digest, status column and document bytes, readable or not), inside
        ``_migrate``'s transaction: another process sees the old schema or the new one.

        Rows written before ``written_at`` existed get the migration's own time: their
        age counts from now, so ``prune`` cannot remove one sooner than it could before
        (a clock that was wrong when it was written cannot make it look older)."""
        old = connection.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'itemjournal_records'"
        ).fetchone()
        if old is not None and version == "2":
            connection.execute("ALTER TABLE itemjournal_records ADD COLUMN written_at REAL")
        elif old is not None:
            connection.execute("DROP TABLE IF EXISTS itemjournal_records_upgrade")
            connection.execute(
                _RECORDS_DDL.replace(
                    "IF NOT EXISTS itemjournal_records", "itemjournal_records_upgrade"
                )
            )
            connection.execute(
                "INSERT INTO itemjournal_records_upgrade (digest, status, document) "
                "SELECT digest, status, document FROM itemjournal_records"
            )
            connection.execute("DROP TABLE itemjournal_records")  # and its indexes
            connection.execute(
                "ALTER TABLE itemjournal_records_upgrade RENAME TO itemjournal_records"
            )
        if old is not None:
            connection.execute(
                "UPDATE itemjournal_records SET written_at = ? WHERE written_at IS NULL",
                (kernel_time(),),
            )
        connection.execute(
            "UPDATE itemjournal_meta SET value = ? WHERE key = 'schema_version'",
            (str(SCHEMA_VERSION),),
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
        if meta.get("application") != APPLICATION:
            problems.append(f"STORAGE_FAILED: {self.location} does not say it is an itemjournal")
        if meta.get("schema_version") != str(SCHEMA_VERSION):
            problems.append(
                f"STORAGE_FAILED: {self.location} has schema version "
                f"{meta.get('schema_version')!r}, not {SCHEMA_VERSION}"
            )
        return problems

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

    async def _submit(self, operation: _Operation[T]) -> T:
        await anyio.lowlevel.checkpoint_if_cancelled()  # the only cancel point before queueing
        if self._closed:
            raise StorageFailed(f"{self!r} is closed")
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
                busy = False
                try:
                    busy = await run_in_thread(self._run_batch, batch)
                finally:
                    if any(member.settled for member in batch):
                        for member in batch:
                            if not member.settled:  # pragma: no cover - the batch settles all
                                member.fail(StorageFailed("the batch holding this call failed"))
                            member.state = _DONE
                            member.wake()
                    elif not busy:  # the trip never ran (cancelled first): give the rest back
                        self._give_back([m for m in batch if m is not operation])
                if not busy:
                    continue
                if anyio.current_time() >= deadline:
                    for member in batch:
                        member.fail(
                            StorageFailed(
                                f"another process held the write lock of {self.path} for "
                                f"{self.busy_timeout:g} s",
                                errno=errno.ETIMEDOUT,
                            )
                        )
                        member.state = _DONE
                        member.wake()
                    continue
                self._give_back(batch)
                try:
                    await anyio.sleep(delay * (0.5 + random.random()))
                except BaseException:
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
        self, *, status: str | None = None, after: str | None = None, batch: int = 256
    ) -> AsyncGenerator[Record | RecordInvalid | StorageFailed, None]:
        """Every row in digest order (after ``after``), a page per worker trip; see
        ``Store.scan``.

        A row that cannot be read comes as ``RecordInvalid`` (or, for an unexpected
        error reading it, ``StorageFailed``). A scan of ``succeeded``, ``released`` (or
        any status without an index) reads every row, so it returns every unreadable
        one. A scan of an open status (``started``, ``needs_review``) reads that
        status's rows through its index, and with them every row whose status SQL
        cannot vouch for (see ``_SUSPECT_CONDITION``); a row whose digest, status column
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
        is read but the suspect rows' (see ``_SUSPECT_CONDITION``), each read strictly.

        Not exact (``Tally.exact`` is False): a row whose digest, status column and
        document's status all agree, but that is damaged elsewhere, is counted under its
        status; only a full scan (``Journal.counts``) reads every row strictly.
        """
        return Tally(await run_in_thread(self._tally_sync), exact=False)

    def _tally_sync(self) -> dict[str, int]:
        try:
            with self._reader() as reader:
                reader.execute("BEGIN")
                try:
                    (total,) = reader.execute(_TALLY_TOTAL).fetchone()
                    by_column: dict[str | None, int] = dict(reader.execute(_TALLY_OPEN).fetchall())
                    by_column["released"] = reader.execute(_TALLY_RELEASED).fetchone()[0]
                    suspects = reader.execute(_TALLY_SUSPECT).fetchall()
                finally:
                    reader.execute("ROLLBACK")
        except sqlite3.Error as error:
            raise _failure(f"cannot count the records in {self.location}", error) from error
        counted = dict.fromkeys((*_STATUSES, "invalid"), 0)
        for status in (*_OPEN, "released"):
            counted[status] = by_column.get(status, 0)
        counted["succeeded"] = total - sum(counted.values())  # and rows of no known status
        for digest, column, document, indexed in suspects:
            counted["succeeded" if indexed is None else indexed] -= 1
            try:
                counted[self._read_row(digest, column, document).status] += 1
            except (RecordInvalid, StorageFailed):
                counted["invalid"] += 1
        return counted

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
        found: dict[object, object] = {}
        try:
            with self._reader() as reader:
                for start in range(0, len(digests), 500):
                    chunk = digests[start : start + 500]
                    marks = ",".join("?" * len(chunk))
                    found.update(
                        reader.execute(
                            "SELECT digest, written_at FROM itemjournal_records "
                            f"WHERE digest IN ({marks})",
                            chunk,
                        ).fetchall()
                    )
        except sqlite3.Error as error:
            raise _failure(f"cannot read {self.location}", error) from error
        now = kernel_time()
        ages: list[timedelta | None] = []
        for digest in digests:
            written = found.get(digest)
            if now is None or isinstance(written, bool) or not isinstance(written, (int, float)):
                ages.append(None)
            else:
                ages.append(timedelta(seconds=now - written))
        return ages

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
        return self._setting_value(key, row[0])

    def _setting_value(self, key: str, value: object) -> str:
        if not isinstance(value, str) or isinstance(value, _Undecodable):
            raise StorageFailed(f"the setting {key!r} in {self.location} is not readable text")
        return value

    def _page_sync(
        self, after: _Bound, size: int, status: str | None
    ) -> tuple[list[Record | RecordInvalid | StorageFailed], _Bound | None]:
        """One page of a scan and where the next starts (None: this was the last)."""
        rows: dict[tuple[bool, bytes], tuple[object, object, object]] = {}
        parameter = after.raw
        try:
            with self._reader() as reader:
                for query in _page_queries(status, after):
                    for digest, column, document in reader.execute(query, (parameter, size)):
                        rows.setdefault(_sort_key(digest), (digest, column, document))
        except sqlite3.Error as error:
            raise _failure(f"cannot read {self.location}", error) from error
        keys = sorted(rows)[:size]  # the first ``size`` of each query's first ``size``
        page: list[Record | RecordInvalid | StorageFailed] = []
        for key in keys:
            try:
                record = self._read_row(*rows[key])
            except (RecordInvalid, StorageFailed) as error:
                page.append(error)
                continue
            if status is None or record.status == status:
                page.append(record)
        if len(keys) < size:
            return page, None
        blob, raw = keys[-1]
        return page, _Bound(blob=blob, raw=raw, inclusive=False)

    def _writer_for(self, batch: list[_Operation[Any]]) -> sqlite3.Connection | None:
        """The writer connection; reopened if a failed rollback made us discard it."""
        if self._writer is not None:
            return self._writer
        if not self._writer_lost or self._closed:
            for operation in batch:
                operation.fail(StorageFailed(f"{self!r} is closed"))
            return None
        try:
            connection = self._connect(busy_timeout=0)
        except sqlite3.Error as error:
            for operation in batch:
                operation.fail(
                    _failure(
                        f"cannot reopen {self.path} for writing, so nothing was written", error
                    )
                )
            return None
        self._writer, self._writer_lost = connection, False
        return connection

    def _run_batch(self, batch: list[_Operation[Any]]) -> bool:
        """One transaction, one commit, for every operation of the batch; every member is
        settled when it returns or raises (a ``BaseException`` that no step raised).

        Returns True, having done nothing, when another process holds the write lock.
        """
        for operation in batch:
            operation.reset()
        connection = self._writer_for(batch)
        if connection is None:
            return False
        try:
            connection.execute("BEGIN IMMEDIATE")
            self._stamp = kernel_time()  # one kernel time per batch, for ``written_at``
        except BaseException as error:
            if _busy(error):
                return True
            self._abandon(
                connection, batch, error, f"cannot start a write transaction on {self.path}"
            )
            return False
        written: set[str] = set()
        try:
            for operation in batch:
                self._run_one(connection, operation, written)
        except BaseException as error:
            self._abandon(connection, batch, error, f"the write transaction on {self.path} failed")
            return False
        try:
            connection.execute("COMMIT")
        except BaseException as error:
            self._commit_failed(connection, batch, error)
            return False
        self.commits += 1
        for operation in batch:
            operation.publish()
        return False

    def _run_one(
        self, connection: sqlite3.Connection, operation: _Operation[Any], written: set[str]
    ) -> None:
        """Read, decide, write one operation inside the batch.

        The step decides before anything of its own is written, so a refusal (an
        ``Exception`` from the step) or a row that cannot be read leaves nothing to undo
        and the batch's other operations stand. A failing write statement, or a
        ``BaseException`` from a step, raises: the whole transaction is given up (see
        ``_abandon``).
        """
        operation.depends = operation.key in written
        if operation.setting is not None:
            self._run_setting(connection, operation, written)
            return
        assert operation.step is not None
        try:
            row = connection.execute(_ROW, (operation.key,)).fetchone()
        except sqlite3.Error as error:
            if not connection.in_transaction or _primary_code(error) in _TRANSACTION_ERRORS:
                raise
            operation.pending = (
                True,
                _failure(
                    f"cannot read the record of {list(operation.identity or ())} in "
                    f"{self.path}, so nothing was written for this call",
                    error,
                ),
            )
            return
        try:
            current = None if row is None else self._read_row(operation.key, row[0], row[1])
            decision: Step[Any] = operation.step(current)
            data = None if decision.write is None else encode_record(decision.write)
        except Exception as error:  # a refusal, or a record that cannot be read
            operation.pending = (True, error)
            return
        except BaseException:
            operation.culprit = True
            raise
        if decision.delete:
            operation.wrote = True
            connection.execute("DELETE FROM itemjournal_records WHERE digest = ?", (operation.key,))
        elif decision.write is not None:
            operation.wrote = True
            connection.execute(
                "INSERT INTO itemjournal_records (digest, status, document, written_at) "
                "VALUES (?, ?, ?, ?) ON CONFLICT (digest) DO UPDATE SET "
                "status = excluded.status, document = excluded.document, "
                "written_at = excluded.written_at",
                (operation.key, decision.write.status, data, self._stamp),
            )
        if operation.wrote:
            written.add(operation.key)
        operation.pending = (False, decision.answer)

    def _run_setting(
        self, connection: sqlite3.Connection, operation: _Operation[Any], written: set[str]
    ) -> None:
        assert operation.setting is not None
        key, value = operation.setting
        cursor = connection.execute(
            "INSERT INTO itemjournal_meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING",
            (key, value),
        )
        operation.wrote = cursor.rowcount != 0
        if operation.wrote:
            written.add(key)
        row = connection.execute("SELECT value FROM itemjournal_meta WHERE key = ?", (key,))
        found = row.fetchone()
        try:
            operation.pending = (
                False,
                self._setting_value(key, None if found is None else found[0]),
            )
        except StorageFailed as error:
            operation.pending = (True, error)

    def _roll_back(self, connection: sqlite3.Connection) -> BaseException | None:
        """End a failed transaction so that the writer is usable again; if that cannot be
        done, discard the connection (closing it rolls back), to be reopened on demand.
        Returns what the rollback raised, if anything."""
        try:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            if not connection.in_transaction:
                return None
            failure: BaseException | None = None
        except BaseException as error:
            failure = error
        self._writer, self._writer_lost = None, True
        with contextlib.suppress(Exception):
            connection.close()
        return failure

    def _abandon(
        self,
        connection: sqlite3.Connection,
        batch: list[_Operation[Any]],
        error: BaseException,
        what: str,
    ) -> None:
        """The transaction failed before its commit: roll it back; every member whose
        write (or whose read of a write) was lost, or that had not run, fails, and hears
        that nothing was written (true: no commit was ever asked for). Members that were
        refused, or that only read, keep their answers.

        A ``BaseException`` that a step raised goes to that step's caller alone; one from
        SQLite's side is raised again, to the leader, once every member is settled.
        """
        rollback_error = self._roll_back(connection)
        culprit = next((member for member in batch if member.culprit), None)
        for operation in batch:
            if operation is culprit:
                operation.fail(error)
            elif operation.pending is None or operation.wrote or operation.depends:
                if culprit is not None:
                    failure = StorageFailed(
                        f"another call in the same write transaction on {self.path} raised "
                        f"{type(error).__name__}, so the transaction was rolled back and "
                        f"nothing was written"
                    )
                    failure.__cause__ = error
                else:
                    failure = _failure(f"{what}, so nothing was written", error)
                operation.fail(failure)
            else:
                operation.publish()
        if culprit is None and not isinstance(error, Exception):
            raise error
        if rollback_error is not None and not isinstance(rollback_error, Exception):
            raise rollback_error

    def _commit_failed(
        self, connection: sqlite3.Connection, batch: list[_Operation[Any]], error: BaseException
    ) -> None:
        """``COMMIT`` failed: the write-ahead log may hold the transaction (it would then
        be replayed), so the writers' outcome is unknown, and said to be."""
        rollback_error = self._roll_back(connection)
        for operation in batch:
            if operation.wrote or operation.depends:
                operation.fail(
                    _failure(
                        f"the commit to {self.path} failed, so whether this call's write was "
                        f"saved is unknown (the write-ahead log may hold it)",
                        error,
                    )
                )
            else:
                operation.publish()
        if not isinstance(error, Exception):
            raise error
        if rollback_error is not None and not isinstance(rollback_error, Exception):
            raise rollback_error
