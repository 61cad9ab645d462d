"""The filesystem calls a durable save makes, behind one replaceable object.

``FileStore`` never calls these ``os`` functions directly: it goes through a
``FileSystem``, so that tests can record each call, fail it with a real errno, or
stop at it to model a crash. The default passes straight through to ``os``.

Inside its root the store works relative to a directory descriptor: it opens a
fan-out directory once per operation (``open_dir(path, follow_symlinks=False)``) —
with this plain ``FileSystem`` on Linux it keeps that descriptor from one save to the
next while saves overlap, after checking with ``lstat`` that the path still names the
same private directory, and a subclass sees every call of every save — then passes
that descriptor as ``dir_fd`` to ``open``, ``link``, ``replace`` and
``unlink``, whose paths are then names inside that directory (``link`` and
``replace``: both names), and syncs the same descriptor with ``fsync_dir``. A
directory swapped for a symlink after it was opened therefore cannot redirect a
write. With ``dir_fd=None`` the paths are ordinary paths, as ``os`` takes them.

A sync is the platform's strongest: on Linux ``fsync`` reaches the disk and its cache
(given honest hardware), but on macOS ``fsync`` only hands the data to the drive, which
may keep it in a volatile cache; there ``fcntl(fd, F_FULLFSYNC)`` is what asks the drive
to write it through, for files and directories alike. ``sync_for`` picks the call.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from collections.abc import Callable
from typing import Final

__all__ = ["FileSystem", "full_fsync", "plain_fsync", "sync_for"]

# macOS's value (<sys/fcntl.h>); the fcntl module names it only where it exists.
F_FULLFSYNC: Final[int] = getattr(fcntl, "F_FULLFSYNC", 51)

# What F_FULLFSYNC answers on a file system that cannot do it (an SMB share, say): nothing
# was tried there, so a plain fsync is the best that file system offers. Any other error
# (EIO above all) is a failed sync and is raised: it is never followed by a second try.
_NOT_SUPPORTED: Final = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOTTY})


def full_fsync(fd: int) -> None:
    """Sync ``fd`` through the drive's cache: ``fcntl(fd, F_FULLFSYNC)`` (macOS), or
    ``os.fsync`` where the file system does not support that request."""
    try:
        fcntl.fcntl(fd, F_FULLFSYNC)
    except OSError as error:
        if error.errno not in _NOT_SUPPORTED:
            raise
        os.fsync(fd)


def plain_fsync(fd: int) -> None:
    """``os.fsync(fd)``, looked up at each call (so a test's watch on ``os.fsync`` sees it)."""
    os.fsync(fd)


def sync_for(platform: str = sys.platform) -> Callable[[int], None]:
    """The call that makes a file's or a directory's data durable on ``platform`` (a
    ``sys.platform`` value): ``full_fsync`` on macOS, ``plain_fsync`` everywhere else."""
    return full_fsync if platform == "darwin" else plain_fsync


_SYNC: Final = sync_for()


class FileSystem:
    """Pass-through to ``os`` for every call of a save."""

    def open(self, path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
        return os.open(path, flags, mode, dir_fd=dir_fd)

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        _SYNC(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def link(self, source: str, destination: str, *, dir_fd: int | None = None) -> None:
        os.link(source, destination, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)

    def replace(self, source: str, destination: str, *, dir_fd: int | None = None) -> None:
        os.replace(source, destination, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

    def unlink(self, path: str, *, dir_fd: int | None = None) -> None:
        os.unlink(path, dir_fd=dir_fd)

    def mkdir(self, path: str, mode: int = 0o700, *, dir_fd: int | None = None) -> None:
        os.mkdir(path, mode, dir_fd=dir_fd)

    def rmdir(self, path: str, *, dir_fd: int | None = None) -> None:
        os.rmdir(path, dir_fd=dir_fd)

    def open_dir(
        self, path: str, *, dir_fd: int | None = None, follow_symlinks: bool = True
    ) -> int:
        """A descriptor of the directory ``path``; with ``follow_symlinks=False`` a symlink
        there is refused (``ENOTDIR``), never followed."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        if not follow_symlinks:
            flags |= os.O_NOFOLLOW
        return os.open(path, flags, dir_fd=dir_fd)

    def fsync_dir(self, fd: int) -> None:
        _SYNC(fd)

    def close_dir(self, fd: int) -> None:
        os.close(fd)
