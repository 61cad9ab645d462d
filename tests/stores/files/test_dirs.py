"""Creating the journal directory: every missing component 0700, each one durable (SPEC §5).

A new directory entry survives a power loss only once its parent directory is synced;
before that, a root made on first open could vanish with every record acknowledged in it.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from itemjournal import FileStore, FileSystem, Journal, StorageFailed
from itemjournal._stores.dirs import make_dirs
from itemjournal._stores.files import store as filestore_module

pytestmark = pytest.mark.anyio


class Recording(FileSystem):
    """Logs each directory call as (call, path); can fail a parent sync or race a mkdir."""

    def __init__(
        self, *, fail_sync_of: str | None = None, race: dict[str, str] | None = None
    ) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail_sync_of = fail_sync_of
        self.race = race or {}  # path -> "dir" or "file": someone else makes it first
        self._paths: dict[int, str] = {}

    def mkdir(self, path: str, mode: int = 0o700, *, dir_fd: int | None = None) -> None:
        self.calls.append(("mkdir", path))
        made = self.race.pop(path, None)
        if made == "dir":
            os.mkdir(path, 0o700)
        elif made == "file":
            Path(path).write_text("in the way")
        super().mkdir(path, mode, dir_fd=dir_fd)

    def rmdir(self, path: str, *, dir_fd: int | None = None) -> None:
        self.calls.append(("rmdir", path))
        super().rmdir(path, dir_fd=dir_fd)

    def open_dir(
        self, path: str, *, dir_fd: int | None = None, follow_symlinks: bool = True
    ) -> int:
        fd = super().open_dir(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        self._paths[fd] = path
        self.calls.append(("open_dir", path))
        return fd

    def fsync_dir(self, fd: int) -> None:
        path = self._paths[fd]
        self.calls.append(("fsync_dir", path))
        if path == self.fail_sync_of:
            raise OSError(errno.EIO, "Input/output error")
        super().fsync_dir(fd)

    def close_dir(self, fd: int) -> None:
        self.calls.append(("close_dir", self._paths.pop(fd)))
        super().close_dir(fd)


def durable_mkdir(path: Path) -> list[tuple[str, str]]:
    parent = str(path.parent)
    return [
        ("mkdir", str(path)),
        ("open_dir", parent),
        ("fsync_dir", parent),
        ("close_dir", parent),
    ]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    """umask 0: a directory that is not 0700 would show it (0777 from mkdir's default)."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_every_missing_component_is_created_0700(tmp_path: Path, permissive_umask: None) -> None:
    deepest = tmp_path / "a" / "b" / "c"
    make_dirs(str(deepest), FileSystem())
    for path in (tmp_path / "a", tmp_path / "a" / "b", deepest):
        assert path.is_dir()
        assert mode(path) == 0o700, path


def test_each_mkdir_is_followed_by_a_sync_of_its_parent(tmp_path: Path) -> None:
    fs = Recording()
    a, b, c = tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"
    make_dirs(f"{c}/", fs)  # a trailing slash changes nothing
    assert fs.calls == durable_mkdir(a) + durable_mkdir(b) + durable_mkdir(c)


def test_only_missing_components_are_created(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir(mode=0o755)
    fs = Recording()
    make_dirs(str(tmp_path / "a" / "b"), fs)
    assert fs.calls == durable_mkdir(tmp_path / "a" / "b")
    assert mode(tmp_path / "a") == 0o755  # an existing directory is not changed


def test_an_existing_directory_is_left_alone(tmp_path: Path) -> None:
    fs = Recording()
    make_dirs(str(tmp_path), fs)
    assert fs.calls == []


def test_a_symlink_to_a_directory_is_followed(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    fs = Recording()
    make_dirs(str(tmp_path / "link" / "x"), fs)
    assert (tmp_path / "real" / "x").is_dir()
    assert fs.calls == durable_mkdir(tmp_path / "link" / "x")


def test_a_concurrent_creator_is_tolerated_and_the_parent_still_synced(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    fs = Recording(race={str(tmp_path / "a"): "dir"})
    make_dirs(str(target), fs)
    assert target.is_dir()
    assert fs.calls == durable_mkdir(tmp_path / "a") + durable_mkdir(target)


def test_a_concurrent_file_in_the_way_is_not_a_directory(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    fs = Recording(race={str(tmp_path / "a"): "file"})
    with pytest.raises(NotADirectoryError) as caught:
        make_dirs(str(target), fs)
    assert caught.value.errno == errno.ENOTDIR
    assert (tmp_path / "a").is_file()  # someone else's file: left as it is


@pytest.mark.parametrize("where", ["the path itself", "an ancestor"])
def test_a_file_in_the_way_is_an_os_error(tmp_path: Path, where: str) -> None:
    (tmp_path / "file").write_text("x")
    target = tmp_path / "file" if where == "the path itself" else tmp_path / "file" / "a" / "b"
    fs = Recording()
    with pytest.raises(OSError) as caught:
        make_dirs(str(target), fs)
    assert caught.value.errno == errno.ENOTDIR
    assert fs.calls == []
    assert (tmp_path / "file").read_text() == "x"


def test_a_failing_parent_sync_takes_the_new_directory_back(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "a" / "b"
    fs = Recording(fail_sync_of=str(a))  # the sync that makes b durable fails
    with pytest.raises(OSError) as caught:
        make_dirs(str(b / "c"), fs)
    assert caught.value.errno == errno.EIO
    assert fs.calls == [*durable_mkdir(a), *durable_mkdir(b), ("rmdir", str(b))]
    assert a.is_dir()  # made and synced: durable, kept
    assert not b.exists()  # not known durable: nothing may be built on it


def test_a_failing_sync_after_a_concurrent_mkdir_keeps_their_directory(tmp_path: Path) -> None:
    a = tmp_path / "a"
    fs = Recording(race={str(a): "dir"}, fail_sync_of=str(tmp_path))
    with pytest.raises(OSError):
        make_dirs(str(a), fs)
    assert ("rmdir", str(a)) not in fs.calls
    assert a.is_dir()


# ---------------------------------------------------------------------- through the store


async def test_journal_open_creates_a_nested_root_0700(
    anyio_backend: str, tmp_path: Path, permissive_umask: None
) -> None:
    root = tmp_path / "x" / "y" / "journal"
    journal = await Journal.open(str(root))
    await journal.begin(("s", "p", "j", "i"), {}, "a" * 64)
    for path in (tmp_path / "x", tmp_path / "x" / "y", root):
        assert mode(path) == 0o700, path
    for path in root.iterdir():
        assert mode(path) == (0o700 if path.is_dir() else 0o600), path


async def test_the_store_creates_its_root_durably(
    anyio_backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "x" / "journal"
    fs = Recording()
    store = FileStore(str(root), fs=FileSystem())
    monkeypatch.setattr(filestore_module, "FileSystem", lambda: fs)
    await store.open()
    parent_sync = durable_mkdir(root)[1:]  # every open syncs the root into its parent
    assert fs.calls == durable_mkdir(tmp_path / "x") + durable_mkdir(root) + parent_sync
    assert mode(tmp_path / "x") == mode(root) == 0o700
    fs.calls.clear()
    await store.open()  # an existing root: nothing made, its entry synced again
    assert fs.calls == parent_sync


@pytest.mark.parametrize("below", [False, True])
async def test_journal_open_with_a_file_in_the_way_is_storage_failed(
    anyio_backend: str, tmp_path: Path, below: bool
) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    location = target / "journal" if below else target
    with pytest.raises(StorageFailed) as caught:
        await Journal.open(str(location))
    assert caught.value.code == "STORAGE_FAILED"
    assert caught.value.errno == errno.ENOTDIR
    assert "cannot create the journal directory" in str(caught.value)
    assert isinstance(caught.value.__cause__, OSError)
    assert target.read_text() == "x"


async def test_journal_open_with_a_failing_parent_sync_is_storage_failed(
    anyio_backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_fsync_dir(self: FileSystem, fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(FileSystem, "fsync_dir", failing_fsync_dir)
    root = tmp_path / "new" / "journal"
    with pytest.raises(StorageFailed) as caught:
        await Journal.open(str(root))
    assert caught.value.errno == errno.EIO
    assert "cannot create the journal directory" in str(caught.value)
    assert isinstance(caught.value.__cause__, OSError)
    assert not (tmp_path / "new").exists()  # the first new component was taken back
    monkeypatch.undo()
    journal = await Journal.open(str(root))  # a later open, with a healthy disk, succeeds
    assert (await journal.inspect(("s", "p", "j", "i"))).status == "absent"
