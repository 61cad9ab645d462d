"""Fan-out descriptors kept open from one save to the next while saves overlap.

On Linux, with the plain ``FileSystem``, a fan-out's descriptor and its ``.lock`` file's
stay open while ``apply`` calls overlap: a save then costs one ``lstat`` of the fan-out's
path, which must still show the directory that was opened and checked, instead of two
opens, a check and two closes. Nothing stays open once no ``apply`` is under way, and a
forked child opens its own (its inherited descriptors share the parent's open file
descriptions, and so its record locks).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable

from ..fileio import FileSystem
from .layout import quietly
from .locks import open_lock_file


class KeptFanout:
    """A fan-out directory's descriptor and its ``.lock`` file's, kept open from save to
    save while saves overlap.

    ``key`` is what the directory was checked as (device, inode, owner, mode): a save
    uses the descriptors only while ``lstat`` of the fan-out's path still shows exactly
    that, so a directory replaced, swapped for a symlink or made shared since is opened
    and checked afresh. ``users`` counts the saves using it: a retired entry is closed
    only once none does, as closing the lock file's descriptor drops every lock taken
    through it.
    """

    __slots__ = ("dir_fd", "key", "lock_fd", "retired", "users")

    def __init__(self, dir_fd: int, lock_fd: int, key: tuple[int, int, int, int]) -> None:
        self.dir_fd = dir_fd
        self.lock_fd = lock_fd
        self.key = key
        self.users = 0
        self.retired = False


def _close(entry: KeptFanout) -> None:
    for fd in (entry.lock_fd, entry.dir_fd):
        with contextlib.suppress(OSError):
            os.close(fd)


class KeptFanouts:
    """The open fan-outs of one store, shared by its worker threads while saves are under
    way: closed as soon as no ``apply`` is (so an idle store holds nothing open, and a
    store dropped without ``aclose`` leaks nothing), and forgotten in a forked child."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[str, KeptFanout] = {}
        self.held: set[str] = set()  # digests locked by this store's saves under way
        _CACHES.add(self)

    def acquire(
        self,
        prefix: str,
        directory: str,
        open_fresh: Callable[[str, str], tuple[int, os.stat_result]],
        fs: FileSystem,
    ) -> KeptFanout:
        """The fan-out's kept descriptors, for one save; give them back with ``release``.

        One ``lstat`` of the fan-out's path per save stands in for opening and checking
        it again: while it shows the very directory that was opened and checked (device,
        inode, owner and mode unchanged), the kept descriptor is that directory. Anything
        else (a missing, replaced or re-moded directory, a symlink) retires the entry and
        goes through ``open_fresh`` (``layout.open_fanout_for_writing``) again, which
        checks it afresh. Like a fresh open, this cannot stop a swap made after the
        check: the save then goes to the directory that was checked.
        """
        info: os.stat_result | None = None
        if prefix in self.entries:
            with contextlib.suppress(OSError):  # if so, the full open says what is wrong
                info = os.lstat(directory)
        if info is not None:
            key = (info.st_dev, info.st_ino, info.st_uid, info.st_mode)
            with self.lock:
                entry = self.entries.get(prefix)
                if entry is not None and entry.key == key:
                    entry.users += 1
                    return entry
        dir_fd, opened = open_fresh(prefix, directory)
        try:
            lock_fd = open_lock_file(dir_fd, directory)
        except BaseException:
            quietly(fs.close_dir, dir_fd)
            raise
        entry = KeptFanout(
            dir_fd, lock_fd, (opened.st_dev, opened.st_ino, opened.st_uid, opened.st_mode)
        )
        with self.lock:
            old = self.entries.get(prefix)
            if old is not None:
                self.retire(old)
            self.entries[prefix] = entry
            entry.users += 1
        return entry

    def release(self, entry: KeptFanout) -> None:
        """Give back what ``acquire`` handed out; a retired entry closes once unused."""
        with self.lock:
            entry.users -= 1
            if entry.retired and entry.users == 0:
                _close(entry)

    def retire(self, entry: KeptFanout) -> None:
        """Stop handing ``entry`` out; close it once unused. Call with ``lock`` held."""
        if not entry.retired:
            entry.retired = True
            for prefix, current in list(self.entries.items()):
                if current is entry:
                    del self.entries[prefix]
        if entry.users == 0:
            _close(entry)

    def close_idle(self) -> None:
        """Close every entry (none is in use once no save is under way). Call with
        ``lock`` held."""
        for entry in list(self.entries.values()):
            self.retire(entry)

    def close_all(self, *, blocking: bool = True) -> None:
        if not self.lock.acquire(blocking):
            return
        try:
            self.close_idle()
        finally:
            self.lock.release()

    def forget_after_fork(self) -> None:
        """In a forked child: close the inherited descriptors (the parent keeps its own,
        and with them its locks), start over with a new lock and nothing held."""
        for entry in self.entries.values():
            _close(entry)
        self.lock = threading.Lock()
        self.entries = {}
        self.held = set()


_CACHES: weakref.WeakSet[KeptFanouts] = weakref.WeakSet()


def _forget_in_child() -> None:
    for cache in list(_CACHES):
        cache.forget_after_fork()


os.register_at_fork(after_in_child=_forget_in_child)
