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
"""

from __future__ import annotations

import os

__all__ = ["FileSystem"]


class FileSystem:
    """Pass-through to ``os`` for every call of a save."""

    def open(self, path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
        return os.open(path, flags, mode, dir_fd=dir_fd)

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

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
        os.fsync(fd)

    def close_dir(self, fd: int) -> None:
        os.close(fd)
