"""Where the file store keeps things, and how it opens them without being led astray.

Layout: ``root/<first two hex of digest>/<digest>.json``. Each fan-out directory holds a
``.lock`` file beside its records (see ``locks``); the root holds the location's settings
document (``itemjournal.json``) and a ``.lock`` of its own. Neither lock file is ever
deleted.

The root and every fan-out directory must be this user's alone (``..trust``) unless the
store trusts a shared root. A fan-out directory is opened without following a symlink,
and everything inside it is done relative to that descriptor (``dir_fd``), so a directory
swapped for a symlink can neither be read through nor redirect a write outside the root.

These are the pieces every other part of the store opens things with: the names and
patterns, the open flags, the strict read of one document, and the two ways of opening a
fan-out (to read it; to write in it, made and synced into the root if need be). Each runs
in a worker thread, inside some larger trip.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable
from typing import Any, Final

from ..._model.errors import RecordInvalid, StorageFailed
from ..._model.records import MAX_RECORD_BYTES
from ..dirs import sync_dir
from ..fileio import FileSystem
from ..trust import require_private

LOCK_NAME: Final = ".lock"
SETTINGS_NAME: Final = "itemjournal.json"
FANOUT: Final = re.compile(r"[0-9a-f]{2}")
RECORD_NAME: Final = re.compile(r"[0-9a-f]{64}\.json")

DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
FANOUT_FLAGS: Final = DIR_FLAGS | os.O_NOFOLLOW
READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
LOCK_FLAGS: Final = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
TEMP_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def fail(what: str, error: OSError) -> StorageFailed:
    """The store's error for an ``OSError`` met while doing ``what``."""
    reason = error.strerror or str(error)
    return StorageFailed(f"{what}: {reason}", errno=error.errno)


def quietly(call: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Run a clean-up step whose failure must not hide the error being raised; whether
    it succeeded."""
    try:
        call(*args, **kwargs)
    except OSError:
        return False
    return True


def check_private(fd: int, path: str, what: str, *, trust_shared_root: bool) -> None:
    """Refuse a directory others can write in, unless the store trusts a shared root."""
    if not trust_shared_root:
        require_private(os.fstat(fd), path, what)


def _what_is_at(path: str) -> str:
    """A few words on the thing at ``path`` that is not a directory (for messages)."""
    try:
        info = os.lstat(path)
    except OSError:
        return "something other than a directory"
    if stat.S_ISLNK(info.st_mode):
        return "a symlink"
    if stat.S_ISREG(info.st_mode):
        return "a file"
    return "something other than a directory"


def not_a_fanout(path: str, error: OSError) -> StorageFailed:
    """The error for a fan-out name that cannot be opened as a directory of its own."""
    if error.errno in (errno.ENOTDIR, errno.ELOOP):
        return StorageFailed(
            f"{path} is not a directory ({_what_is_at(path)} is in the way); the journal "
            f"never follows a symlink there, so the records of this fan-out cannot be "
            f"reached until it is repaired",
            errno=error.errno,
        )
    return fail(f"cannot open {path}", error)


def open_root(location: str) -> int:
    """The root's descriptor, for listing it or reading in it."""
    try:
        return os.open(location, DIR_FLAGS)
    except OSError as error:
        raise fail(f"cannot open {location}", error) from error


def open_fanout_for_reading(directory: str, *, trust_shared_root: bool) -> int | None:
    """The fan-out's descriptor, checked; None when there is no such directory."""
    try:
        fd = os.open(directory, FANOUT_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise not_a_fanout(directory, error) from error
    try:
        check_private(fd, directory, "the fan-out directory", trust_shared_root=trust_shared_root)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_fanout_for_writing(
    fs: FileSystem,
    location: str,
    prefix: str,
    directory: str,
    *,
    trust_shared_root: bool,
    known_dirs: set[str],
) -> tuple[int, os.stat_result]:
    """The fan-out's descriptor (made if missing), checked, its entry in the root
    durable; and its ``fstat``.

    Opened without following a symlink and checked; a kept descriptor is used only
    while ``lstat`` shows the directory unchanged (``kept.KeptFanouts.acquire``), so a
    fan-out swapped after first use is refused too. Its entry in the root is synced once
    per directory and store (``known_dirs``: also for a directory found existing, since a
    process may have died between creating it and syncing the root), and whenever it is
    made here.
    """
    created = False
    try:
        fd = fs.open_dir(directory, follow_symlinks=False)
    except FileNotFoundError:
        try:
            fs.mkdir(directory, 0o700)
            created = True
        except FileExistsError:
            pass
        except OSError as error:
            raise fail(f"cannot create {directory}", error) from error
        try:
            fd = fs.open_dir(directory, follow_symlinks=False)
        except OSError as error:
            raise not_a_fanout(directory, error) from error
    except OSError as error:
        raise not_a_fanout(directory, error) from error
    try:
        info = os.fstat(fd)
        if not trust_shared_root:
            require_private(info, directory, "the fan-out directory")
        # A directory made here is synced into the root even if one of this name was
        # before (removed behind the store's back since): its entry is new.
        if created or prefix not in known_dirs:
            try:
                sync_dir(fs, location)
            except OSError as error:
                if created:  # never build on an entry that is not known durable
                    quietly(fs.rmdir, directory)
                raise fail(
                    f"cannot sync {location} after creating {directory}; nothing was written in it",
                    error,
                ) from error
            known_dirs.add(prefix)
    except BaseException:
        quietly(fs.close_dir, fd)
        raise
    return fd, info


def read_document(
    dir_fd: int,
    name: str,
    path: str,
    limit: int = MAX_RECORD_BYTES,
    what: str = "record",
) -> bytes | None:
    """The document's bytes, None when absent; never follows a symlink, never blocks
    on a FIFO. ``name`` is inside the directory ``dir_fd``; ``path`` names it in errors."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise RecordInvalid(
                f"{what} at {path} is not a regular file ({error.strerror})", location=path
            ) from None
        raise fail(f"cannot open {path}", error) from error
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RecordInvalid(f"{what} at {path} is not a regular file", location=path)
        if info.st_size > limit:
            raise RecordInvalid(
                f"{what} at {path} has {info.st_size} bytes, more than {limit}",
                location=path,
            )
        # Ask for one byte more than the size: a short read of a regular file is its
        # end, so one read usually does (and no buffer of ``limit`` bytes is made).
        # A file that grew meanwhile is read on, up to one byte over the limit.
        chunks: list[bytes] = []
        size = 0
        want = info.st_size + 1
        while size <= limit:
            chunk = os.read(fd, min(want, limit + 1 - size))
            chunks.append(chunk)
            size += len(chunk)
            if len(chunk) < want:
                break
            want = 64 * 1024
        return b"".join(chunks)
    except OSError as error:
        raise fail(f"cannot read {path}", error) from error
    finally:
        os.close(fd)
