"""The file store's locks: taken without blocking in a worker thread, waited for on the loop.

A record's read-decide-write is serialised across processes by a lock on one byte of its
fan-out directory's ``.lock`` file; the settings document by a lock on the whole of the
root's ``.lock``. Neither file is ever deleted, so a lock is never taken on a file that is
about to vanish. A worker trip that finds a lock held returns ``BUSY`` at once instead of
blocking its thread; ``retry_while_busy`` runs such a trip again after cancellable sleeps,
so a wait for a lock can be cancelled like any other. Its blocking twin,
``retry_while_busy_blocking``, waits the same way in its caller's thread (no event loop).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
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


class _Patience:
    """How long a lock held elsewhere is waited for: the next delay between attempts,
    doubling up to 50 ms, until ``lock_timeout`` seconds after the first busy attempt."""

    __slots__ = ("_deadline", "_delay", "_lock_timeout", "_what")

    def __init__(self, what: str, lock_timeout: float) -> None:
        self._what = what
        self._lock_timeout = lock_timeout
        self._deadline: float | None = None
        self._delay = 0.0005

    def next_delay(self, now: float) -> float:
        """The sleep before the next attempt (``now`` by the caller's monotonic clock);
        ``STORAGE_FAILED`` (``ETIMEDOUT``) once the lock has stayed held too long."""
        if self._deadline is None:
            self._deadline = now + self._lock_timeout
        elif now >= self._deadline:
            raise StorageFailed(
                f"{self._what} stayed held for {self._lock_timeout:g} s", errno=errno.ETIMEDOUT
            )
        delay = self._delay
        self._delay = min(delay * 2, 0.05)
        return delay


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
    patience = _Patience(what, lock_timeout)
    while True:
        result = await trip(function, *args)
        if not isinstance(result, Busy):
            return result
        await anyio.sleep(patience.next_delay(anyio.current_time()))


def retry_while_busy_blocking(
    counted: Callable[[], AbstractContextManager[object]],
    what: str,
    lock_timeout: float,
    function: Callable[..., T | Busy],
    *args: Any,
) -> T:
    """``retry_while_busy`` in the caller's thread: ``function(*args)`` runs there, each
    attempt inside ``counted()`` (the store's count of blocking calls), and the sleeps
    between attempts block the thread (the same backoff, timeout and error). Each attempt
    is counted on its own, so a store closed meanwhile refuses the next one instead of
    having its close wait out the lock."""
    patience = _Patience(what, lock_timeout)
    while True:
        with counted():
            result = function(*args)
        if not isinstance(result, Busy):
            return result
        time.sleep(patience.next_delay(time.monotonic()))


class _CallLockFiles:
    """The ``.lock`` descriptors that saves under way opened for themselves (not kept
    from save to save): a forked child closes its copies of them at once.

    A record lock belongs to an open file description, which a forked child shares
    through the descriptors it inherits. Had the child kept its copy of a descriptor that
    a save in another of the parent's threads was using at the fork, the record would
    stay locked after that save ended, for as long as the child lives, and the child's
    own saves of it (through a description of their own) would find it held. Opening,
    closing and forking take turns on one lock, so that no such descriptor is inherited
    unregistered, and none still registered has been closed (its number may be reused).
    """

    def __init__(self) -> None:
        self.turn = threading.Lock()
        self.open: set[int] = set()
        os.register_at_fork(
            before=self.turn.acquire,
            after_in_parent=self.turn.release,
            after_in_child=self._forget_in_child,
        )

    def _forget_in_child(self) -> None:  # pragma: no cover - runs in forked children
        for fd in self.open:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.open.clear()
        self.turn.release()  # taken before the fork by this very thread


_CALL_LOCK_FILES: Final = _CallLockFiles()


def open_call_lock_file(dir_fd: int, directory: str) -> int:
    """``open_lock_file`` for one save's own use; close it with ``close_call_lock_file``
    (a forked child closes its copy at once: ``_CallLockFiles``)."""
    with _CALL_LOCK_FILES.turn:
        fd = open_lock_file(dir_fd, directory)
        _CALL_LOCK_FILES.open.add(fd)
    return fd


def close_call_lock_file(fd: int) -> None:
    """Close what ``open_call_lock_file`` opened (releasing the locks taken through it)."""
    with _CALL_LOCK_FILES.turn:
        _CALL_LOCK_FILES.open.discard(fd)
        os.close(fd)
