"""The file store: one JSON document per identity, written durably.

Layout: ``root/<first two hex of digest>/<digest>.json``. Beside the records of a
fan-out directory lives ``.lock``, a lock file that is never deleted; a lock on one
byte of it per record serialises read-decide-write sequences across processes. Temp files are named
``.<pid>-<writer>-<random>.tmp``, ``<writer>`` naming the writing process exactly (boot,
pid namespace, start ticks; see ``_writer_token``), so a sweep can tell whether it lives.
The root holds the location's settings (``itemjournal.json``), changed only under a lock
on ``root/.lock``, which is never deleted either.

The root and every fan-out directory must be this user's alone (``_trust``), unless the
store is made with ``trust_shared_root=True``. A fan-out directory is opened without
following a symlink, and everything inside it is done relative to that descriptor
(``dir_fd``), so a directory swapped for a symlink can neither be read through nor
redirect a write outside the root.

Every operation's disk work (lock, read, decide, write, sync) is one function run in
one worker thread.

On Linux, with the plain ``FileSystem``, a fan-out's descriptor and its ``.lock`` file's
stay open from one save to the next while ``apply`` calls overlap (``_FanoutCache``):
a save then costs one ``lstat`` of the fan-out's path, which must still show the
directory that was opened and checked, instead of two opens, a check and two closes.
Nothing stays open once no ``apply`` is under way, and a forked child opens its own.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import itertools
import json
import os
import re
import secrets
import stat
import struct
import threading
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Final, TypeVar

import anyio
import anyio.lowlevel

from ..._model.codec import decode_record, encode_record
from ..._model.errors import InvalidArgument, RecordInvalid, StorageFailed
from ..._model.identity import Identity, IdentityLike, coerce_identity, identity_digest
from ..._model.records import MAX_RECORD_BYTES, Record
from ..dirs import make_dirs, sync_dir
from ..fileio import FileSystem
from ..kernelclock import kernel_time
from ..owners import (
    ProcessOwners,
    current_owner,
    current_pid,
    local_process_space,
    own_process,
    process_alive,
)
from ..seam import Step, StepFunction
from ..threads import Trips, run_in_thread
from ..trust import require_private

__all__ = ["FileStore"]

T = TypeVar("T")

LOCK_NAME: Final = ".lock"
SETTINGS_NAME: Final = "itemjournal.json"
MAX_SETTINGS_BYTES: Final = 64 * 1024
_TEMP = re.compile(r"\.(\d+)-(\d*)-[0-9a-f]{32}\.tmp")
_FANOUT = re.compile(r"[0-9a-f]{2}")
_RECORD_NAME = re.compile(r"[0-9a-f]{64}\.json")


class _Busy:
    """Returned by a worker trip that found the lock held by someone else."""


_BUSY: Final = _Busy()


class _LostRace(Exception):
    """Another writer created the record between our read and our link."""


def _fail(what: str, error: OSError) -> StorageFailed:
    reason = error.strerror or str(error)
    return StorageFailed(f"{what}: {reason}", errno=error.errno)


_OFD_SETLK: Final[int | None] = getattr(fcntl, "F_OFD_SETLK", None)
_FLOCK_FORMAT: Final = "hhqqi"
_FLOCK_SIZE: Final = (struct.calcsize(_FLOCK_FORMAT) + 7) // 8 * 8  # with its tail padding


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


class _Fanout:
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


def _close_fanout(entry: _Fanout) -> None:
    for fd in (entry.lock_fd, entry.dir_fd):
        with contextlib.suppress(OSError):
            os.close(fd)


class _FanoutCache:
    """The open fan-outs of one store, shared by its worker threads while saves are under
    way: closed as soon as no ``apply`` is (so an idle store holds nothing open, and a
    store dropped without ``aclose`` leaks nothing), and forgotten in a forked child (whose
    inherited descriptors share the parent's open file descriptions, and so its record
    locks)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[str, _Fanout] = {}
        self.held: set[str] = set()  # digests locked by this store's saves under way

    def retire(self, entry: _Fanout) -> None:
        """Stop handing ``entry`` out; close it once unused. Call with ``lock`` held."""
        if not entry.retired:
            entry.retired = True
            for prefix, current in list(self.entries.items()):
                if current is entry:
                    del self.entries[prefix]
        if entry.users == 0:
            _close_fanout(entry)

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
            _close_fanout(entry)
        self.lock = threading.Lock()
        self.entries = {}
        self.held = set()


_CACHES: weakref.WeakSet[_FanoutCache] = weakref.WeakSet()


def _forget_in_child() -> None:
    for cache in list(_CACHES):
        cache.forget_after_fork()


os.register_at_fork(after_in_child=_forget_in_child)


# Temp names: the writer's pid and token, then 16 random hex digits drawn once per process
# and a 16-digit counter, so a save draws no randomness of its own.
_temp_counter = itertools.count()
_temp_nonce = secrets.token_hex(8)


def _new_temp_nonce() -> None:
    global _temp_counter, _temp_nonce
    _temp_counter = itertools.count()
    _temp_nonce = secrets.token_hex(8)


os.register_at_fork(after_in_child=_new_temp_nonce)


_BOOT_DIGITS: Final = 39  # 2**128-1, the largest boot id as a number, has 39 digits
_NAMESPACE_DIGITS: Final = 20  # 2**64-1, the largest inode, has 20
_TICKS = re.compile(r"0|[1-9][0-9]{0,19}")


def _writer_token() -> str:
    """This process in digits, for temp names; '' when ``/proc`` cannot name it.

    The boot id as a 39-digit number, the pid-namespace inode as a 20-digit number, then
    the start ticks: digits only, so old names stay parseable, and no wall-clock time, so
    stepping the clock cannot make a live writer look gone.
    """
    key = own_process()
    if key is None:
        return ""
    boot, namespace, ticks = key
    return f"{uuid.UUID(boot).int:0{_BOOT_DIGITS}d}{namespace:0{_NAMESPACE_DIGITS}d}{ticks}"


def _parse_writer_token(token: str) -> tuple[int, int, int] | None:
    """(boot id as a number, pid-namespace inode, start ticks), or None if not a token."""
    head = _BOOT_DIGITS + _NAMESPACE_DIGITS
    if not token.isascii() or not token.isdigit() or _TICKS.fullmatch(token[head:]) is None:
        return None
    boot, namespace, ticks = (
        int(token[:_BOOT_DIGITS]),
        int(token[_BOOT_DIGITS:head]),
        int(token[head:]),
    )
    if boot >= 2**128 or not 0 < namespace < 2**64 or ticks >= 2**64:
        return None
    return boot, namespace, ticks


_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_FANOUT_FLAGS: Final = _DIR_FLAGS | os.O_NOFOLLOW
_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_LOCK_FLAGS: Final = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
_TEMP_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


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


def _not_a_fanout(path: str, error: OSError) -> StorageFailed:
    """The error for a fan-out name that cannot be opened as a directory of its own."""
    if error.errno in (errno.ENOTDIR, errno.ELOOP):
        return StorageFailed(
            f"{path} is not a directory ({_what_is_at(path)} is in the way); the journal "
            f"never follows a symlink there, so the records of this fan-out cannot be "
            f"reached until it is repaired",
            errno=error.errno,
        )
    return _fail(f"cannot open {path}", error)


_STATUS_FIELD = re.compile(rb'"status": "([a-z_]{1,32})", "updated_at": "')


def _shows_other_status(data: bytes, status: str) -> bool:
    """Whether ``data``, laid out exactly as ``encode_record`` lays a record out, names a
    status other than ``status``; a status scan passes such a document over unparsed.

    The encoder writes sorted keys with ``", "`` and ``": "`` between them, so the
    top-level ``status`` is the only one followed by ``updated_at`` (an event's status is
    its last key), and ``updated_at`` occurs once. Inside a JSON string every ``"`` is
    escaped, so these bytes cannot come from a label or a receipt. Anything else (no
    match, another layout) says False: the document is then read strictly.
    """
    if not data.startswith(b'{"attempt": ') or not data.endswith(b"}\n"):
        return False
    if data.count(b'"updated_at": ') != 1:
        return False
    match = _STATUS_FIELD.search(data)
    return match is not None and match[1] != status.encode("ascii", "replace")


def _settings_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise ValueError(f"duplicate key {key!r}")
        document[key] = value
    return document


def decode_settings(data: bytes, path: str) -> dict[str, str]:
    """The settings of a settings document, read strictly; ``RECORD_INVALID`` otherwise."""
    try:
        document = json.loads(data.decode("utf-8"), object_pairs_hook=_settings_pairs)
    except (UnicodeDecodeError, ValueError) as error:
        raise RecordInvalid(
            f"the settings document {path} is not valid JSON ({error}); it is left as it is",
            location=path,
        ) from None
    settings = document.get("settings") if isinstance(document, dict) else None
    if (
        not isinstance(document, dict)
        or set(document) != {"application", "version", "settings"}
        or document["application"] != "itemjournal"
        or type(document["version"]) is not int
        or document["version"] != 1
        or not isinstance(settings, dict)
        or not all(isinstance(value, str) for value in settings.values())
    ):
        raise RecordInvalid(
            f"{path} is not an itemjournal settings document (expected "
            f'{{"application": "itemjournal", "version": 1, "settings": {{...}}}}); '
            f"it is left as it is",
            location=path,
        )
    return dict(settings)


def encode_settings(settings: dict[str, str]) -> bytes:
    document = {"application": "itemjournal", "version": 1, "settings": settings}
    return (json.dumps(document, ensure_ascii=False, sort_keys=True, indent=1) + "\n").encode()


class _Named:
    """What a store's ``repr`` says, standing in for the store in messages."""

    __slots__ = ("_text",)

    def __init__(self, text: str) -> None:
        self._text = text

    def __repr__(self) -> str:
        return self._text


class FileStore(ProcessOwners):
    """Record documents in a directory the caller owns and trusts.

    ``trust_shared_root=True`` skips the check that the root and its fan-out directories
    are owned by this user and not writable by group or others. Only use it when every
    user who can write there is trusted: such a user can move a record aside (a rerun
    then claims the work again) or plant one (a rerun reuses a forged receipt).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fs: FileSystem | None = None,
        lock_timeout: float = 30.0,
        temp_grace: float = 60.0,
        trust_shared_root: bool = False,
    ) -> None:
        path = os.fspath(root)
        if not os.path.isabs(path):
            raise InvalidArgument(
                f"the journal directory must be an absolute path, got {path!r}",
                code="ABSOLUTE_ROOT_REQUIRED",
            )
        self.root = Path(os.path.normpath(path))
        self.location = str(self.root)
        self.fs = fs if fs is not None else FileSystem()
        self.lock_timeout = lock_timeout
        self.temp_grace = temp_grace
        self.trust_shared_root = trust_shared_root
        self._known_dirs: set[str] = set()  # fan-outs whose entry in the root is synced
        self._temp_prefix: tuple[int, str] | None = None  # (pid, prefix with a known token)
        # Fan-out and lock descriptors kept open from save to save while saves overlap
        # (Linux, plain file system only: a replaced ``fs`` sees every call of every
        # save, as it always did).
        self._keeps_descriptors = _OFD_SETLK is not None and type(self.fs) is FileSystem
        self._fanouts = _FanoutCache()
        self._applying = 0  # ``apply`` calls under way (on the event loop)
        _CACHES.add(self._fanouts)
        # Worker trips under way; closing waits for them. Trips names the store by a
        # stand-in, not the store itself: without that cycle a store nobody holds is
        # freed at once, and its kept descriptors closed with it (see ``_fanouts``).
        self._trips = Trips(_Named(repr(self)))

    @classmethod
    def from_location(
        cls, location: str, *, lock_timeout: float, trust_shared_root: bool
    ) -> FileStore:
        """The store for ``Journal.open``'s location (an absolute directory)."""
        return cls(location, lock_timeout=lock_timeout, trust_shared_root=trust_shared_root)

    def __repr__(self) -> str:
        return f"FileStore({self.location!r})"

    # ------------------------------------------------------------------ paths

    def path_for(self, identity: IdentityLike) -> Path:
        """Where the record of ``identity`` lives (derived from its digest only)."""
        digest = identity_digest(coerce_identity(identity))
        return self.root / digest[:2] / f"{digest}.json"

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """Create the root if needed, check that it is this user's alone and that its
        settings document (if any) is an itemjournal one, and sweep temp files no live
        writer can own."""
        await self._trip(self._open_sync)

    def _open_sync(self) -> None:
        # Each missing component 0700, its parent synced after each mkdir. Through a plain
        # FileSystem, not ``self.fs``: that seam covers the store's calls inside its root
        # (a recording one rejects paths outside it), and these sync the root's parents.
        try:  # fails with ENOTDIR when something other than a directory is in the way
            outside = FileSystem()
            make_dirs(self.location, outside)
            # Sync the root's entry in its parent on every open, not only when this open
            # created it: a process may have died between another open's mkdir and sync.
            sync_dir(outside, os.path.dirname(self.location) or "/")
        except OSError as error:
            raise _fail(f"cannot create the journal directory {self.location}", error) from error
        self.sweep_temps_sync()
        self._check_settings_sync()
        current_owner()  # named now: a process short of descriptors later still names itself

    def _check_settings_sync(self) -> None:
        """Refuse a location whose settings document is not one of ours (left untouched)."""
        path = os.path.join(self.location, SETTINGS_NAME)
        try:
            root_fd = os.open(self.location, _DIR_FLAGS)
        except OSError as error:
            raise _fail(f"cannot open {self.location}", error) from error
        try:
            data = self._read(root_fd, SETTINGS_NAME, path, MAX_SETTINGS_BYTES, "settings document")
        finally:
            os.close(root_fd)
        if data is not None:
            decode_settings(data, path)

    async def aclose(self) -> None:
        """Refuse new calls, then wait for the calls under way (their worker trips) to end.

        The wait is shielded: a cancelled ``aclose`` still returns only after every trip
        under way has ended, and then lets the cancellation go on. The fan-out and
        lock-file descriptors kept while saves overlap are closed when the last one ends;
        closing closes them again, in case.
        """
        try:
            await self._trips.close()
        finally:
            self._fanouts.close_all()

    def _check_open(self) -> None:
        self._trips.check_open()

    async def _trip(self, function: Callable[..., T], *args: Any) -> T:
        """One worker trip, counted so that ``aclose`` can wait for it."""
        return await self._trips.run(function, *args)

    def _require_private(self, fd: int, path: str, what: str) -> None:
        if not self.trust_shared_root:
            require_private(os.fstat(fd), path, what)

    def sweep_temps_sync(self, now: float | None = None) -> list[str]:
        """Check the root and its fan-outs are private; remove temp files whose writer is
        gone and that are older than the grace period.

        A temp file is only ever used for the few milliseconds of one save; its name
        carries its writer's pid and exact identity, so a live writer's file is never taken.
        A fan-out name that is a symlink (or anything but a directory) is never followed:
        nothing outside the root is listed or removed. The operations that need it fail.
        """
        now = time.time() if now is None else now
        removed: list[str] = []
        try:
            root_fd = os.open(self.location, _DIR_FLAGS)
        except OSError as error:
            raise _fail(f"cannot open {self.location}", error) from error
        try:
            self._require_private(root_fd, self.location, "the journal directory")
            try:
                names = sorted(os.listdir(root_fd))
            except OSError as error:
                raise _fail(f"cannot list {self.location}", error) from error
            removed += self._sweep_dir(root_fd, self.location, names, now)
            for name in names:
                if not _FANOUT.fullmatch(name):
                    continue
                directory = os.path.join(self.location, name)
                try:
                    fd = os.open(name, _FANOUT_FLAGS, dir_fd=root_fd)
                except OSError:
                    continue
                try:
                    self._require_private(fd, directory, "the fan-out directory")
                    try:
                        entries = sorted(os.listdir(fd))
                    except OSError:
                        continue
                    removed += self._sweep_dir(fd, directory, entries, now)
                finally:
                    os.close(fd)
        finally:
            os.close(root_fd)
        return removed

    def _sweep_dir(self, dir_fd: int, directory: str, names: list[str], now: float) -> list[str]:
        removed: list[str] = []
        for name in names:
            match = _TEMP.fullmatch(name)
            if match is None:
                continue
            try:
                age = now - os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime
            except OSError:
                continue
            if age < self.temp_grace or self._writer_lives(int(match[1]), match[2]):
                continue
            try:
                os.unlink(name, dir_fd=dir_fd)
            except OSError:
                continue
            removed.append(os.path.join(directory, name))
        return removed

    async def check(self) -> list[str]:
        """Orphan temp files (their writer is gone, whatever their age) and entries that
        have no business in the root or a fan-out, one line each. Changes nothing."""
        self._check_open()
        return await run_in_thread(self._check_sync)

    def _check_sync(self) -> list[str]:
        problems: list[str] = []
        try:
            root_fd = os.open(self.location, _DIR_FLAGS)
        except OSError as error:
            raise _fail(f"cannot open {self.location}", error) from error
        try:
            try:
                names = sorted(os.listdir(root_fd))
            except OSError as error:
                raise _fail(f"cannot list {self.location}", error) from error
            expected_root = {LOCK_NAME, SETTINGS_NAME}
            problems += self._check_dir(root_fd, self.location, names, expected_root, fanouts=True)
            for name in names:
                if not _FANOUT.fullmatch(name):
                    continue
                directory = os.path.join(self.location, name)
                try:
                    fd = os.open(name, _FANOUT_FLAGS, dir_fd=root_fd)
                except OSError:
                    continue  # the scan reports a fan-out it cannot open
                try:
                    entries = sorted(os.listdir(fd))
                except OSError:
                    continue
                finally:
                    os.close(fd)
                problems += self._check_dir(None, directory, entries, {LOCK_NAME}, fanouts=False)
        finally:
            os.close(root_fd)
        return problems

    def _check_dir(
        self,
        dir_fd: int | None,
        directory: str,
        names: list[str],
        expected: set[str],
        *,
        fanouts: bool,
    ) -> list[str]:
        problems: list[str] = []
        for name in names:
            path = os.path.join(directory, name)
            match = _TEMP.fullmatch(name)
            if match is not None:
                if not self._writer_lives(int(match[1]), match[2]):
                    problems.append(
                        f"STORAGE_FAILED: orphan temp file {path}: its writer is gone "
                        f"(the next open removes it once it is a minute old)"
                    )
            elif name in expected or (fanouts and _FANOUT.fullmatch(name)):
                continue
            elif not fanouts and _RECORD_NAME.fullmatch(name):
                if name[:2] != os.path.basename(directory):
                    problems.append(f"RECORD_INVALID: {path} is in the wrong fan-out directory")
            else:
                problems.append(f"STORAGE_FAILED: unexpected entry {path} in the journal")
        return problems

    @staticmethod
    def _writer_lives(pid: int, token: str) -> bool:
        """False only when the temp's writer is surely gone; when in doubt, it lives."""
        if not token:  # the writer could not name itself: trust the pid
            return process_alive(pid, None) is not False
        parsed = _parse_writer_token(token)
        if parsed is None:  # no writer of this version names itself so
            return False
        boot, namespace, ticks = parsed
        space = local_process_space()
        if space is None:  # cannot tell which boot or namespace this is
            return True
        if boot != uuid.UUID(space[0]).int:  # an earlier boot: none of its processes lives
            return False
        # In another pid namespace the answer is None (unknown): keep the file.
        return process_alive(pid, (space[0], namespace, ticks)) is not False

    # ------------------------------------------------------------------ the seam

    async def apply(self, identity: Identity, step: StepFunction[T]) -> T:
        self._applying += 1
        try:
            return await self._locked(
                f"the record lock of {list(identity)}", self._apply_sync, identity, step
            )
        finally:
            self._applying -= 1
            if not self._applying and self._fanouts.entries:
                # No save under way, none waiting for its lock: keep nothing open while
                # idle. No worker thread uses an entry now; a non-blocking acquire
                # cannot fail then, and if it ever did the next idle moment closes them.
                self._fanouts.close_all(blocking=False)

    async def setting(self, name: str, value: str) -> str:
        """The location's recorded value of ``name``; records ``value`` first if none is.

        Kept in ``root/itemjournal.json``, changed only under a lock on ``root/.lock`` and
        written like a record (temp, fsync, link or replace, directory fsync), so of two
        first openers one value wins and both are told which.
        """
        for what, text in (("name", name), ("value", value)):
            if not isinstance(text, str) or (what == "name" and not text):
                raise InvalidArgument(
                    f"a setting's {what} is a non-empty string, not {text!r}",
                    code="INVALID_ARGUMENT",
                )
        return await self._locked(
            f"the settings lock of {self.location}", self._setting_sync, name, value
        )

    async def _locked(self, what: str, function: Callable[..., T | _Busy], *args: Any) -> T:
        """Run a trip that takes a lock without blocking; while it is busy, retry after
        cancellable sleeps, for at most ``lock_timeout`` seconds."""
        deadline: float | None = None
        delay = 0.0005
        while True:
            result = await self._trip(function, *args)
            if not isinstance(result, _Busy):
                return result
            now = anyio.current_time()
            if deadline is None:
                deadline = now + self.lock_timeout
            elif now >= deadline:
                raise StorageFailed(
                    f"{what} stayed held for {self.lock_timeout:g} s", errno=errno.ETIMEDOUT
                )
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def peek(self, identity: Identity, view: Callable[[Record | None], T]) -> T:
        return await self._trip(self._peek_sync, identity, view)

    async def scan(
        self, *, status: str | None = None, after: str | None = None, batch: int = 256
    ) -> AsyncGenerator[Record | RecordInvalid | StorageFailed, None]:
        """Every record in digest order (after ``after``), in batches; what cannot be read
        is yielded, never raised.

        A record that cannot be read comes as ``RecordInvalid``; a fan-out name that cannot
        be listed (not a directory, a symlink, shared with other users) as
        ``StorageFailed``, where its records would come. Only a root that cannot be listed
        at all ends the scan (raised). Fan-outs are listed as the scan gets to them, each
        worker trip listing as many as its batch needs: a caller that stops after its first
        page has listed a fan-out or two, not the whole store.

        With ``status``, a document whose bytes are laid out exactly as the store writes
        them and name another status is passed over unread (``_shows_other_status``): the
        strict reader runs on every record yielded and on every document whose status
        cannot be seen so, but a document of another status that is damaged past its
        status is reported only by a scan without ``status`` (``verify``, ``list``).
        """
        fanouts = await self._trip(self._fanouts_sync)
        if after is not None:
            fanouts = fanouts[bisect.bisect_left(fanouts, after[:2]) :]
        fanouts.reverse()  # taken from the end, in order
        pending: list[tuple[str, str]] = []
        while fanouts or pending:
            items, pending = await self._trip(
                self._scan_step_sync, fanouts, pending, batch, status, after
            )
            for item in items:
                if status is None or not isinstance(item, Record) or item.status == status:
                    yield item

    async def ages(self, identities: Sequence[Identity]) -> list[timedelta | None]:
        """How long ago each record file was last written, by the kernel: the modification
        time it stamped when the write landed, against ``kernel_time()`` (``/proc``; no
        process's clock enters either). One worker trip."""
        return await self._trip(self._ages_sync, list(identities))

    def _ages_sync(self, identities: list[Identity]) -> list[timedelta | None]:
        now = kernel_time()
        ages: list[timedelta | None] = []
        for identity in identities:
            digest = identity_digest(identity)
            path = os.path.join(self.location, digest[:2], f"{digest}.json")
            try:
                written = os.stat(path, follow_symlinks=False).st_mtime
            except OSError:
                ages.append(None)
                continue
            ages.append(None if now is None else timedelta(seconds=now - written))
        return ages

    async def tally(self) -> None:
        """None: the file store keeps no index, so counting its records is a full scan
        (every fan-out listed, every record read)."""
        await anyio.lowlevel.checkpoint()

    # ------------------------------------------------------------------ worker-thread code

    def _open_fanout_for_reading(self, directory: str) -> int | None:
        """The fan-out's descriptor, checked; None when there is no such directory."""
        try:
            fd = os.open(directory, _FANOUT_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as error:
            raise _not_a_fanout(directory, error) from error
        try:
            self._require_private(fd, directory, "the fan-out directory")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _fanouts_sync(self) -> list[str]:
        """The names of the fan-out directories, sorted."""
        try:
            return sorted(name for name in os.listdir(self.location) if _FANOUT.fullmatch(name))
        except OSError as error:
            raise _fail(f"cannot list the records in {self.location}", error) from error

    def _list_fanout(self, fanout: str, after: str | None) -> list[tuple[str, str]]:
        """(fan-out, name) of every file in ``fanout`` named like a record (after
        ``after``), sorted; ``StorageFailed`` when it cannot be listed."""
        directory = os.path.join(self.location, fanout)
        fd = self._open_fanout_for_reading(directory)
        if fd is None:  # removed since the listing
            return []
        try:
            names = os.listdir(fd)
        except OSError as error:
            raise _fail(f"cannot list {directory}", error) from error
        finally:
            os.close(fd)
        bound = None if after is None or after[:2] != fanout else f"{after}.json"
        return [
            (fanout, name)
            for name in sorted(names)
            if _RECORD_NAME.fullmatch(name) and (bound is None or name > bound)
        ]

    def _scan_step_sync(
        self,
        fanouts: list[str],
        pending: list[tuple[str, str]],
        batch: int,
        status: str | None,
        after: str | None,
    ) -> tuple[list[Record | RecordInvalid | StorageFailed], list[tuple[str, str]]]:
        """One batch of a scan: what is pending read first, then fan-outs listed (taken
        from the end of ``fanouts``) and read until ``batch`` names (or problems) are done
        or no fan-out is left. Returns what was read and the names still pending."""
        items: list[Record | RecordInvalid | StorageFailed] = []
        done = 0
        while True:
            if pending:
                chunk, pending = pending[: batch - done], pending[batch - done :]
                items.extend(self._load_sync(chunk, status))
                done += len(chunk)
            if done >= batch or not fanouts:
                return items, pending
            try:
                pending = self._list_fanout(fanouts.pop(), after)
            except StorageFailed as problem:
                items.append(problem)
                done += 1

    def _load_sync(
        self, names: list[tuple[str, str]], status: str | None = None
    ) -> list[Record | RecordInvalid | StorageFailed]:
        loaded: list[Record | RecordInvalid | StorageFailed] = []
        fanout: str | None = None
        fd: int | None = None
        broken = False
        try:
            directory = self.location
            for prefix, name in names:
                if prefix != fanout:
                    directory = os.path.join(self.location, prefix)
                    if fd is not None:
                        os.close(fd)
                    fanout, fd, broken = prefix, None, False
                    try:
                        fd = self._open_fanout_for_reading(directory)
                    except StorageFailed as problem:  # changed since the listing
                        loaded.append(problem)
                        broken = True
                if broken or fd is None:
                    continue
                loaded.extend(self._load_one(fd, directory, name, status))
        finally:
            if fd is not None:
                os.close(fd)
        return loaded

    def _load_one(
        self, fd: int, directory: str, name: str, status: str | None = None
    ) -> list[Record | RecordInvalid]:
        path = f"{directory}/{name}"  # both already normalised; cheaper than os.path.join
        digest = name[:-5]
        try:
            data = self._read(fd, name, path)
            if data is None:  # removed since the listing
                return []
            if status is not None and _shows_other_status(data, status):
                return []
            if os.path.basename(directory) != digest[:2]:
                raise RecordInvalid(f"record at {path} is in the wrong directory", location=path)
            return [decode_record(data, digest, location=path)]
        except RecordInvalid as error:
            return [error]
        except StorageFailed as error:  # unreadable: its status is unknown, like an invalid one
            problem = RecordInvalid(
                f"record at {path} cannot be read: {error.message}", location=path
            )
            problem.__cause__ = error.__cause__
            return [problem]

    def _peek_sync(self, identity: Identity, view: Callable[[Record | None], T]) -> T:
        digest = identity_digest(identity)
        directory = os.path.join(self.location, digest[:2])
        name = f"{digest}.json"
        path = os.path.join(directory, name)
        data: bytes | None = None
        fd = self._open_fanout_for_reading(directory)
        if fd is not None:
            try:
                data = self._read(fd, name, path)
            finally:
                os.close(fd)
        record = None if data is None else decode_record(data, identity, location=path)
        return view(record)

    def _apply_sync(self, identity: Identity, step: StepFunction[T]) -> T | _Busy:
        digest = identity_digest(identity)
        directory = os.path.join(self.location, digest[:2])
        name = f"{digest}.json"
        target = os.path.join(directory, name)
        if self._keeps_descriptors:
            return self._apply_cached(identity, step, digest)
        dir_fd, _ = self._open_fanout_for_writing(digest[:2], directory)
        try:
            try:
                lock_fd = os.open(LOCK_NAME, _LOCK_FLAGS, 0o600, dir_fd=dir_fd)
            except OSError as error:
                raise _fail(f"cannot open the lock file in {directory}", error) from error
            try:
                try:
                    if not try_lock_record(lock_fd, digest):
                        return _BUSY
                except OSError as error:
                    raise _fail(f"cannot lock {target}", error) from error
                return self._apply_locked(identity, step, dir_fd, digest)
            finally:
                os.close(lock_fd)  # also releases the lock
        finally:
            self._quietly(self.fs.close_dir, dir_fd)

    def _apply_cached(self, identity: Identity, step: StepFunction[T], digest: str) -> T | _Busy:
        """``_apply_sync`` through the fan-out's kept descriptors.

        Saves of this store share one open file description of ``.lock``, so the kernel
        does not exclude them from one another: ``held`` does, for the digests locked
        here. The record's byte is unlocked explicitly, as the descriptor stays open.
        """
        directory = os.path.join(self.location, digest[:2])
        target = os.path.join(directory, f"{digest}.json")
        cache = self._fanouts
        with cache.lock:
            if digest in cache.held:
                return _BUSY
            cache.held.add(digest)
        try:
            entry = self._acquire_fanout(digest[:2], directory)
            try:
                try:
                    if not try_lock_record(entry.lock_fd, digest):
                        return _BUSY
                except OSError as error:
                    raise _fail(f"cannot lock {target}", error) from error
                try:
                    return self._apply_locked(identity, step, entry.dir_fd, digest)
                finally:
                    try:
                        unlock_record(entry.lock_fd, digest)
                    except OSError:  # closing the descriptor releases it, once unused
                        with cache.lock:
                            cache.retire(entry)
            finally:
                self._release_fanout(entry)
        finally:
            with cache.lock:
                cache.held.discard(digest)

    def _apply_locked(
        self, identity: Identity, step: StepFunction[T], dir_fd: int, digest: str
    ) -> T:
        """Read, decide and write one record whose lock is held."""
        directory = os.path.join(self.location, digest[:2])
        name = f"{digest}.json"
        target = os.path.join(directory, name)
        for _ in range(8):
            data = self._read(dir_fd, name, target)
            current = None if data is None else decode_record(data, identity, location=target)
            decision: Step[T] = step(current)
            if decision.delete:
                if data is not None:
                    self._delete(dir_fd, directory, name)
                return decision.answer
            if decision.write is None:
                return decision.answer
            encoded = encode_record(decision.write)
            if len(encoded) > MAX_RECORD_BYTES:
                raise StorageFailed(
                    f"the new record would exceed {MAX_RECORD_BYTES} bytes",
                    errno=errno.EFBIG,
                )
            try:
                if data is None:
                    self._create(dir_fd, directory, name, encoded, "record")
                else:
                    self._replace(dir_fd, directory, name, encoded, "record")
            except _LostRace:
                continue
            return decision.answer
        raise StorageFailed(f"{target} kept changing under the lock", errno=errno.EAGAIN)

    def _setting_sync(self, name: str, value: str) -> str | _Busy:
        fs = self.fs
        path = os.path.join(self.location, SETTINGS_NAME)
        try:
            root_fd = fs.open_dir(self.location)
        except OSError as error:
            raise _fail(f"cannot open {self.location}", error) from error
        try:
            try:
                lock_fd = os.open(LOCK_NAME, _LOCK_FLAGS, 0o600, dir_fd=root_fd)
            except OSError as error:
                raise _fail(f"cannot open the lock file in {self.location}", error) from error
            try:
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return _BUSY
                except OSError as error:
                    lock = os.path.join(self.location, LOCK_NAME)
                    raise _fail(f"cannot lock {lock}", error) from error
                for _ in range(8):
                    data = self._read(
                        root_fd, SETTINGS_NAME, path, MAX_SETTINGS_BYTES, "settings document"
                    )
                    settings = {} if data is None else decode_settings(data, path)
                    if name in settings:
                        # A writer may have died between its link and its directory sync:
                        # make what this answer rests on durable before giving it.
                        try:
                            fs.fsync_dir(root_fd)
                        except OSError as error:
                            raise _fail(f"cannot sync {self.location}", error) from error
                        return settings[name]
                    encoded = encode_settings({**settings, name: value})
                    save = self._create if data is None else self._replace
                    try:
                        save(root_fd, self.location, SETTINGS_NAME, encoded, "settings document")
                    except _LostRace:
                        continue
                    return value
                raise StorageFailed(f"{path} kept changing under the lock", errno=errno.EAGAIN)
            finally:
                os.close(lock_fd)  # also releases the lock
        finally:
            self._quietly(fs.close_dir, root_fd)

    def _acquire_fanout(self, prefix: str, directory: str) -> _Fanout:
        """The fan-out's kept descriptors, for one save; give them back with
        ``_release_fanout``.

        One ``lstat`` of the fan-out's path per save stands in for opening and checking
        it again: while it shows the very directory that was opened and checked (device,
        inode, owner and mode unchanged), the kept descriptor is that directory. Anything
        else (a missing, replaced or re-moded directory, a symlink) retires the entry and
        goes through ``_open_fanout_for_writing`` again, which checks it afresh. Like a
        fresh open, this cannot stop a swap made after the check: the save then goes to
        the directory that was checked.
        """
        cache = self._fanouts
        info: os.stat_result | None = None
        if prefix in cache.entries:
            with contextlib.suppress(OSError):  # if so, the full open says what is wrong
                info = os.lstat(directory)
        if info is not None:
            key = (info.st_dev, info.st_ino, info.st_uid, info.st_mode)
            with cache.lock:
                entry = cache.entries.get(prefix)
                if entry is not None and entry.key == key:
                    entry.users += 1
                    return entry
        dir_fd, opened = self._open_fanout_for_writing(prefix, directory)
        try:
            lock_fd = os.open(LOCK_NAME, _LOCK_FLAGS, 0o600, dir_fd=dir_fd)
        except OSError as error:
            self._quietly(self.fs.close_dir, dir_fd)
            raise _fail(f"cannot open the lock file in {directory}", error) from error
        entry = _Fanout(
            dir_fd, lock_fd, (opened.st_dev, opened.st_ino, opened.st_uid, opened.st_mode)
        )
        with cache.lock:
            old = cache.entries.get(prefix)
            if old is not None:
                cache.retire(old)
            cache.entries[prefix] = entry
            entry.users += 1
        return entry

    def _release_fanout(self, entry: _Fanout) -> None:
        cache = self._fanouts
        with cache.lock:
            entry.users -= 1
            if entry.retired and entry.users == 0:
                _close_fanout(entry)

    def _open_fanout_for_writing(self, prefix: str, directory: str) -> tuple[int, os.stat_result]:
        """The fan-out's descriptor (made if missing), checked, its entry in the root
        durable; and its ``fstat``.

        Opened without following a symlink and checked; a kept descriptor is used only
        while ``lstat`` shows the directory unchanged (``_acquire_fanout``), so a fan-out
        swapped after first use is refused too. Its entry in the root is synced once per
        directory and store (also for a directory found existing, since a process may have
        died between creating it and syncing the root), and whenever it is made here.
        """
        fs = self.fs
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
                raise _fail(f"cannot create {directory}", error) from error
            try:
                fd = fs.open_dir(directory, follow_symlinks=False)
            except OSError as error:
                raise _not_a_fanout(directory, error) from error
        except OSError as error:
            raise _not_a_fanout(directory, error) from error
        try:
            info = os.fstat(fd)
            if not self.trust_shared_root:
                require_private(info, directory, "the fan-out directory")
            # A directory made here is synced into the root even if one of this name was
            # before (removed behind the store's back since): its entry is new.
            if created or prefix not in self._known_dirs:
                try:
                    self._sync_dir(self.location)
                except OSError as error:
                    if created:  # never build on an entry that is not known durable
                        self._quietly(fs.rmdir, directory)
                    raise _fail(
                        f"cannot sync {self.location} after creating {directory}; "
                        f"nothing was written in it",
                        error,
                    ) from error
                self._known_dirs.add(prefix)
        except BaseException:
            self._quietly(fs.close_dir, fd)
            raise
        return fd, info

    def _read(
        self,
        dir_fd: int,
        name: str,
        path: str,
        limit: int = MAX_RECORD_BYTES,
        what: str = "record",
    ) -> bytes | None:
        """The document's bytes, None when absent; never follows a symlink, never blocks
        on a FIFO. ``name`` is inside the directory ``dir_fd``; ``path`` names it in errors."""
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise RecordInvalid(
                    f"{what} at {path} is not a regular file ({error.strerror})", location=path
                ) from None
            raise _fail(f"cannot open {path}", error) from error
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
            raise _fail(f"cannot read {path}", error) from error
        finally:
            os.close(fd)

    def _temp_name(self) -> str:
        """A new temp file name (no directory): ``.<pid>-<writer>-<unique>.tmp``, where
        ``<unique>`` is this process's random nonce and a counter (32 hex digits)."""
        pid = current_pid()
        if self._temp_prefix is not None and self._temp_prefix[0] == pid:
            prefix = self._temp_prefix[1]
        else:
            token = _writer_token()
            prefix = f".{pid}-{token}-"
            if token:  # an unknown token is asked again next time, not kept for good
                self._temp_prefix = (pid, prefix)
        return f"{prefix}{_temp_nonce}{next(_temp_counter):016x}.tmp"

    def _write_temp(self, dir_fd: int, directory: str, data: bytes) -> str:
        """A new temp file in ``dir_fd`` holding all of ``data``, synced and closed; its
        name. Removed again on any failure."""
        fs = self.fs
        temp = self._temp_name()
        where = os.path.join(directory, temp)
        try:
            fd = fs.open(temp, _TEMP_FLAGS, 0o600, dir_fd=dir_fd)
        except OSError as error:
            raise _fail(f"cannot create a temp file in {directory}", error) from error
        try:
            view = memoryview(data)
            while view:
                written = fs.write(fd, view)
                if written <= 0:
                    raise OSError(errno.EIO, "write made no progress")
                view = view[written:]
            fs.fsync(fd)
        except BaseException as error:
            self._quietly(fs.close, fd)
            self._quietly(fs.unlink, temp, dir_fd=dir_fd)
            if isinstance(error, OSError):
                raise _fail(f"cannot write {where}", error) from error
            raise
        try:
            fs.close(fd)
        except OSError as error:
            self._quietly(fs.unlink, temp, dir_fd=dir_fd)
            raise _fail(f"cannot close {where}", error) from error
        return temp

    def _drop(self, dir_fd: int, name: str) -> None:
        """Unlink a temp name, trying twice; one that stays is left for the open-time sweep."""
        if not self._quietly(self.fs.unlink, name, dir_fd=dir_fd):
            self._quietly(self.fs.unlink, name, dir_fd=dir_fd)

    def _create(self, dir_fd: int, directory: str, name: str, data: bytes, what: str) -> None:
        """Create-if-absent: temp → fsync → link (fails if it exists) → directory fsync.

        After a failed directory fsync the new entry is unlinked again, but that fsync is
        never repeated (a failed fsync cannot be trusted to tell the truth a second time),
        so the error says that what the disk holds is unknown.
        """
        fs = self.fs
        target = os.path.join(directory, name)
        temp = self._write_temp(dir_fd, directory, data)
        try:
            fs.link(temp, name, dir_fd=dir_fd)
        except FileExistsError:
            self._quietly(fs.unlink, temp, dir_fd=dir_fd)
            raise _LostRace() from None
        except OSError as error:
            self._quietly(fs.unlink, temp, dir_fd=dir_fd)
            raise _fail(f"cannot create {target}", error) from error
        except BaseException:
            self._quietly(fs.unlink, temp, dir_fd=dir_fd)
            raise
        self._drop(dir_fd, temp)  # if it stays, a second link to the new document
        try:
            fs.fsync_dir(dir_fd)
        except OSError as error:
            # The new entry may not survive a power loss: nothing may be acknowledged,
            # so take it back (in memory at least) rather than leave an unowned claim.
            if self._quietly(fs.unlink, name, dir_fd=dir_fd):
                outcome = (
                    f"the new {what} was unlinked again, but after a failed directory sync "
                    f"what the disk holds is unknown (durability unknown): after a power "
                    f"loss it may be back"
                )
                if what == "record":
                    outcome += " as an unowned started record, which then needs review"
            else:
                outcome = (
                    f"the new {what} stays at {target} unowned (durability unknown): "
                    f"it needs review"
                )
            raise _fail(
                f"cannot sync {directory} after creating {target}; {outcome}", error
            ) from error

    def _replace(self, dir_fd: int, directory: str, name: str, data: bytes, what: str) -> None:
        """Replace: temp → fsync → link the current version to a backup name → rename the
        temp over it → directory fsync → unlink the backup.

        The backup lets a failed directory fsync put the previous version back with one
        rename, which needs no new descriptor (so even ``EMFILE`` cannot stop it). The
        failed fsync is never repeated: the error says the outcome is unknown. A backup
        left behind by a crash is a temp file of a dead writer, swept on open.
        """
        fs = self.fs
        target = os.path.join(directory, name)
        temp = self._write_temp(dir_fd, directory, data)
        backup = self._temp_name()
        try:
            fs.link(name, backup, dir_fd=dir_fd)
        except BaseException as error:
            self._quietly(fs.unlink, temp, dir_fd=dir_fd)
            if isinstance(error, OSError):
                raise _fail(f"cannot keep the previous version of {target}", error) from error
            raise
        try:
            fs.replace(temp, name, dir_fd=dir_fd)
        except BaseException as error:
            self._quietly(fs.unlink, temp, dir_fd=dir_fd)
            self._drop(dir_fd, backup)
            if isinstance(error, OSError):
                raise _fail(f"cannot replace {target}", error) from error
            raise
        try:
            fs.fsync_dir(dir_fd)
        except OSError as error:
            # The new version is in place but not known durable: put the previous one back.
            try:
                fs.replace(backup, name, dir_fd=dir_fd)
                outcome = (
                    f"the previous {what} was put back in place, but after a failed directory "
                    f"sync what the disk holds is unknown (durability unknown): after a power "
                    f"loss it may hold either version"
                )
            except OSError:
                self._drop(dir_fd, backup)
                outcome = (
                    f"the new {what} is in place and may hold either version after a power "
                    f"loss (durability unknown); inspect it"
                )
            raise _fail(
                f"cannot sync {directory} after replacing {target}; {outcome}", error
            ) from error
        except BaseException:
            self._drop(dir_fd, backup)
            raise
        self._drop(dir_fd, backup)

    def _delete(self, dir_fd: int, directory: str, name: str) -> None:
        """Remove a record: unlink → directory fsync."""
        target = os.path.join(directory, name)
        try:
            self.fs.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return
        except OSError as error:
            raise _fail(f"cannot remove {target}", error) from error
        try:
            self.fs.fsync_dir(dir_fd)
        except OSError as error:
            raise _fail(
                f"removed {target}, but cannot sync {directory}: whether the removal is on "
                f"disk is unknown (durability unknown)",
                error,
            ) from error

    def _sync_dir(self, directory: str) -> None:
        sync_dir(self.fs, directory)

    @staticmethod
    def _quietly(call: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        try:
            call(*args, **kwargs)
        except OSError:
            return False
        return True
