"""Platforms: Linux is supported; macOS syncs through the drive's cache; Windows is refused
at ``open`` with an error that says why."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from itemjournal import FileSystem, Journal, JournalError, StorageFailed
from itemjournal._fileio import full_fsync, plain_fsync, sync_for
from itemjournal._locations import check_platform


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
