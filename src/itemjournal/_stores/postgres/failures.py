"""How the PostgreSQL store says that the server failed it.

Every psycopg or pool error the store meets becomes ``STORAGE_FAILED`` through
``failure``: one shape for them all (what was being done, then the server's first line),
and a wait that ran out of time keeps ``ETIMEDOUT`` so that callers can tell it from a
refusal.
"""

from __future__ import annotations

import errno

import psycopg.errors
import psycopg_pool

from ..._model.errors import StorageFailed

__all__ = ["describe", "failure"]


def describe(error: BaseException) -> str:
    """The first line of ``error``'s message, or its type's name when it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def failure(what: str, error: BaseException) -> StorageFailed:
    """``STORAGE_FAILED`` saying ``what``; a wait that ran out of time is ``ETIMEDOUT``."""
    timed_out = isinstance(error, psycopg.errors.LockNotAvailable | psycopg_pool.PoolTimeout)
    failed = StorageFailed(
        f"{what}: {describe(error)}", errno=errno.ETIMEDOUT if timed_out else None
    )
    failed.__cause__ = error
    return failed
