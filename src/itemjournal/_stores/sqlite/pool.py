"""The SQLite store's reads: a pool of reader connections and what is read through it.

Every read is one blocking function here, called the same way by both faces of the store:
in a worker thread for an awaited call, in the caller's own thread for a blocking one
(``blocking``). Each checks a connection out of the pool for its statements and back in
before it makes records of the rows, so that closing (which waits for the reads under
way) never pulls a connection from under a running statement, and a fork (``forking``)
finds every connection idle. The statements themselves are ``reads``.
"""

from __future__ import annotations

import abc
import contextlib
import sqlite3
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TypeVar

from ..._model.codec import decode_row
from ..._model.errors import InvalidArgument, RecordInvalid, StorageFailed
from ..._model.identity import Identity, identity_digest
from ..._model.records import Record
from ..kernelclock import kernel_time
from . import reads
from .connection import _failure, _Undecodable
from .reads import _FIRST, _Bound
from .schema import _ROW, _SETTING_PREFIX, meta_problems, setting_text

__all__ = ["ReaderPool"]

T = TypeVar("T")


class ReaderPool(abc.ABC):
    """Reader connections, checked out by each read and back in; the reads themselves."""

    path: str
    location: str
    _closed: bool

    def __init__(self) -> None:
        super().__init__()
        self._idle_readers: list[sqlite3.Connection] = []
        self._reading = 0  # reads holding a connection now, guarded by _readers_lock
        self._readers_lock = threading.Lock()

    @abc.abstractmethod
    def _connect(self, *, busy_timeout: float | None = None) -> sqlite3.Connection:
        """A new connection to the database."""

    @contextlib.contextmanager
    def _reader(self) -> Iterator[sqlite3.Connection]:
        """A reader connection for this read, from the pool and back into it."""
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

    def _tally_sync(self) -> dict[str, int]:
        try:
            with self._reader() as reader:
                total, by_column, suspects = reads.fetch_tally(reader)
        except sqlite3.Error as error:
            raise _failure(f"cannot count the records in {self.location}", error) from error
        return reads.count(total, by_column, suspects, self._read_row)

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

    @staticmethod
    def _setting_key(name: str, value: str) -> str:
        """The meta key of setting ``name``: ``setting.<name>``, apart from the keys that
        say whose database it is."""
        if not isinstance(name, str) or not isinstance(value, str):
            raise InvalidArgument("a setting's name and value are text", code="INVALID_ARGUMENT")
        return _SETTING_PREFIX + name

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

    @staticmethod
    def _scan_start(after: str | None) -> _Bound:
        """Where a scan's first page starts: the first row, or just after ``after``."""
        return _FIRST if after is None else _Bound(blob=False, raw=after.encode(), inclusive=False)

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
