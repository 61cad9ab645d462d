"""The file store's locks: taken without blocking in a worker thread, waited for on the loop.

A record's read-decide-write is serialised across processes by a lock on one byte of its
fan-out directory's ``.lock`` file; the settings document by a lock on the whole of the
root's ``.lock``. Neither file is ever deleted, so a lock is never taken on a file that is
about to vanish. A worker trip that finds a lock held returns ``BUSY`` at once instead of
blocking its thread; ``retry_while_busy`` runs such a trip again after cancellable sleeps,
so a wait for a lock can be cancelled like any other.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import anyio

from ..._model.errors import StorageFailed
from .layout import LOCK_FLAGS, LOCK_NAME, fail

T = TypeVar("T")


class Busy:
    """Returned by a worker trip that found the lock held by someone else."""


BUSY: Final = Busy()

_OFD_SETLK: Final[int | None] = getattr(fcntl, "F_OFD_SETLK", None)
_FLOCK_FORMAT: Final = "hhqqi"
_FLOCK_SIZE: Final = (struct.calcsize(_FLOCK_FORMAT) + 7) // 8 * 8  # with its tail padding

# Only open-file-description locks stay put while the ``.lock`` descriptor is kept open
# from save to save (see ``kept``); elsewhere each save opens and closes its own.
LOCKS_SURVIVE_KEPT_DESCRIPTORS: Final = _OFD_SETLK is not None


def record_lock_offset(digest: str) -> int:
    """The byte of the fan-out directory's ``.lock`` file that stands for one record."""
    return int(digest[:15], 16)


def try_lock_record(fd: int, digest: str) -> bool:
    """Take the exclusive lock of one record without blocking; False when it is held.

    On Linux: an open-file-description lock (``F_OFD_SETLK``) on one byte of the lock
    file, so records sharing a fan-out directory do not wait for each other. Unlike
    classic POSIX record locks, closing another descriptor of the file does not drop
    it. Elsewhere: ``flock`` on the whole file (one lock per fan-out directory).
    """
    if _OFD_SETLK is None:  # pragma: no cover - not Linux
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True
    request = struct.pack(
        _FLOCK_FORMAT, fcntl.F_WRLCK, os.SEEK_SET, record_lock_offset(digest), 1, 0
    ).ljust(_FLOCK_SIZE, b"\0")
    try:
        fcntl.fcntl(fd, _OFD_SETLK, request)
    except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: someone holds it
        return False
    return True


def unlock_record(fd: int, digest: str) -> None:
    """Release the lock ``try_lock_record`` took on a descriptor that stays open (Linux)."""
    assert _OFD_SETLK is not None
    request = struct.pack(
        _FLOCK_FORMAT, fcntl.F_UNLCK, os.SEEK_SET, record_lock_offset(digest), 1, 0
    ).ljust(_FLOCK_SIZE, b"\0")
    fcntl.fcntl(fd, _OFD_SETLK, request)


def open_lock_file(dir_fd: int, directory: str) -> int:
    """The descriptor of ``directory``'s ``.lock`` file, made if missing (and kept: it is
    never deleted)."""
    try:
        return os.open(LOCK_NAME, LOCK_FLAGS, 0o600, dir_fd=dir_fd)
    except OSError as error:
        raise fail(f"cannot open the lock file in {directory}", error) from error


def try_lock_whole(lock_fd: int, directory: str) -> bool:
    """Take the exclusive lock of the whole ``.lock`` file of ``directory`` without
    blocking (the settings lock of the root); False when it is held."""
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as error:
        raise fail(f"cannot lock {os.path.join(directory, LOCK_NAME)}", error) from error
    return True


async def retry_while_busy(
    trip: Callable[..., Awaitable[T | Busy]],
    what: str,
    lock_timeout: float,
    function: Callable[..., T | Busy],
    *args: Any,
) -> T:
    """Run ``trip(function, *args)``, a worker trip that takes a lock without blocking;
    while it is busy, retry after cancellable sleeps, for at most ``lock_timeout``
    seconds (``what`` names the lock in the error)."""
    deadline: float | None = None
    delay = 0.0005
    while True:
        result = await trip(function, *args)
        if not isinstance(result, Busy):
            return result
        now = anyio.current_time()
        if deadline is None:
            deadline = now + lock_timeout
        elif now >= deadline:
            raise StorageFailed(f"{what} stayed held for {lock_timeout:g} s", errno=errno.ETIMEDOUT)
        await anyio.sleep(delay)
        delay = min(delay * 2, 0.05)
