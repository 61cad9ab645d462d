"""Platforms: Linux is supported; macOS syncs through the drive's cache; Windows is refused
at import and at ``open``, with an error that says why."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from itemjournal import FileSystem, Journal, JournalError, StorageFailed
from itemjournal._stores.fileio import full_fsync, plain_fsync, sync_for
from itemjournal._stores.registry import check_platform
from itemjournal._stores.sqlite.connection import sync_pragmas
from itemjournal._stores.sqlite.store import SQLiteStore


@pytest.mark.parametrize("platform", ["win32", "cygwin", "msys"])
def test_windows_is_refused_saying_why(platform: str) -> None:
    with pytest.raises(StorageFailed) as caught:
        check_platform(platform)
    error = caught.value
    assert isinstance(error, OSError)
    assert isinstance(error, JournalError)
    assert error.code == "STORAGE_FAILED"
    assert "does not run on Windows" in error.message
    assert repr(platform) in error.message
    for reason in ("POSIX file locks", "fsync of directories", "/proc"):
        assert reason in error.message


@pytest.mark.parametrize("platform", ["linux", "darwin", "freebsd14"])
def test_posix_platforms_pass(platform: str) -> None:
    check_platform(platform)


def test_this_platform_passes() -> None:
    check_platform()


@pytest.mark.anyio
async def test_open_checks_the_platform_first(tmp_path: Path) -> None:
    # On the platform under test the check lets every store through: the journal opens.
    assert sys.platform != "win32"
    async with await Journal.open(str(tmp_path / "journal")) as journal:
        assert journal.store.location == str(tmp_path / "journal")


def test_macos_syncs_through_the_drive_cache() -> None:
    assert sync_for("darwin") is full_fsync


@pytest.mark.parametrize("platform", ["linux", "freebsd14"])
def test_other_platforms_use_fsync(platform: str) -> None:
    assert sync_for(platform) is plain_fsync


def test_this_platform_picks_its_sync() -> None:
    expected = full_fsync if sys.platform == "darwin" else plain_fsync
    assert sync_for() is expected


@pytest.mark.parametrize("sync", [full_fsync, plain_fsync])
def test_each_sync_makes_a_file_and_a_directory_durable(
    tmp_path: Path, sync: Callable[[int], None]
) -> None:
    # Here (Linux) F_FULLFSYNC is an unknown request (EINVAL): full_fsync falls back to
    # fsync, as it does on a macOS file system that cannot honour it.
    path = tmp_path / "record"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"{}")
        sync(fd)
    finally:
        os.close(fd)
    directory = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        sync(directory)
    finally:
        os.close(directory)


@pytest.mark.parametrize("sync", [full_fsync, plain_fsync])
def test_a_failed_sync_is_raised(tmp_path: Path, sync: Callable[[int], None]) -> None:
    fd = os.open(tmp_path / "record", os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)
    with pytest.raises(OSError) as caught:
        sync(fd)  # a closed descriptor: EBADF, never taken for "not supported"
    assert caught.value.errno == errno.EBADF


def test_the_file_system_syncs_with_the_platform_call(tmp_path: Path) -> None:
    fs = FileSystem()
    fd = fs.open(str(tmp_path / "record"), os.O_WRONLY | os.O_CREAT)
    try:
        fs.fsync(fd)
    finally:
        fs.close(fd)
    directory = fs.open_dir(str(tmp_path))
    try:
        fs.fsync_dir(directory)
    finally:
        fs.close_dir(directory)
    with pytest.raises(OSError):
        fs.fsync(fd)
    with pytest.raises(OSError):
        fs.fsync_dir(directory)


_AS_ON_WINDOWS = """
import os, sys
sys.platform = "win32"
sys.modules["fcntl"] = None  # Windows has no fcntl module...
del os.register_at_fork  # ...and no fork
try:
    import itemjournal
except Exception as error:
    print(type(error).__name__, getattr(error, "code", None), error, sep="|")
else:
    print("imported")
"""


def test_importing_on_windows_says_why_before_anything_fails() -> None:
    """Native Windows lacks ``fcntl`` and fork, which the stores' modules use as they are
    imported: the refusal must come first, as the clear error, not an ImportError."""
    done = subprocess.run(
        [sys.executable, "-c", _AS_ON_WINDOWS], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    name, code, message = done.stdout.strip().split("|")
    assert (name, code) == ("StorageFailed", "STORAGE_FAILED")
    assert "does not run on Windows" in message


def test_sqlite_on_macos_commits_and_checkpoints_through_the_drive_cache() -> None:
    assert sync_pragmas("darwin") == ("PRAGMA fullfsync = ON", "PRAGMA checkpoint_fullfsync = ON")
    assert sync_pragmas("linux") == ()


def test_the_store_s_connections_set_the_platform_s_pragmas(tmp_path: Path) -> None:
    """Here (Linux) the pragmas stay off, as ``fsync`` reaches the disk; the macOS ones are
    pragmas this SQLite takes and reads back (a misspelt pragma is silently ignored)."""

    async def made() -> SQLiteStore:
        async with await Journal.open(f"sqlite://{tmp_path}/j.db") as journal:
            store = journal.store
        assert isinstance(store, SQLiteStore)
        return store

    connection = anyio.run(made)._connect(busy_timeout=1.0)
    try:
        assert connection.execute("PRAGMA fullfsync").fetchone()[0] == 0
        assert connection.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        for pragma in sync_pragmas("darwin"):
            connection.execute(pragma)
        assert connection.execute("PRAGMA fullfsync").fetchone()[0] == 1
        assert connection.execute("PRAGMA checkpoint_fullfsync").fetchone()[0] == 1
    finally:
        connection.close()
