"""Creating a store's directory durably.

``os.makedirs`` is not enough for a journal: it gives intermediate directories the
default mode (0755 under the usual umask) and syncs nothing, so a power loss soon after
the first open can drop a freshly made directory, and every record acknowledged in it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from .fileio import FileSystem

__all__ = ["make_dirs"]


def make_dirs(path: str, fs: FileSystem) -> None:
    """Make ``path`` a directory, creating each missing component 0700 and durably.

    Walks up to the deepest existing ancestor, then for each missing component, top
    down: ``fs.mkdir(component, 0o700)``, then ``fsync`` of its parent, so the new entry
    survives a power loss before anything is built in it. A component that a concurrent
    creator made first is accepted if it is a directory, and its parent is still synced.
    If that sync fails for a component made here, the component is removed again.
    A path that already is a directory is left alone: nothing is created or synced.
    Symlinks to directories are followed, as ``os.makedirs`` does.

    Raises ``OSError`` (``ENOTDIR`` when something other than a directory is in the way);
    the caller turns it into ``StorageFailed``.
    """
    path = os.path.normpath(os.path.abspath(path))
    missing: list[str] = []
    current = path
    while True:
        try:
            info = os.stat(current)
        except FileNotFoundError:
            parent = os.path.dirname(current)
            if parent == current:  # pragma: no cover - "/" always exists
                raise
            missing.append(current)
            current = parent
            continue
        if not stat.S_ISDIR(info.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), current)
        break
    for component in reversed(missing):
        created = True
        try:
            fs.mkdir(component, 0o700)
        except FileExistsError:
            created = False
            if not os.path.isdir(component):
                raise NotADirectoryError(
                    errno.ENOTDIR, os.strerror(errno.ENOTDIR), component
                ) from None
        try:
            sync_dir(fs, os.path.dirname(component))
        except OSError:
            if created:  # never build on an entry that is not known durable: take it back
                with contextlib.suppress(OSError):
                    fs.rmdir(component)
            raise


def sync_dir(fs: FileSystem, directory: str) -> None:
    """fsync a directory, so that the entries made in it survive a power loss."""
    fd = fs.open_dir(directory)
    try:
        fs.fsync_dir(fd)
    finally:
        with contextlib.suppress(OSError):
            fs.close_dir(fd)
