"""The file store under faults: failed saves acknowledge nothing and leave nothing behind.

SPEC section 5: every save is temp file -> write all -> fsync -> link (new record) or
replace (transition) -> fsync the directory -> acknowledge. These tests break each step,
through the ``FileSystem`` seam (``tests/_faults.py``) and through the real OS (an
immutable flag, a file size limit), and check that a failed ``begin`` grants no claim and
leaves no record, a failed ``complete`` leaves the record ``started`` byte for byte, no
temp file survives, a failed fsync is never retried on the same file, stale temp files
are swept only when no live writer can own them, and anything but a regular file at a
record's path is ``RECORD_INVALID`` and left alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from _faults import FaultyFileSystem

from itemjournal import (
    Claim,
    FileStore,
    Identity,
    Journal,
    RecordInvalid,
    StorageFailed,
    definition_digest,
)

pytestmark = pytest.mark.anyio

IDENTITY = Identity("shop", "billing", "charge", "order-1")
INPUTS = {"amount": "10"}
DEFINITION = definition_digest("v1")

# Any name the store could use for a temp file (it names them ``.<pid>-<start>-<hex>.tmp``).
_ANY_TEMP = re.compile(r"\..*\.tmp")
# No Linux pid exceeds 2**22 (the largest pid_max), so this writer is surely gone.
DEAD_PID = 2**22 + 1
OLD = 3600.0  # seconds: far beyond the default temp_grace of 60 s


# ---------------------------------------------------------------------- helpers


async def open_faulty(root: Path, **options: Any) -> tuple[Journal, FileStore, FaultyFileSystem]:
    """A journal whose store does every save through a ``FaultyFileSystem``."""
    fs = FaultyFileSystem()
    store = FileStore(str(root), fs=fs, **options)
    await store.open()
    return Journal(store), store, fs


def temp_files(root: Path) -> list[Path]:
    """Every temp-looking file anywhere under ``root``."""
    found: list[Path] = []
    for directory, _, names in os.walk(root):
        found.extend(Path(directory, name) for name in names if _ANY_TEMP.fullmatch(name))
    return found


async def begun(journal: Journal) -> Claim:
    outcome = await journal.begin(IDENTITY, INPUTS, DEFINITION)
    assert isinstance(outcome, Claim)
    return outcome


def assert_storage_failed(error: BaseException, expected_errno: int) -> None:
    """A ``STORAGE_FAILED`` that is an ``OSError`` and chains the original OS error."""
    assert isinstance(error, StorageFailed)
    assert isinstance(error, OSError)
    assert error.code == "STORAGE_FAILED"
    assert error.errno == expected_errno
    cause = error.__cause__
    assert type(cause) is OSError
    assert cause.errno == expected_errno


# ---------------------------------------------------------------------- begin through the seam


@pytest.mark.parametrize(
    ("method", "error"),
    [
        ("fsync", errno.EIO),
        ("fsync", errno.ENOSPC),
        ("open", errno.ENOSPC),
        ("write", errno.ENOSPC),
        ("close", errno.EIO),
        ("link", errno.EIO),
    ],
)
async def test_begin_failing_before_the_link_grants_no_claim_and_leaves_nothing(
    anyio_backend: str, root: Path, method: str, error: int
) -> None:
    journal, store, fs = await open_faulty(root)
    fs.fail(method, error=error)

    with pytest.raises(StorageFailed) as caught:
        await journal.begin(IDENTITY, INPUTS, DEFINITION)

    assert_storage_failed(caught.value, error)
    assert "injected" in str(caught.value.__cause__)
    assert (await journal.inspect(IDENTITY)).status == "absent"
    assert not store.path_for(IDENTITY).exists()
    assert temp_files(root) == []


async def test_begin_directory_fsync_failure_after_the_link_takes_the_record_back(
    anyio_backend: str, root: Path
) -> None:
    journal, store, fs = await open_faulty(root)
    record = store.path_for(IDENTITY)
    fs.fail("fsync_dir", path=record.parent)

    with pytest.raises(StorageFailed) as caught:
        await journal.begin(IDENTITY, INPUTS, DEFINITION)

    assert_storage_failed(caught.value, errno.EIO)
    assert [call.path for call in fs.named("link")] == [str(record)]  # it had been linked
    assert (await journal.inspect(IDENTITY)).status == "absent"
    assert not record.exists()
    assert temp_files(root) == []


async def test_begin_after_a_failed_begin_claims_normally(anyio_backend: str, root: Path) -> None:
    journal, _, fs = await open_faulty(root)
    fs.fail("fsync")
    with pytest.raises(StorageFailed):
        await journal.begin(IDENTITY, INPUTS, DEFINITION)

    claim = await begun(journal)

    assert claim.attempt == 1
    assert (await journal.inspect(IDENTITY)).status == "started"
    assert temp_files(root) == []


# ---------------------------------------------------------------------- complete through the seam


@pytest.mark.parametrize(
    ("method", "error", "times"),
    [
        ("open", errno.ENOSPC, 1),
        ("write", errno.ENOSPC, 1),
        ("fsync", errno.EIO, 1),
        ("replace", errno.EIO, 1),
        ("fsync_dir", errno.EIO, 1),
        ("fsync_dir", errno.EIO, -1),  # the restore's own directory sync fails too
    ],
    ids=["open", "write", "fsync", "replace", "fsync_dir", "fsync_dir-always"],
)
async def test_complete_failure_leaves_the_record_started_and_byte_identical(
    anyio_backend: str, root: Path, method: str, error: int, times: int
) -> None:
    journal, store, fs = await open_faulty(root)
    claim = await begun(journal)
    record = store.path_for(IDENTITY)
    before = record.read_bytes()
    fs.fail(method, error=error, times=times)

    with pytest.raises(StorageFailed) as caught:
        await journal.complete(claim, "ch_1")

    assert_storage_failed(caught.value, error)
    assert (await journal.inspect(IDENTITY)).status == "started"
    assert record.read_bytes() == before
    assert temp_files(root) == []

    fs.heal()
    view = await journal.complete(claim, "ch_1")
    assert view.status == "succeeded"
    assert (await journal.inspect(IDENTITY)).receipt == "ch_1"
    assert temp_files(root) == []


# ---------------------------------------------------------------------- writes


async def test_short_writes_still_produce_a_valid_record(anyio_backend: str, root: Path) -> None:
    journal, store, fs = await open_faulty(root)
    fs.write_limit = 7

    claim = await begun(journal)
    await journal.complete(claim, "ch_1")

    view = await journal.inspect(IDENTITY)
    assert (view.status, view.receipt) == ("succeeded", "ch_1")
    size = store.path_for(IDENTITY).stat().st_size
    assert len(fs.named("write")) >= size // 7  # the store looped over partial writes
    assert temp_files(root) == []


async def test_write_that_never_makes_progress_fails_instead_of_spinning(
    anyio_backend: str, root: Path
) -> None:
    journal, store, fs = await open_faulty(root)
    fs.write_limit = 0
    fs.max_calls = 50  # the seam raises RunawayLoop rather than let the test hang

    with pytest.raises(StorageFailed) as caught:
        await journal.begin(IDENTITY, INPUTS, DEFINITION)

    assert caught.value.errno == errno.EIO
    assert len(fs.named("write")) == 1
    assert (await journal.inspect(IDENTITY)).status == "absent"
    assert not store.path_for(IDENTITY).exists()
    assert temp_files(root) == []


# ---------------------------------------------------------------------- fsync is never retried


@pytest.mark.parametrize(
    ("operation", "method", "times"),
    [
        ("begin", "fsync", 1),
        ("begin", "fsync", -1),
        ("begin", "fsync_dir", -1),
        ("complete", "fsync", -1),
        ("complete", "fsync_dir", 1),
        ("complete", "fsync_dir", -1),
    ],
)
async def test_a_failed_fsync_is_never_retried_on_the_same_file(
    anyio_backend: str, root: Path, operation: str, method: str, times: int
) -> None:
    journal, _, fs = await open_faulty(root)
    if operation == "complete":
        claim = await begun(journal)
        fs.fail(method, times=times)
        with pytest.raises(StorageFailed):
            await journal.complete(claim, "ch_1")
    else:
        fs.fail(method, times=times)
        with pytest.raises(StorageFailed):
            await journal.begin(IDENTITY, INPUTS, DEFINITION)

    failed = [call for call in fs.named(method) if call.failed]
    assert failed, "the fault never fired"
    assert all(call.handle is not None for call in failed)
    assert fs.fsyncs_after_failure() == []
    assert temp_files(root) == []


# ---------------------------------------------------------------------- fan-out directory


async def test_a_new_fanout_directory_is_made_durable_before_a_record_in_it_is_acknowledged(
    anyio_backend: str, root: Path
) -> None:
    journal, _, fs = await open_faulty(root)
    fs.fail("fsync_dir", path=root)
    with pytest.raises(StorageFailed):
        await journal.begin(IDENTITY, INPUTS, DEFINITION)
    failure = len(fs.calls)

    await begun(journal)

    later = fs.calls[failure:]
    assert any(c.method == "fsync_dir" and c.path == str(root) and not c.failed for c in later)


# ---------------------------------------------------------------------- real OS faults


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[None]:
    """``chattr +i`` on ``path`` for the block; skips where that is not possible."""
    if os.geteuid() != 0:
        pytest.skip("chattr +i needs root (CAP_LINUX_IMMUTABLE)")
    chattr = shutil.which("chattr")
    if chattr is None:
        pytest.skip("chattr is not installed (apt-get install e2fsprogs)")
    done = subprocess.run([chattr, "+i", str(path)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"the file system of {path} refuses chattr +i: {done.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", str(path)], capture_output=True, check=True)


async def test_complete_over_an_immutable_record_fails_and_keeps_it(
    anyio_backend: str, root: Path
) -> None:
    journal = await Journal.open(str(root))
    claim = await begun(journal)
    record = journal.store.path_for(IDENTITY)  # type: ignore[attr-defined]
    before = record.read_bytes()

    with immutable(record):
        with pytest.raises(StorageFailed) as caught:
            await journal.complete(claim, "ch_1")
        assert caught.value.errno == errno.EPERM
        assert isinstance(caught.value.__cause__, PermissionError)
        assert (await journal.inspect(IDENTITY)).status == "started"
        assert record.read_bytes() == before
        assert temp_files(root) == []

    assert (await journal.complete(claim, "ch_1")).status == "succeeded"


async def test_complete_in_an_immutable_fanout_directory_fails_and_keeps_the_record(
    anyio_backend: str, root: Path
) -> None:
    journal = await Journal.open(str(root))
    claim = await begun(journal)
    record = journal.store.path_for(IDENTITY)  # type: ignore[attr-defined]
    before = record.read_bytes()

    with immutable(record.parent):
        with pytest.raises(StorageFailed) as caught:
            await journal.complete(claim, "ch_1")
        assert caught.value.errno == errno.EPERM
        assert (await journal.inspect(IDENTITY)).status == "started"
        assert record.read_bytes() == before
        assert temp_files(root) == []

    assert (await journal.complete(claim, "ch_1")).status == "succeeded"


_CHILD = textwrap.dedent(
    """
    import resource, sys
    import anyio
    from itemjournal import Journal, StorageFailed, definition_digest

    async def main(root, limit):
        journal = await Journal.open(root)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        try:
            await journal.begin(
                ("shop", "billing", "charge", "order-1"), {"amount": "10"}, definition_digest("v1")
            )
        except StorageFailed as e:
            print(e.code, e.errno)
        else:
            print("GRANTED")

    anyio.run(main, sys.argv[1], int(sys.argv[2]))
    """
)


def run_child(root: Path, limit: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), str(limit)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


async def test_begin_over_the_file_size_limit_fails_in_a_child_and_leaves_nothing(
    anyio_backend: str, root: Path
) -> None:
    limit = 400  # a record is several hundred bytes of JSON: the temp file cannot hold it
    done = await anyio.to_thread.run_sync(run_child, root, limit)

    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["STORAGE_FAILED", str(errno.EFBIG)]
    journal = await Journal.open(str(root))
    assert (await journal.inspect(IDENTITY)).status == "absent"
    assert not journal.store.path_for(IDENTITY).exists()  # type: ignore[attr-defined]
    assert temp_files(root) == []


# ---------------------------------------------------------------------- stale temp files


def plant_temp(directory: Path, name: str, age: float) -> Path:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / name
    path.write_bytes(b'{"half": "written"')
    stamp = time.time() - age
    os.utime(path, (stamp, stamp))
    return path


def dead_writer_name() -> str:
    return f".{DEAD_PID}-20240101000000123-{'ab' * 16}.tmp"


async def test_open_sweeps_an_old_temp_of_a_dead_writer(anyio_backend: str, root: Path) -> None:
    fanout = FileStore(str(root)).path_for(IDENTITY).parent
    stale = plant_temp(fanout, dead_writer_name(), age=OLD)
    lock = plant_temp(fanout, ".lock", age=OLD)

    await Journal.open(str(root))

    assert not stale.exists()
    assert lock.exists()  # only names shaped like the store's own temp files are swept


async def test_open_keeps_an_old_temp_named_for_this_live_process(
    anyio_backend: str, root: Path
) -> None:
    store = FileStore(str(root))
    fanout = store.path_for(IDENTITY).parent
    name = await anyio.to_thread.run_sync(store._temp_name)
    live = plant_temp(fanout, os.path.basename(name), age=OLD)
    assert _ANY_TEMP.fullmatch(live.name)

    await Journal.open(str(root))

    assert live.exists()


async def test_open_keeps_a_young_temp_of_a_dead_writer(anyio_backend: str, root: Path) -> None:
    fanout = FileStore(str(root)).path_for(IDENTITY).parent
    young = plant_temp(fanout, dead_writer_name(), age=1.0)

    await Journal.open(str(root))

    assert young.exists()


# ---------------------------------------------------------------------- not a regular file


@contextlib.contextmanager
def fifo_watchdog(path: Path, seconds: float = 2.0) -> Iterator[threading.Event]:
    """If the block outlives ``seconds``, flag it and keep opening the FIFO's write end,
    which releases any reader stuck in open(), until the block ends (a failure, not a hang).
    """
    fired = threading.Event()
    done = threading.Event()

    def watch() -> None:
        if done.wait(seconds):
            return
        fired.set()
        while not done.wait(0.01):
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield fired
    finally:
        done.set()
        watcher.join()


def snapshot(path: Path) -> tuple[object, ...]:
    """What must not change about the thing at a record's path."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        target = Path(os.readlink(path))
        content = target.read_bytes() if target.exists() else None
        return ("link", str(target), content, info.st_ino)
    if stat.S_ISDIR(info.st_mode):
        return ("dir", sorted(os.listdir(path)), info.st_ino)
    return (stat.S_IFMT(info.st_mode), info.st_ino, info.st_size)


def symlink_to_a_valid_record(record: Path, outside: Path) -> None:
    record.symlink_to(outside)  # followed, it would read as a good ``started`` record


def dangling_symlink(record: Path, outside: Path) -> None:
    record.symlink_to(outside.with_name("missing.json"))  # begin must not create the target


def directory(record: Path, outside: Path) -> None:
    record.mkdir(mode=0o700)


def fifo(record: Path, outside: Path) -> None:
    os.mkfifo(record, 0o600)


@pytest.mark.parametrize(
    "make",
    [symlink_to_a_valid_record, dangling_symlink, directory, fifo],
    ids=lambda make: make.__name__,
)
async def test_something_other_than_a_regular_file_at_the_record_path_is_invalid_and_untouched(
    anyio_backend: str, root: Path, tmp_path: Path, make: Callable[[Path, Path], None]
) -> None:
    elsewhere = await Journal.open(str(tmp_path / "elsewhere"))
    await begun(elsewhere)
    outside = tmp_path / "outside.json"
    outside.write_bytes(elsewhere.store.path_for(IDENTITY).read_bytes())  # type: ignore[attr-defined]
    journal = await Journal.open(str(root))
    record: Path = journal.store.path_for(IDENTITY)  # type: ignore[attr-defined]
    record.parent.mkdir(mode=0o700)
    make(record, outside)
    before = snapshot(record)

    with fifo_watchdog(record) as hung:
        with pytest.raises(RecordInvalid) as inspected:
            await journal.inspect(IDENTITY)
        with pytest.raises(RecordInvalid) as begun_error:
            await journal.begin(IDENTITY, INPUTS, DEFINITION)
    assert not hung.is_set(), "a reader blocked on the FIFO"

    assert inspected.value.code == begun_error.value.code == "RECORD_INVALID"
    assert begun_error.value.location == str(record)
    assert snapshot(record) == before  # a dangling link still dangles, a FIFO is still one
    assert temp_files(root) == []
