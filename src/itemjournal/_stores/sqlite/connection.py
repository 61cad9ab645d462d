"""SQLite connections: how one is made, and what SQLite's errors mean.

Every connection of the store, the writer and the readers alike, is made here, with the
settings that make a commit durable when it returns and a text factory that lets a row of
bad text be that row's problem. The errors SQLite raises are read here too: whether
another process holds a lock, whether the error may have ended the whole transaction,
and the ``STORAGE_FAILED`` a caller hears.
"""

from __future__ import annotations

import sqlite3
import sys
from typing import Final

from ..._model.errors import StorageFailed

__all__ = [
    "_TRANSACTION_ERRORS",
    "_Undecodable",
    "_busy",
    "_failure",
    "_primary_code",
    "connect",
    "sync_pragmas",
]

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


def sync_pragmas(platform: str = sys.platform) -> tuple[str, ...]:
    """What a connection sets so that a commit is on the disk when it returns.

    On macOS ``fsync`` leaves the data in the drive's own cache; SQLite then needs
    ``F_FULLFSYNC`` for its commits and for its checkpoints. Elsewhere ``synchronous =
    FULL`` is enough.
    """
    if platform == "darwin":
        return ("PRAGMA fullfsync = ON", "PRAGMA checkpoint_fullfsync = ON")
    return ()


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


def connect(path: str, timeout: float) -> sqlite3.Connection:
    """A connection to the database at ``path`` that waits at most ``timeout`` seconds
    inside SQLite for a lock, in autocommit mode (the store issues BEGIN and COMMIT)."""
    connection = sqlite3.connect(
        path,
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
