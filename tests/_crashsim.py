"""A crash simulator for the file store: record every call of a save, then rebuild what a
power loss at any point could have left on disk.

``RecordingFileSystem`` performs each call of the ``FileSystem`` seam for real (relative to
a directory descriptor when the store passes ``dir_fd``) and logs what it changed: which
inode a name was created for, the bytes written at which offset, which file or directory
was synced, what a link, rename or unlink did to which name.

``crash_states(pre, ops)`` answers: the last durable image was ``pre``, then ``ops`` ran
and the power went out. Which on-disk states can a reboot find? The model, deliberately
pessimistic (POSIX promises no more; ext4, xfs and btrfs often do better):

* File data written since the file's last fsync may be lost, kept, torn to a prefix, or
  zero-filled (the size grew but the blocks never landed). An fsync of the file makes its
  data so far durable.
* Each change to a directory entry (create, link, rename, unlink, mkdir, rmdir) that no
  later fsync of *that* directory covers may independently survive or vanish; nothing
  orders them (every subset is enumerated). A rename is one change: it happens whole or
  not at all. An fsync of a directory makes every earlier change of its entries durable.
* Entries inside a directory whose own entry was lost are lost with it.

A state is a plain value (directories; files with their bytes, hard links grouped), so
equal states from different crash points are checked once.
"""

from __future__ import annotations

import itertools
import os
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from itemjournal import FileSystem

__all__ = [
    "CrashState",
    "Image",
    "Op",
    "RecordingFileSystem",
    "crash_states",
    "materialize",
]

ROOT = "."
ENTRY_KINDS = frozenset({"create", "link", "rename", "unlink", "mkdir", "rmdir"})
MAX_PENDING = 12  # at most 2**12 subsets of unsynced directory changes per crash point


@dataclass(frozen=True)
class Op:
    """One successful call through the seam and its effect (paths relative to the root)."""

    index: int
    kind: str
    path: str | None = None  # the entry created/removed, the file written, the dir synced
    source: str | None = None  # link and rename: the old name
    inode: int | None = None
    offset: int = 0
    data: bytes = b""


@dataclass(frozen=True)
class CrashState:
    """What a reboot finds: directories, and files as (path, link group, bytes)."""

    dirs: tuple[str, ...]
    files: tuple[tuple[str, str, bytes], ...]

    def file(self, path: str) -> bytes | None:
        for name, _, data in self.files:
            if name == path:
                return data
        return None


@dataclass
class Image:
    """A durable on-disk state: directories, names mapped to inodes, inode contents."""

    dirs: set[str]
    names: dict[str, int]
    content: dict[int, bytes]

    @classmethod
    def scan(cls, root: str | os.PathLike[str]) -> Image:
        """The tree under ``root`` as it is now, taken as durable."""
        base = os.fspath(root)
        dirs = {ROOT}
        names: dict[str, int] = {}
        content: dict[int, bytes] = {}
        inodes: dict[int, int] = {}  # st_ino -> our inode number (keeps hard links together)
        for directory, subdirs, files in os.walk(base):
            rel_dir = os.path.relpath(directory, base)
            dirs.update(os.path.normpath(os.path.join(rel_dir, d)) for d in subdirs)
            for name in files:
                path = os.path.join(directory, name)
                info = os.lstat(path)
                if not stat.S_ISREG(info.st_mode):
                    raise ValueError(f"the simulator models regular files only: {path}")
                inode = inodes.setdefault(info.st_ino, len(inodes) + 1)
                names[os.path.normpath(os.path.join(rel_dir, name))] = inode
                if inode not in content:
                    content[inode] = Path(path).read_bytes()
        return cls(dirs, names, content)


def _parent(path: str) -> str:
    return os.path.dirname(path) or ROOT


class RecordingFileSystem(FileSystem):
    """Performs every call of the seam for real and logs its effect for ``crash_states``.

    ``start(image)`` begins a new log over the durable ``image`` of the same root (so
    the recorder knows which inode each existing name stands for); ``take()`` ends it.
    Failed calls change nothing and are not logged.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.normpath(os.fspath(root))
        self._lock = threading.Lock()
        self._log: list[Op] = []
        self._names: dict[str, int] = {}
        self._files: dict[int, int] = {}  # fd -> inode
        self._dirs: dict[int, str] = {}  # fd -> directory
        self._next_inode = 1

    # ------------------------------------------------------------------ the log

    def start(self, image: Image) -> None:
        with self._lock:
            self._log = []
            self._names = dict(image.names)
            self._next_inode = max(image.content, default=0) + 1

    def take(self) -> list[Op]:
        with self._lock:
            log, self._log = self._log, []
            return log

    def _rel(self, path: str, dir_fd: int | None = None) -> str:
        """``path`` relative to the root; a name inside ``dir_fd`` when that is given."""
        if dir_fd is not None:
            with self._lock:
                directory = self._dirs[dir_fd]
            return os.path.normpath(os.path.join(directory, path))
        rel = os.path.relpath(os.path.normpath(path), self.root)
        if rel.startswith(".."):
            raise ValueError(f"{path} is outside the recorded root {self.root}")
        return rel

    def _add(self, kind: str, **fields: object) -> None:
        self._log.append(Op(len(self._log), kind, **fields))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ files

    def open(self, path: str, flags: int, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
        if flags & os.O_TRUNC or (flags & os.O_CREAT and not flags & os.O_EXCL):
            raise NotImplementedError("the simulator models O_CREAT|O_EXCL and plain opens")
        rel = self._rel(path, dir_fd)
        fd = os.open(path, flags, mode, dir_fd=dir_fd)
        with self._lock:
            if flags & os.O_CREAT:
                inode = self._next_inode
                self._next_inode += 1
                self._names[rel] = inode
                self._add("create", path=rel, inode=inode)
            else:
                inode = self._names[rel]
                self._add("open", path=rel, inode=inode)
            self._files[fd] = inode
        return fd

    def write(self, fd: int, data: memoryview) -> int:
        offset = os.lseek(fd, 0, os.SEEK_CUR)
        written = os.write(fd, data)
        with self._lock:
            self._add("write", inode=self._files[fd], offset=offset, data=bytes(data[:written]))
        return written

    def fsync(self, fd: int) -> None:
        os.fsync(fd)
        with self._lock:
            self._add("fsync", inode=self._files[fd])

    def close(self, fd: int) -> None:
        with self._lock:
            inode = self._files.pop(fd)
        os.close(fd)
        with self._lock:
            self._add("close", inode=inode)

    # ------------------------------------------------------------------ names

    def link(self, source: str, destination: str, *, dir_fd: int | None = None) -> None:
        src, dst = self._rel(source, dir_fd), self._rel(destination, dir_fd)
        os.link(source, destination, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        with self._lock:
            inode = self._names[src]
            self._names[dst] = inode
            self._add("link", path=dst, source=src, inode=inode)

    def replace(self, source: str, destination: str, *, dir_fd: int | None = None) -> None:
        src, dst = self._rel(source, dir_fd), self._rel(destination, dir_fd)
        os.replace(source, destination, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        with self._lock:
            inode = self._names.pop(src)
            self._names[dst] = inode
            self._add("rename", path=dst, source=src, inode=inode)

    def unlink(self, path: str, *, dir_fd: int | None = None) -> None:
        rel = self._rel(path, dir_fd)
        os.unlink(path, dir_fd=dir_fd)
        with self._lock:
            self._add("unlink", path=rel, inode=self._names.pop(rel))

    def mkdir(self, path: str, mode: int = 0o700, *, dir_fd: int | None = None) -> None:
        rel = self._rel(path, dir_fd)
        os.mkdir(path, mode, dir_fd=dir_fd)
        with self._lock:
            self._add("mkdir", path=rel)

    def rmdir(self, path: str, *, dir_fd: int | None = None) -> None:
        rel = self._rel(path, dir_fd)
        os.rmdir(path, dir_fd=dir_fd)
        with self._lock:
            self._add("rmdir", path=rel)

    # ------------------------------------------------------------------ directories

    def open_dir(
        self, path: str, *, dir_fd: int | None = None, follow_symlinks: bool = True
    ) -> int:
        rel = self._rel(path, dir_fd)
        fd = super().open_dir(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        with self._lock:
            self._dirs[fd] = rel
            self._add("open_dir", path=rel)
        return fd

    def fsync_dir(self, fd: int) -> None:
        os.fsync(fd)
        with self._lock:
            self._add("fsync_dir", path=self._dirs[fd])

    def close_dir(self, fd: int) -> None:
        with self._lock:
            path = self._dirs.pop(fd)
        os.close(fd)
        with self._lock:
            self._add("close_dir", path=path)


# ---------------------------------------------------------------------- the crash model


def _entry_dir(op: Op) -> str:
    """The directory whose fsync makes ``op`` durable."""
    assert op.path is not None
    if op.kind == "rename":
        assert op.source is not None
        if _parent(op.source) != _parent(op.path):
            raise NotImplementedError("the simulator models renames within one directory")
    return _parent(op.path)


def _data_outcomes(durable: bytes, full: bytes) -> set[bytes]:
    """What a crash may leave of a file whose synced data is ``durable``, unsynced ``full``."""
    if durable == full:
        return {full}
    outcomes = {durable, full}
    if full.startswith(durable):
        pending = len(full) - len(durable)
        outcomes.add(full[: len(durable) + pending // 2])  # torn: a prefix landed
        outcomes.add(durable + bytes(pending))  # the size landed, the blocks did not
    return outcomes


def _apply(op: Op, dirs: set[str], names: dict[str, int]) -> None:
    assert op.path is not None
    if op.kind in ("create", "link"):
        assert op.inode is not None
        names[op.path] = op.inode
    elif op.kind == "rename":
        assert op.source is not None and op.inode is not None
        if names.get(op.source) == op.inode:
            del names[op.source]
        names[op.path] = op.inode
    elif op.kind == "unlink":
        if names.get(op.path) == op.inode:
            del names[op.path]
    elif op.kind == "mkdir":
        dirs.add(op.path)
    elif op.kind == "rmdir":
        dirs.discard(op.path)


def _reachable(path: str, dirs: set[str]) -> bool:
    parent = _parent(path)
    while parent != ROOT:
        if parent not in dirs:
            return False
        parent = _parent(parent)
    return True


def crash_states(pre: Image, ops: Sequence[Op]) -> set[CrashState]:
    """Every state a crash right after ``ops`` (all durable before them: ``pre``) may leave."""
    full = {inode: bytearray(data) for inode, data in pre.content.items()}
    durable = dict(pre.content)
    last_dir_sync: dict[str, int] = {}
    for op in ops:
        if op.kind == "create":
            assert op.inode is not None
            full[op.inode] = bytearray()
            durable[op.inode] = b""
        elif op.kind == "write":
            assert op.inode is not None
            buffer = full[op.inode]
            if len(buffer) < op.offset:
                buffer.extend(bytes(op.offset - len(buffer)))
            buffer[op.offset : op.offset + len(op.data)] = op.data
        elif op.kind == "fsync":
            assert op.inode is not None
            durable[op.inode] = bytes(full[op.inode])
        elif op.kind == "fsync_dir":
            assert op.path is not None
            last_dir_sync[op.path] = op.index
    changes = [op for op in ops if op.kind in ENTRY_KINDS]
    settled = [op for op in changes if last_dir_sync.get(_entry_dir(op), -1) > op.index]
    pending = [op for op in changes if last_dir_sync.get(_entry_dir(op), -1) < op.index]
    if len(pending) > MAX_PENDING:
        raise ValueError(f"{len(pending)} unsynced directory changes: too many to enumerate")

    states: set[CrashState] = set()
    for kept in itertools.product((False, True), repeat=len(pending)):
        chosen = settled + [op for op, keep in zip(pending, kept, strict=True) if keep]
        dirs = set(pre.dirs)
        names = dict(pre.names)
        for op in sorted(chosen, key=lambda op: op.index):
            _apply(op, dirs, names)
        dirs = {d for d in dirs if d == ROOT or _reachable(d, dirs)}
        names = {path: inode for path, inode in names.items() if _reachable(path, dirs)}
        inodes = sorted(set(names.values()))
        choices = [sorted(_data_outcomes(durable[i], bytes(full[i]))) for i in inodes]
        for contents in itertools.product(*choices):
            data = dict(zip(inodes, contents, strict=True))
            states.add(_state(dirs, names, data))
    return states


def _state(dirs: set[str], names: dict[str, int], data: dict[int, bytes]) -> CrashState:
    group: dict[int, str] = {}
    for path in sorted(names):
        group.setdefault(names[path], path)
    return CrashState(
        dirs=tuple(sorted(dirs)),
        files=tuple((path, group[names[path]], data[names[path]]) for path in sorted(names)),
    )


def materialize(state: CrashState, root: str | os.PathLike[str]) -> None:
    """Build ``state`` under the new directory ``root`` (no syncing: it is a test copy)."""
    base = os.fspath(root)
    os.mkdir(base, 0o700)
    for directory in sorted((d for d in state.dirs if d != ROOT), key=lambda d: d.count("/")):
        os.mkdir(os.path.join(base, directory), 0o700)
    for path, group, data in state.files:
        target = os.path.join(base, path)
        if group != path:
            os.link(os.path.join(base, group), target)
            continue
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
