"""The filesystem calls a durable save makes, behind one replaceable object.

``FileStore`` never calls these ``os`` functions directly: it goes through a
``FileSystem``, so that tests can record each call, fail it with a real errno, or
stop at it to model a crash. The default passes straight through to ``os``.
"""

from __future__ import annotations

import os

__all__ = ["FileSystem"]


class FileSystem:
    """Pass-through to ``os`` for every call of a save."""

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        return os.open(path, flags, mode)

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def link(self, source: str, destination: str) -> None:
        os.link(source, destination, follow_symlinks=False)

    def replace(self, source: str, destination: str) -> None:
        os.replace(source, destination)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def mkdir(self, path: str, mode: int = 0o700) -> None:
        os.mkdir(path, mode)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def open_dir(self, path: str) -> int:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def fsync_dir(self, fd: int) -> None:
        os.fsync(fd)

    def close_dir(self, fd: int) -> None:
        os.close(fd)
