"""Real OS faults, without the ``FileSystem`` seam: a file system that is full.

A 64 KiB tmpfs is mounted in a temp directory (needs root, or CAP_SYS_ADMIN) and filled
until the kernel answers ENOSPC. Then ``begin`` must fail with ``StorageFailed`` carrying
ENOSPC, grant no claim, leave no record and no temp file; ``complete`` must fail the same
way and leave the ``started`` record byte for byte. Once space is freed, both work.
(Immutable files and RLIMIT_FSIZE are covered in ``test_filestore_faults.py``.)
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio.to_thread
import pytest

from itemjournal import Claim, Identity, Journal, StorageFailed, definition_digest

pytestmark = pytest.mark.anyio

IDENTITY = Identity("shop", "billing", "charge", "order-1")
INPUTS = {"amount": "10"}
DEFINITION = definition_digest("v1")
_ANY_TEMP = re.compile(r"\..*\.tmp")


def skip(reason: str) -> None:
    print(f"\nskipped: {reason}")
    pytest.skip(reason)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A mounted 64 KiB tmpfs, unmounted at the end; skips where mounting is not allowed."""
    if os.geteuid() != 0:
        skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if mount is None or umount is None:
        skip("mount or umount is not installed")
    assert mount is not None and umount is not None
    point = tmp_path / "small"
    point.mkdir()
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        skip(f"mount -t tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield point
    finally:
        if subprocess.run([umount, str(point)], capture_output=True, check=False).returncode:
            subprocess.run([umount, "-l", str(point)], capture_output=True, check=True)


def fill(directory: Path) -> Path:
    """Write a file until the file system is full; the file (delete it to free space)."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for chunk in (b"x" * 4096, b"x"):
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as error:
                    assert error.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)
    return filler


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if _ANY_TEMP.fullmatch(p.name)]


def assert_enospc(error: StorageFailed) -> None:
    assert error.code == "STORAGE_FAILED"
    assert error.errno == errno.ENOSPC
    assert isinstance(error.__cause__, OSError)
    assert error.__cause__.errno == errno.ENOSPC


async def test_begin_on_a_full_file_system_fails_with_enospc_and_leaves_nothing(
    anyio_backend: str, small_disk: Path
) -> None:
    root = small_disk / "journal"
    journal = await Journal.open(str(root))
    filler = await anyio.to_thread.run_sync(fill, small_disk)

    with pytest.raises(StorageFailed) as caught:
        await journal.begin(IDENTITY, INPUTS, DEFINITION)

    assert_enospc(caught.value)
    record: Path = journal.store.path_for(IDENTITY)  # type: ignore[attr-defined]
    assert (await journal.inspect(IDENTITY)).status == "absent"
    assert not record.exists()
    assert temp_files(root) == []

    await anyio.to_thread.run_sync(filler.unlink)
    claim = await journal.begin(IDENTITY, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    assert (await journal.inspect(IDENTITY)).status == "started"
    assert temp_files(root) == []


async def test_complete_on_a_full_file_system_fails_with_enospc_and_keeps_the_record(
    anyio_backend: str, small_disk: Path
) -> None:
    root = small_disk / "journal"
    journal = await Journal.open(str(root))
    claim = await journal.begin(IDENTITY, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    record: Path = journal.store.path_for(IDENTITY)  # type: ignore[attr-defined]
    before = record.read_bytes()
    filler = await anyio.to_thread.run_sync(fill, small_disk)

    with pytest.raises(StorageFailed) as caught:
        await journal.complete(claim, "ch_1")

    assert_enospc(caught.value)
    assert (await journal.inspect(IDENTITY)).status == "started"
    assert record.read_bytes() == before
    assert temp_files(root) == []

    await anyio.to_thread.run_sync(filler.unlink)
    assert (await journal.complete(claim, "ch_1")).status == "succeeded"
    assert temp_files(root) == []
