"""A ``FileSystem`` that records every call of a save and fails chosen ones with a real errno.

``FaultyFileSystem`` is the seam the fault tests use instead of mocking ``os``: it passes
through to ``os`` like the default ``FileSystem``, except for faults armed with ``fail``
(method name, which occurrence, errno, how many times, optionally only for one path) and
for short writes. It also remembers which open file each fd stood for, so a test can ask
whether an fsync was ever repeated on a handle after it failed, even if the fd number has
been reused since. Calls made relative to a directory descriptor (``dir_fd``) are logged
and matched by their full path (the directory's path joined with the name). Calls arrive
from worker threads, hence the lock.
"""

from __future__ import annotations

import errno as errno_module
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from itemjournal import FileSystem

__all__ = ["Call", "FaultyFileSystem", "RunawayLoop"]

T = TypeVar("T")


class RunawayLoop(AssertionError):
    """Raised by the seam itself when the store keeps calling after it should have stopped."""


@dataclass(frozen=True)
class Call:
    """One call through the seam: what, on which open file, and how it ended."""

    method: str
    path: str | None
    handle: int | None
    failed: bool


@dataclass
class _Fault:
    method: str
    nth: int
    error: int
    times: int
    path: str | None
    seen: int = 0


@dataclass(eq=False)
class FaultyFileSystem(FileSystem):
    """Pass-through file system with armed faults, short writes and a call log."""

    write_limit: int | None = None
    """When set, every ``write`` writes at most this many bytes (0: writes nothing)."""
    max_calls: int = 10_000
    """A guard: past this many calls of one method the seam raises ``RunawayLoop``."""
    calls: list[Call] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[_Fault] = []
        self._handles: dict[int, tuple[int, str]] = {}
        self._next_handle = 0
        self._counts: dict[str, int] = {}

    # ------------------------------------------------------------------ arming

    def fail(
        self,
        method: str,
        *,
        nth: int = 1,
        error: int = errno_module.EIO,
        times: int = 1,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        """Fail the ``nth`` call of ``method`` from now on (and ``times - 1`` more after it).

        ``path`` restricts the fault to calls on that path (for fd methods: on an fd that
        was opened on that path). ``times=-1`` fails every call from the ``nth`` on.
        """
        if not callable(getattr(FileSystem, method, None)):
            raise ValueError(f"FileSystem has no method {method!r}")
        target = None if path is None else os.fspath(path)
        with self._lock:
            self._faults.append(_Fault(method, nth, error, times, target))

    def heal(self) -> None:
        """Disarm every fault and short write; the seam passes straight through again."""
        with self._lock:
            self._faults.clear()
            self.write_limit = None

    # ------------------------------------------------------------------ queries

    def named(self, method: str) -> list[Call]:
        with self._lock:
            return [call for call in self.calls if call.method == method]

    def fsyncs_after_failure(self) -> list[Call]:
        """Every fsync (file or directory) made on a handle whose fsync had already failed."""
        failed: set[int] = set()
        repeats: list[Call] = []
        with self._lock:
            for call in self.calls:
                if call.method not in ("fsync", "fsync_dir") or call.handle is None:
                    continue
                if call.handle in failed:
                    repeats.append(call)
                if call.failed:
                    failed.add(call.handle)
        return repeats

    # ------------------------------------------------------------------ plumbing

    def _before(
        self, method: str, path: str | None, fd: int | None
    ) -> tuple[str | None, int | None]:
        """The runaway guard and the armed faults; returns the call's path and handle."""
        with self._lock:
            count = self._counts[method] = self._counts.get(method, 0) + 1
            if count > self.max_calls:
                raise RunawayLoop(f"{method} was called more than {self.max_calls} times")
            handle = None
            if fd is not None and fd in self._handles:
                handle, opened = self._handles[fd]
                path = opened if path is None else path
            for fault in self._faults:
                if fault.method != method or (fault.path is not None and fault.path != path):
                    continue
                fault.seen += 1
                last = fault.nth + fault.times - 1
                if fault.seen >= fault.nth and (fault.times < 0 or fault.seen <= last):
                    self.calls.append(Call(method, path, handle, failed=True))
                    message = f"injected {errno_module.errorcode[fault.error]} on {method}"
                    raise OSError(fault.error, os.strerror(fault.error) + f" ({message})", path)
        return path, handle

    def _log(self, method: str, path: str | None, handle: int | None) -> None:
        with self._lock:
            self.calls.append(Call(method, path, handle, failed=False))

    def _run(self, method: str, path: str | None, fd: int | None, call: Callable[[], T]) -> T:
        path, handle = self._before(method, path, fd)
        try:
            result = call()
        except OSError:
            with self._lock:
                self.calls.append(Call(method, path, handle, failed=True))
            raise
        self._log(method, path, handle)
        return result

    def _opened(self, fd: int, path: str) -> None:
        with self._lock:
            self._next_handle += 1
            self._handles[fd] = (self._next_handle, path)

    def _closed(self, fd: int) -> None:
        with self._lock:
            self._handles.pop(fd, None)

    def _at(self, path: str, dir_fd: int | None) -> str:
        """The full path of ``path``, a name inside ``dir_fd`` when that is given."""
        if dir_fd is None:
            return path
        with self._lock:
            opened = self._handles.get(dir_fd)
        directory = opened[1] if opened is not None else f"/proc/self/fd/{dir_fd}"
        return os.path.join(directory, path)

    # ------------------------------------------------------------------ the seam

    def open(self, path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
        fd = self._run(
            "open",
            self._at(path, dir_fd),
            None,
            lambda: FileSystem.open(self, path, flags, mode, dir_fd=dir_fd),
        )
        assert isinstance(fd, int)
        self._opened(fd, self._at(path, dir_fd))
        return fd

    def write(self, fd: int, data: memoryview) -> int:
        limit = self.write_limit
        if limit is not None:
            data = data[:limit]
        if limit == 0:
            self._run("write", None, fd, lambda: 0)
            return 0
        written = self._run("write", None, fd, lambda: FileSystem.write(self, fd, data))
        assert isinstance(written, int)
        return written

    def fsync(self, fd: int) -> None:
        self._run("fsync", None, fd, lambda: FileSystem.fsync(self, fd))

    def close(self, fd: int) -> None:
        self._close("close", fd)

    def link(self, source: str, destination: str, *, dir_fd: int | None = None) -> None:
        self._run(
            "link",
            self._at(destination, dir_fd),
            None,
            lambda: FileSystem.link(self, source, destination, dir_fd=dir_fd),
        )

    def replace(self, source: str, destination: str, *, dir_fd: int | None = None) -> None:
        self._run(
            "replace",
            self._at(destination, dir_fd),
            None,
            lambda: FileSystem.replace(self, source, destination, dir_fd=dir_fd),
        )

    def unlink(self, path: str, *, dir_fd: int | None = None) -> None:
        self._run(
            "unlink",
            self._at(path, dir_fd),
            None,
            lambda: FileSystem.unlink(self, path, dir_fd=dir_fd),
        )

    def mkdir(self, path: str, mode: int = 0o700, *, dir_fd: int | None = None) -> None:
        self._run(
            "mkdir",
            self._at(path, dir_fd),
            None,
            lambda: FileSystem.mkdir(self, path, mode, dir_fd=dir_fd),
        )

    def rmdir(self, path: str, *, dir_fd: int | None = None) -> None:
        self._run(
            "rmdir",
            self._at(path, dir_fd),
            None,
            lambda: FileSystem.rmdir(self, path, dir_fd=dir_fd),
        )

    def open_dir(
        self, path: str, *, dir_fd: int | None = None, follow_symlinks: bool = True
    ) -> int:
        full = self._at(path, dir_fd)
        fd = self._run(
            "open_dir",
            full,
            None,
            lambda: FileSystem.open_dir(self, path, dir_fd=dir_fd, follow_symlinks=follow_symlinks),
        )
        assert isinstance(fd, int)
        self._opened(fd, full)
        return fd

    def fsync_dir(self, fd: int) -> None:
        self._run("fsync_dir", None, fd, lambda: FileSystem.fsync_dir(self, fd))

    def close_dir(self, fd: int) -> None:
        self._close("close_dir", fd)

    def _close(self, method: str, fd: int) -> None:
        try:
            path, handle = self._before(method, None, fd)
        except OSError:
            # As on Linux, a close that reports an error still releases the descriptor.
            self._closed(fd)
            os.close(fd)
            raise
        self._closed(fd)
        try:
            os.close(fd)
        except OSError:
            with self._lock:
                self.calls.append(Call(method, path, handle, failed=True))
            raise
        self._log(method, path, handle)
