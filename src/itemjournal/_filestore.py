"""The file store: one JSON document per identity, written durably.

Layout: ``root/<first two hex of digest>/<digest>.json``. Beside the records of a
fan-out directory lives ``.lock``, a lock file that is never deleted; a lock on one
byte of it per record serialises read-decide-write sequences across processes. Temp files are named
``.<pid>-<writer>-<random>.tmp``, ``<writer>`` naming the writing process exactly (boot,
pid namespace, start ticks; see ``_writer_token``), so a sweep can tell whether it lives.

Every operation's disk work (lock, read, decide, write, sync) is one function run in
one worker thread.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import stat
import struct
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any, Final, TypeVar

import anyio

from ._dirs import make_dirs, sync_dir
from ._errors import RecordInvalid, StorageFailed
from ._fileio import FileSystem
from ._identity import Identity, IdentityLike, coerce_identity, identity_digest
from ._owner import local_process_space, own_process, process_alive
from ._records import MAX_RECORD_BYTES, Record, decode_record, encode_record
from ._store import Step, StepFunction
from ._threads import run_in_thread

__all__ = ["FileStore"]

T = TypeVar("T")

LOCK_NAME: Final = ".lock"
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


class FileStore:
    """Record documents in a directory the caller owns and trusts."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fs: FileSystem | None = None,
        lock_timeout: float = 30.0,
        temp_grace: float = 60.0,
    ) -> None:
        path = os.fspath(root)
        if not os.path.isabs(path):
            from ._errors import InvalidArgument

            raise InvalidArgument(
                f"the journal directory must be an absolute path, got {path!r}",
                code="ABSOLUTE_ROOT_REQUIRED",
            )
        self.root = Path(os.path.normpath(path))
        self.location = str(self.root)
        self.fs = fs if fs is not None else FileSystem()
        self.lock_timeout = lock_timeout
        self.temp_grace = temp_grace
        self._known_dirs: set[str] = set()
        self._temp_prefix: tuple[int, str] | None = None  # (pid, prefix with a known token)
        self._closed = False

    def __repr__(self) -> str:
        return f"FileStore({self.location!r})"

    # ------------------------------------------------------------------ paths

    def path_for(self, identity: IdentityLike) -> Path:
        """Where the record of ``identity`` lives (derived from its digest only)."""
        digest = identity_digest(coerce_identity(identity))
        return self.root / digest[:2] / f"{digest}.json"

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """Create the root if needed and sweep temp files no live writer can own."""
        await run_in_thread(self._open_sync)

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

    async def aclose(self) -> None:
        """Refuse later calls (as every store does); a file store holds nothing open."""
        self._closed = True
        await anyio.lowlevel.checkpoint()

    def _check_open(self) -> None:
        if self._closed:
            raise StorageFailed(f"{self!r} is closed")

    def sweep_temps_sync(self, now: float | None = None) -> list[str]:
        """Remove temp files whose writer is gone and that are older than the grace period.

        A temp file is only ever used for the few milliseconds of one save; its name
        carries its writer's pid and exact identity, so a live writer's file is never taken.
        """
        now = time.time() if now is None else now
        removed: list[str] = []
        try:
            fanouts = [e for e in os.scandir(self.root) if _FANOUT.fullmatch(e.name)]
        except OSError as error:
            raise _fail(f"cannot list {self.location}", error) from error
        for fanout in fanouts:
            try:
                entries = list(os.scandir(fanout.path))
            except OSError:
                continue
            for entry in entries:
                match = _TEMP.fullmatch(entry.name)
                if match is None:
                    continue
                try:
                    age = now - entry.stat(follow_symlinks=False).st_mtime
                except OSError:
                    continue
                if age < self.temp_grace or self._writer_lives(int(match[1]), match[2]):
                    continue
                try:
                    os.unlink(entry.path)
                except OSError:
                    continue
                removed.append(entry.path)
        return removed

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
        self._check_open()
        deadline: float | None = None
        delay = 0.0005
        while True:
            result = await run_in_thread(self._apply_sync, identity, step)
            if not isinstance(result, _Busy):
                return result
            now = anyio.current_time()
            if deadline is None:
                deadline = now + self.lock_timeout
            elif now >= deadline:
                raise StorageFailed(
                    f"the record lock of {list(identity)} stayed held for {self.lock_timeout:g} s",
                    errno=errno.ETIMEDOUT,
                )
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def peek(self, identity: Identity, view: Callable[[Record | None], T]) -> T:
        self._check_open()
        return await run_in_thread(self._peek_sync, identity, view)

    async def scan(
        self, *, status: str | None = None, batch: int = 256
    ) -> AsyncGenerator[Record | RecordInvalid, None]:
        self._check_open()
        paths = await run_in_thread(self._list_sync)
        for start in range(0, len(paths), batch):
            chunk = paths[start : start + batch]
            for item in await run_in_thread(self._load_sync, chunk):
                if status is None or isinstance(item, RecordInvalid) or item.status == status:
                    yield item

    # ------------------------------------------------------------------ worker-thread code

    def _list_sync(self) -> list[str]:
        """Paths of every file named like a record (the names say nothing else)."""
        paths: list[str] = []
        try:
            fanouts = sorted(e.path for e in os.scandir(self.root) if _FANOUT.fullmatch(e.name))
            for fanout in fanouts:
                names = sorted(
                    entry.name for entry in os.scandir(fanout) if _RECORD_NAME.fullmatch(entry.name)
                )
                paths.extend(os.path.join(fanout, name) for name in names)
        except OSError as error:
            raise _fail(f"cannot list the records in {self.location}", error) from error
        return paths

    def _load_sync(self, paths: list[str]) -> list[Record | RecordInvalid]:
        loaded: list[Record | RecordInvalid] = []
        for path in paths:
            digest = os.path.basename(path)[:-5]
            try:
                data = self._read(path)
                if data is None:  # removed since the listing
                    continue
                if os.path.basename(os.path.dirname(path)) != digest[:2]:
                    raise RecordInvalid(
                        f"record at {path} is in the wrong directory", location=path
                    )
                loaded.append(decode_record(data, digest, location=path))
            except RecordInvalid as error:
                loaded.append(error)
        return loaded

    def _peek_sync(self, identity: Identity, view: Callable[[Record | None], T]) -> T:
        digest = identity_digest(identity)
        path = os.path.join(self.location, digest[:2], f"{digest}.json")
        data = self._read(path)
        record = None if data is None else decode_record(data, identity, location=path)
        return view(record)

    def _apply_sync(self, identity: Identity, step: StepFunction[T]) -> T | _Busy:
        digest = identity_digest(identity)
        directory = os.path.join(self.location, digest[:2])
        target = os.path.join(directory, f"{digest}.json")
        self._ensure_dir(directory)
        try:
            lock_fd = os.open(
                os.path.join(directory, LOCK_NAME),
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
            )
        except OSError as error:
            raise _fail(f"cannot open the lock file in {directory}", error) from error
        try:
            try:
                if not try_lock_record(lock_fd, digest):
                    return _BUSY
            except OSError as error:
                raise _fail(f"cannot lock {target}", error) from error
            for _ in range(8):
                data = self._read(target)
                current = None if data is None else decode_record(data, identity, location=target)
                decision: Step[T] = step(current)
                if decision.delete:
                    if data is not None:
                        self._delete(directory, target)
                    return decision.answer
                if decision.write is None:
                    return decision.answer
                encoded = encode_record(decision.write)
                if len(encoded) > MAX_RECORD_BYTES:
                    raise StorageFailed(
                        f"the new record would exceed {MAX_RECORD_BYTES} bytes", errno=errno.EFBIG
                    )
                try:
                    if data is None:
                        self._create(directory, target, encoded)
                    else:
                        self._replace(directory, target, encoded, data)
                except _LostRace:
                    continue
                return decision.answer
            raise StorageFailed(f"{target} kept changing under the lock", errno=errno.EAGAIN)
        finally:
            os.close(lock_fd)  # also releases the lock

    def _ensure_dir(self, directory: str) -> None:
        """Make sure the fan-out directory exists and its entry in the root is durable.

        Done once per directory and store: also for a directory found existing, since a
        process may have died between creating it and syncing the root.
        """
        if directory in self._known_dirs:
            return
        created = False
        try:
            self.fs.mkdir(directory, 0o700)
            created = True
        except FileExistsError:
            try:
                info = os.lstat(directory)
            except OSError as error:
                raise _fail(f"cannot inspect {directory}", error) from error
            if not stat.S_ISDIR(info.st_mode):
                raise StorageFailed(
                    f"{directory} is not a directory (a symlink or file is in the way)",
                    errno=errno.ENOTDIR,
                ) from None
        except OSError as error:
            raise _fail(f"cannot create {directory}", error) from error
        try:
            self._sync_dir(str(self.root))
        except OSError as error:
            if created:  # never build on an entry that is not known durable: take it back
                self._quietly(self.fs.rmdir, directory)
            raise _fail(f"cannot sync {self.location} for {directory}", error) from error
        self._known_dirs.add(directory)

    def _read(self, path: str) -> bytes | None:
        """The record's bytes, None when absent; never follows a symlink, never blocks on a FIFO."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise RecordInvalid(
                    f"record at {path} is not a regular file ({error.strerror})", location=path
                ) from None
            raise _fail(f"cannot open {path}", error) from error
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise RecordInvalid(f"record at {path} is not a regular file", location=path)
            if info.st_size > MAX_RECORD_BYTES:
                raise RecordInvalid(
                    f"record at {path} has {info.st_size} bytes, more than {MAX_RECORD_BYTES}",
                    location=path,
                )
            chunks: list[bytes] = []
            size = 0
            while size <= MAX_RECORD_BYTES:
                chunk = os.read(fd, MAX_RECORD_BYTES + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            return b"".join(chunks)
        except OSError as error:
            raise _fail(f"cannot read {path}", error) from error
        finally:
            os.close(fd)

    def _temp_name(self, directory: str) -> str:
        pid = os.getpid()
        if self._temp_prefix is not None and self._temp_prefix[0] == pid:
            prefix = self._temp_prefix[1]
        else:
            token = _writer_token()
            prefix = f".{pid}-{token}-"
            if token:  # an unknown token is asked again next time, not kept for good
                self._temp_prefix = (pid, prefix)
        return os.path.join(directory, f"{prefix}{secrets.token_hex(16)}.tmp")

    def _write_temp(self, directory: str, data: bytes) -> str:
        """A new temp file holding all of ``data``, synced and closed; removed on any failure."""
        fs = self.fs
        temp = self._temp_name(directory)
        try:
            fd = fs.open(
                temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
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
            self._quietly(fs.unlink, temp)
            if isinstance(error, OSError):
                raise _fail(f"cannot write {temp}", error) from error
            raise
        try:
            fs.close(fd)
        except OSError as error:
            self._quietly(fs.unlink, temp)
            raise _fail(f"cannot close {temp}", error) from error
        return temp

    def _create(self, directory: str, target: str, data: bytes) -> None:
        """Create-if-absent: temp → fsync → link (fails if the record exists) → dir fsync."""
        fs = self.fs
        temp = self._write_temp(directory, data)
        try:
            fs.link(temp, target)
        except FileExistsError:
            self._quietly(fs.unlink, temp)
            raise _LostRace() from None
        except OSError as error:
            self._quietly(fs.unlink, temp)
            raise _fail(f"cannot create {target}", error) from error
        except BaseException:
            self._quietly(fs.unlink, temp)
            raise
        if not self._quietly(fs.unlink, temp):
            self._quietly(fs.unlink, temp)  # a second link to the record; a sweep takes it later
        try:
            self._sync_dir(directory)
        except OSError as error:
            # The record is linked but may not survive a power loss: nothing may be
            # acknowledged, so take it back rather than leave an unowned claim.
            if self._quietly(fs.unlink, target):
                try:
                    self._sync_dir(directory)
                    outcome = "the new record was removed again"
                except OSError:
                    outcome = "the new record was removed, but that removal is not known durable"
            else:
                outcome = f"the new record stays at {target} unowned: it needs review"
            raise _fail(
                f"cannot sync {directory} after creating a record; {outcome}", error
            ) from error

    def _replace(self, directory: str, target: str, data: bytes, previous: bytes) -> None:
        """Replace: temp → fsync → rename over the record → dir fsync."""
        fs = self.fs
        temp = self._write_temp(directory, data)
        try:
            fs.replace(temp, target)
        except OSError as error:
            self._quietly(fs.unlink, temp)
            raise _fail(f"cannot replace {target}", error) from error
        except BaseException:
            self._quietly(fs.unlink, temp)
            raise
        try:
            self._sync_dir(directory)
        except OSError as error:
            # The new version is in place but not known durable: put the previous one back.
            try:
                restore = self._write_temp(directory, previous)
                try:
                    fs.replace(restore, target)
                except OSError:
                    self._quietly(fs.unlink, restore)
                    raise
                self._sync_dir(directory)
                outcome = "the previous record was restored"
            except OSError:
                outcome = "the record may hold either version; inspect it"
            raise _fail(
                f"cannot sync {directory} after replacing {target}; {outcome}", error
            ) from error

    def _delete(self, directory: str, target: str) -> None:
        """Remove a record: unlink → dir fsync."""
        try:
            self.fs.unlink(target)
        except FileNotFoundError:
            return
        except OSError as error:
            raise _fail(f"cannot remove {target}", error) from error
        try:
            self._sync_dir(directory)
        except OSError as error:
            raise _fail(f"removed {target}, but cannot sync {directory}", error) from error

    def _sync_dir(self, directory: str) -> None:
        sync_dir(self.fs, directory)

    @staticmethod
    def _quietly(call: Callable[..., Any], *args: Any) -> bool:
        try:
            call(*args)
        except OSError:
            return False
        return True
