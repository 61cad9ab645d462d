"""Opening the SQLite database: the file made privately, the schema checked, WAL mode.

The database file is never opened or closed outside SQLite: closing any descriptor of it
would drop every POSIX lock this process holds on it, SQLite's own included, and let
another process delete the write-ahead log from under a live connection. So the file is
created under a temporary name and linked into place, and only ``stat`` looks at it.

Opening is a series of tries (``open_step``), each of which may find another process
holding a lock it needs; ``_Opening`` remembers how far the tries got, so that the store
can wait between them (on the event loop, or blocking its caller's thread) and go on where
the last one stopped; ``OpenRetry`` says how long each wait is, and when to give up.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import secrets
import sqlite3
import stat
from collections.abc import Callable

from ..._model.errors import StorageFailed
from ..dirs import make_dirs, sync_dir
from ..fileio import FileSystem
from ..owners import current_owner
from ..trust import require_private
from .connection import _busy, _failure
from .schema import check_schema, migrate

__all__ = ["OpenRetry", "_Opening", "open_step"]


class _Opening:
    """How far ``open`` got, across its tries (it retries while another process holds
    a lock it needs)."""

    def __init__(self) -> None:
        self.prepared = False
        self.connection: sqlite3.Connection | None = None
        self.checked = False
        self.complete = False
        self.wal = False


class OpenRetry:
    """The waits between the tries of one opening: short and jittered, growing to 5 ms
    (SQLite's own busy handler, whose sleeps lengthen to 100 ms, would let a busy process
    starve a waiting one); ``ETIMEDOUT`` once ``timeout`` seconds have passed since
    ``now``, on the clock the caller waits by."""

    def __init__(self, path: str, timeout: float, now: float) -> None:
        self.path = path
        self.timeout = timeout
        self.deadline = now + timeout
        self.delay = 0.0002

    def next_delay(self, now: float) -> float:
        """How long to wait before the next try; raises once the time is up."""
        if now >= self.deadline:
            raise StorageFailed(
                f"another process held a lock on {self.path} for "
                f"{self.timeout:g} s, so it could not be opened",
                errno=errno.ETIMEDOUT,
            )
        delay = self.delay * (0.5 + random.random())
        self.delay = min(self.delay * 2, 0.005)
        return delay


def open_step(
    opening: _Opening,
    path: str,
    *,
    trust_shared_root: bool,
    connect: Callable[[], sqlite3.Connection],
) -> bool:
    """One try at opening; False when another process holds a lock it needs.

    ``connect`` makes the writer connection, which never waits inside SQLite (busy
    timeout 0): ``open`` waits between tries on the event loop, where a cancel reaches it
    (``open_blocking`` in its caller's thread, where an interrupt does).
    """
    current_owner()  # named now: a process short of descriptors later still names itself
    if not opening.prepared:
        _prepare(path, trust_shared_root=trust_shared_root)
        opening.prepared = True
    if opening.connection is None:
        try:
            opening.connection = connect()
        except sqlite3.Error as error:
            if _busy(error):  # another opener is switching the new file to WAL
                return False
            raise _failure(f"cannot open {path}", error) from error
    connection = opening.connection
    try:
        if not opening.checked:  # whose database is it? Read only, before any change
            opening.complete = check_schema(connection, path)
            opening.checked = True
        if not opening.wal:
            mode = connection.execute("PRAGMA journal_mode").fetchone()[0]
            if str(mode).lower() != "wal":
                mode = connection.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise StorageFailed(f"{path}: cannot switch to WAL mode (got {mode})")
            opening.wal = True
        if not opening.complete:
            migrate(connection, path)
            opening.complete = True
    except sqlite3.Error as error:
        if _busy(error):
            return False
        raise _failure(f"{path} is not a usable SQLite database", error) from error
    return True


def _prepare(path: str, *, trust_shared_root: bool) -> None:
    """Make the directory, check who may write there, create the file if absent."""
    directory = os.path.dirname(path)
    fs = FileSystem()
    try:
        make_dirs(directory, fs)
        if not trust_shared_root:
            require_private(os.stat(directory), directory, "the journal's directory")
        try:
            info = os.stat(path)
        except FileNotFoundError:
            _create(path, directory, fs)
            info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise StorageFailed(f"{path} is not a regular file, so it cannot be a journal database")
        if not trust_shared_root:
            require_private(info, path, "the journal database")
    except StorageFailed:
        raise
    except OSError as error:
        raise _failure(f"cannot create the journal database {path}", error) from error


def _create(path: str, directory: str, fs: FileSystem) -> None:
    """Create the database file 0600 (SQLite's -wal and -shm copy its mode), without
    ever holding a descriptor of it: a private temp file is linked into place."""
    temp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}.new")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    os.close(os.open(temp, flags, 0o600))
    try:
        with contextlib.suppress(FileExistsError):  # another opener made it first
            os.link(temp, path, follow_symlinks=False)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
    sync_dir(fs, directory)  # made here or not, the name is durable before any write
