"""The file store tells the truth about what it did, stays inside its root, and keeps going.

* A directory fsync that failed is never repeated, and what the disk holds afterwards is
  called unknown: the store still puts things back (a failed ``complete`` leaves the record
  ``started``, a failed first ``begin`` leaves none), but never calls that durable.
* The restore after a failed directory fsync needs no new descriptor (``EMFILE``).
* ``aclose`` waits for the calls under way, even when cancelled; later calls are refused.
* A scan reports what it cannot read (``RecordInvalid`` for a record, ``StorageFailed`` for a
  fan-out directory) and goes on; so does ``Journal.sweep``.
* A fan-out directory replaced by a symlink is never followed: nothing outside the root is
  read, written or removed, before or after the store first used that directory, and even
  when the swap happens in the middle of a save.
* The root and its fan-out directories must be this user's alone unless the store is
  opened with ``trust_shared_root=True``.
* ``setting`` records a value once, atomically across stores and processes, and refuses a
  settings document it cannot read strictly without touching it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from _faults import FaultyFileSystem

from itemjournal import (
    Claim,
    FileStore,
    FileSystem,
    Identity,
    Journal,
    RecordInvalid,
    StorageFailed,
    definition_digest,
)
from itemjournal._model.records import Record

pytestmark = pytest.mark.anyio

IDENTITY = Identity("shop", "billing", "charge", "order-1")
INPUTS = {"amount": "10"}
DEFINITION = definition_digest("v1")
DEAD_PID = 2**22 + 1  # above the largest Linux pid_max: no such process
OLD = 3600.0


# ---------------------------------------------------------------------- helpers


async def open_store(root: Path, fs: FileSystem | None = None, **options: Any) -> FileStore:
    store = FileStore(str(root), fs=fs, **options)
    await store.open()
    return store


async def begun(journal: Journal, identity: Identity = IDENTITY) -> Claim:
    outcome = await journal.begin(identity, INPUTS, DEFINITION)
    assert isinstance(outcome, Claim)
    return outcome


def fanout_of(identity: Identity) -> str:
    return FileStore("/nowhere").path_for(identity).parent.name


def identities(
    count: int, *, avoid: frozenset[str] | set[str] = frozenset(), prefix: str = "item"
) -> list[Identity]:
    """``count`` identities whose fan-outs are none of ``avoid``."""
    found: list[Identity] = []
    number = 0
    while len(found) < count:
        number += 1
        identity = Identity("hard", "store", "job", f"{prefix}-{number}")
        if fanout_of(identity) not in avoid:
            found.append(identity)
    return found


def neighbour_of(identity: Identity) -> Identity:
    """Another identity whose record lives in the same fan-out directory."""
    fanout = fanout_of(identity)
    for number in range(2, 100_000):
        other = identity._replace(item=f"order-{number}")
        if fanout_of(other) == fanout:
            return other
    raise AssertionError("no neighbour found")


def temp_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.tmp") if p.name.startswith("."))


def tree(path: Path) -> dict[str, tuple[int, bytes | None, float]]:
    """Everything under ``path`` (not following symlinks): mode, bytes, mtime."""
    found: dict[str, tuple[int, bytes | None, float]] = {}
    for directory, dirs, files in os.walk(path):
        for name in dirs + files:
            full = Path(directory, name)
            info = full.lstat()
            data = full.read_bytes() if stat.S_ISREG(info.st_mode) else None
            found[str(full.relative_to(path))] = (info.st_mode, data, info.st_mtime)
    return found


def orphan(path: Path) -> None:
    """Make the started record at ``path`` belong to a process that is gone."""
    document = json.loads(path.read_bytes())
    document["owner"]["pid"] = DEAD_PID
    path.write_text(json.dumps(document, ensure_ascii=False, sort_keys=True) + "\n")


def dead_temp_name() -> str:
    return f".{DEAD_PID}-20240101000000123-{'ab' * 16}.tmp"


def plant_old(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    stamp = time.time() - OLD
    os.utime(path, (stamp, stamp))


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


class Blocking(FaultyFileSystem):
    """Holds the first temp-file fsync until ``release`` is set; notes when the trip's
    last call (closing the fan-out directory) has returned."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.trip_done = threading.Event()

    def fsync(self, fd: int) -> None:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(10), "the test never released the fsync"
        super().fsync(fd)

    def close_dir(self, fd: int) -> None:
        super().close_dir(fd)
        if self.entered.is_set():
            self.trip_done.set()


# ---------------------------------------------------------------------- a failed directory fsync


def fanout_syncs_after(fs: FaultyFileSystem, directory: Path) -> list[bool]:
    """``failed`` of every directory fsync of ``directory`` from the first failed one on."""
    syncs = [call.failed for call in fs.named("fsync_dir") if call.path == str(directory)]
    first = syncs.index(True)
    return syncs[first:]


async def test_begin_whose_directory_fsync_fails_takes_the_record_back_and_calls_it_unknown(
    anyio_backend: str, root: Path
) -> None:
    fs = FaultyFileSystem()
    store = await open_store(root, fs)
    journal = Journal(store)
    record = store.path_for(IDENTITY)
    fs.fail("fsync_dir", path=record.parent)

    with pytest.raises(StorageFailed) as caught:
        await journal.begin(IDENTITY, INPUTS, DEFINITION)

    message = str(caught.value)
    assert "unknown" in message
    assert "removed again" not in message
    assert caught.value.errno == errno.EIO
    assert fanout_syncs_after(fs, record.parent) == [True]  # never synced again to "prove" it
    assert (await journal.inspect(IDENTITY)).status == "absent"  # still put back
    assert temp_files(root) == []


async def test_complete_whose_directory_fsync_fails_restores_started_and_calls_it_unknown(
    anyio_backend: str, root: Path
) -> None:
    fs = FaultyFileSystem()
    store = await open_store(root, fs)
    journal = Journal(store)
    claim = await begun(journal)
    record = store.path_for(IDENTITY)
    before = await anyio.to_thread.run_sync(record.read_bytes)
    fs.fail("fsync_dir", path=record.parent)

    with pytest.raises(StorageFailed) as caught:
        await journal.complete(claim, "ch_1")

    message = str(caught.value)
    assert "unknown" in message
    assert "restored" not in message
    assert "either version" in message
    assert fanout_syncs_after(fs, record.parent) == [True]
    assert await anyio.to_thread.run_sync(record.read_bytes) == before
    assert (await journal.inspect(IDENTITY)).status == "started"
    assert temp_files(root) == []
    assert (await journal.complete(claim, "ch_1")).status == "succeeded"  # a healthy retry


async def test_a_failed_directory_fsync_of_a_removal_is_called_unknown(
    anyio_backend: str, root: Path
) -> None:
    from itemjournal._stores.seam import Step

    fs = FaultyFileSystem()
    store = await open_store(root, fs)
    await begun(Journal(store))
    fs.fail("fsync_dir")
    with pytest.raises(StorageFailed) as caught:
        await store.apply(IDENTITY, lambda current: Step(None, None, delete=True))
    assert "unknown" in str(caught.value)


# ---------------------------------------------------------------------- EMFILE after the rename


class NoDescriptorsAfterTheRename(FaultyFileSystem):
    """Once the new record was renamed over the old one, every new descriptor fails with
    EMFILE (the process ran out of them) and the directory fsync fails with EIO."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.armed = False

    def replace(self, source: str, destination: str, *, dir_fd: int | None = None) -> None:
        super().replace(source, destination, dir_fd=dir_fd)
        if not self.armed:
            self.armed = True
            self.fail("open", error=errno.EMFILE, times=-1)
            self.fail("open_dir", error=errno.EMFILE, times=-1)
            self.fail("fsync_dir", error=errno.EIO)


async def test_complete_out_of_descriptors_after_the_rename_still_restores_started(
    anyio_backend: str, root: Path
) -> None:
    fs = NoDescriptorsAfterTheRename()
    store = await open_store(root, fs)
    journal = Journal(store)
    claim = await begun(journal)
    record = store.path_for(IDENTITY)
    before = await anyio.to_thread.run_sync(record.read_bytes)

    with pytest.raises(StorageFailed) as caught:
        await journal.complete(claim, "ch_1")

    fs.heal()
    assert (await journal.inspect(IDENTITY)).status == "started"  # put back, no descriptor used
    assert await anyio.to_thread.run_sync(record.read_bytes) == before
    assert "unknown" in str(caught.value)
    assert temp_files(root) == []


# ---------------------------------------------------------------------- aclose


async def test_aclose_waits_for_a_call_under_way_and_then_refuses_new_ones(
    anyio_backend: str, root: Path
) -> None:
    fs = Blocking()
    store = await open_store(root, fs)
    journal = Journal(store)
    outcomes: list[object] = []
    closed_after_trip: list[bool] = []

    async def run_begin() -> None:
        outcomes.append(await journal.begin(IDENTITY, INPUTS, DEFINITION))

    async def close() -> None:
        await store.aclose()
        closed_after_trip.append(fs.trip_done.is_set())

    async with anyio.create_task_group() as group:
        group.start_soon(run_begin)
        await anyio.to_thread.run_sync(fs.entered.wait)
        group.start_soon(close)
        try:
            await anyio.wait_all_tasks_blocked()
            assert closed_after_trip == [], "aclose returned while a call was under way"
        finally:
            fs.release.set()

    assert closed_after_trip == [True]
    assert isinstance(outcomes[0], Claim)  # the call under way finished normally
    with pytest.raises(StorageFailed) as caught:
        await journal.inspect(IDENTITY)
    assert "closed" in str(caught.value)
    with pytest.raises(StorageFailed):
        await journal.begin(IDENTITY, INPUTS, DEFINITION)
    await store.aclose()  # closing again is quiet


async def test_a_cancelled_aclose_still_waits_for_the_call_under_way(
    anyio_backend: str, root: Path
) -> None:
    fs = Blocking()
    store = await open_store(root, fs)
    journal = Journal(store)
    closed_after_trip: list[bool] = []

    async def close_cancelled() -> None:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await store.aclose()
        closed_after_trip.append(fs.trip_done.is_set())

    async with anyio.create_task_group() as group:
        group.start_soon(begun, journal)
        await anyio.to_thread.run_sync(fs.entered.wait)
        group.start_soon(close_cancelled)
        try:
            await anyio.wait_all_tasks_blocked()
            assert closed_after_trip == [], "a cancelled aclose returned before the call ended"
        finally:
            fs.release.set()

    assert closed_after_trip == [True]


async def test_a_scan_stops_at_its_next_batch_once_the_store_is_closed(
    anyio_backend: str, root: Path
) -> None:
    store = await open_store(root)
    journal = Journal(store)
    for identity in identities(3):
        await begun(journal, identity)
    scan = store.scan(batch=1)
    first = await scan.__anext__()
    assert isinstance(first, Record)
    await store.aclose()
    with pytest.raises(StorageFailed):
        await scan.__anext__()
    await scan.aclose()


# ---------------------------------------------------------------------- bad entries in a scan


def make_bad_entries(root: Path, outside: Path, taken: set[str], donor: bytes) -> dict[str, str]:
    """One of each kind of bad entry, in fan-outs not in ``taken``; what each should give."""
    spare = [f"{n:02x}" for n in range(256) if f"{n:02x}" not in taken]
    expected: dict[str, str] = {}
    # a fan-out that is a symlink to a directory outside, holding a valid record
    (outside / "records").mkdir()
    linked = spare.pop()
    (outside / "records" / f"{linked}{'0' * 62}.json").write_bytes(donor)
    (root / linked).symlink_to(outside / "records")
    expected[str(root / linked)] = "StorageFailed"
    # a file named like a fan-out
    plain = spare.pop()
    (root / plain).write_text("not a directory")
    expected[str(root / plain)] = "StorageFailed"
    # a fan-out that group and others can write to
    shared = spare.pop()
    (root / shared).mkdir()
    (root / shared / f"{shared}{'1' * 62}.json").write_bytes(donor)
    os.chmod(root / shared, 0o777)
    expected[str(root / shared)] = "StorageFailed"
    # record paths that are not regular files: a directory, a FIFO, a symlink
    odd = spare.pop()
    private_dir(root / odd)
    directory = root / odd / f"{odd}{'2' * 62}.json"
    directory.mkdir()
    fifo = root / odd / f"{odd}{'3' * 62}.json"
    os.mkfifo(fifo, 0o600)
    link = root / odd / f"{odd}{'4' * 62}.json"
    link.symlink_to(outside / "records" / f"{linked}{'0' * 62}.json")
    for path in (directory, fifo, link):
        expected[str(path)] = "RecordInvalid"
    return expected


def problem_paths(problems: Sequence[BaseException], expected: dict[str, str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for problem in problems:
        text = str(problem)
        matches = [path for path in expected if path in text]
        assert len(matches) >= 1, text
        path = max(matches, key=len)
        assert path not in found, f"reported twice: {path}"
        found[path] = type(problem).__name__
    return found


async def forty_orphans(root: Path) -> tuple[Journal, FileStore, list[Identity]]:
    store = await open_store(root)
    journal = Journal(store)
    crowd = identities(40, avoid=set())
    for identity in crowd:
        await begun(journal, identity)
        await anyio.to_thread.run_sync(orphan, store.path_for(identity))
    return journal, store, crowd


async def test_a_scan_yields_every_good_record_and_one_problem_per_bad_entry(
    anyio_backend: str, root: Path, tmp_path: Path
) -> None:
    _, store, crowd = await forty_orphans(root)
    outside = private_dir(tmp_path / "outside")
    taken = {fanout_of(identity) for identity in crowd}
    donor = await anyio.to_thread.run_sync(store.path_for(crowd[0]).read_bytes)
    expected = await anyio.to_thread.run_sync(make_bad_entries, root, outside, taken, donor)
    outside_before = await anyio.to_thread.run_sync(tree, outside)

    seen = [item async for item in store.scan(batch=7)]

    records = [item for item in seen if isinstance(item, Record)]
    problems = [item for item in seen if not isinstance(item, Record)]
    assert sorted(record.identity for record in records) == sorted(crowd)
    assert problem_paths(problems, expected) == expected
    for problem in problems:
        if isinstance(problem, StorageFailed):
            assert problem.code == "STORAGE_FAILED"
    assert await anyio.to_thread.run_sync(tree, outside) == outside_before
    started = [item async for item in store.scan(status="started")]
    assert len(started) == len(seen)  # problems come whatever status is asked for


async def test_sweep_marks_every_orphan_and_reports_each_bad_entry(
    anyio_backend: str, root: Path, tmp_path: Path
) -> None:
    journal, store, crowd = await forty_orphans(root)
    outside = private_dir(tmp_path / "outside")
    taken = {fanout_of(identity) for identity in crowd}
    # one more orphan, in a fan-out of its own whose lock file is a directory
    [locked] = identities(1, avoid=taken, prefix="locked")
    await begun(journal, locked)
    locked_record = store.path_for(locked)
    await anyio.to_thread.run_sync(orphan, locked_record)
    lock = locked_record.parent / ".lock"
    await anyio.to_thread.run_sync(lock.unlink)
    await anyio.to_thread.run_sync(lock.mkdir)
    donor = await anyio.to_thread.run_sync(store.path_for(crowd[0]).read_bytes)
    expected = await anyio.to_thread.run_sync(
        make_bad_entries, root, outside, taken | {locked_record.parent.name}, donor
    )
    expected[str(locked_record.parent)] = "StorageFailed"  # its lock cannot be taken

    report = await journal.sweep()

    assert sorted(view.identity for view in report.marked) == sorted(crowd)
    assert problem_paths(report.problems, expected) == expected
    for identity in crowd:
        assert (await journal.inspect(identity)).status == "needs_review"


@pytest.fixture
def unreadable_record(root: Path) -> Iterator[Path]:
    """A record path on which open() fails with ESRCH: a bind mount of a process's
    ``/proc/<pid>/mem`` whose process is gone. Needs root (mount); skips elsewhere."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a bind mount needs root and mount(8)")
    record = FileStore(str(root)).path_for(Identity("hard", "store", "job", "unreadable"))
    private_dir(record.parent)
    record.write_bytes(b"")
    gone = subprocess.Popen(["sleep", "60"])
    try:
        done = subprocess.run(
            ["mount", "--bind", f"/proc/{gone.pid}/mem", str(record)],
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        gone.kill()
        gone.wait()
    if done.returncode != 0:
        pytest.skip(f"mount --bind is not permitted here: {done.stderr.strip()}")
    try:
        with pytest.raises(OSError) as caught:
            os.close(os.open(record, os.O_RDONLY))
        if caught.value.errno in (errno.EACCES, errno.EPERM):
            pytest.skip("this kernel refuses the bind-mounted file with EACCES")
        yield record
    finally:
        subprocess.run(["umount", str(record)], capture_output=True, check=False)


async def test_a_record_that_cannot_be_read_is_reported_and_the_scan_goes_on(
    anyio_backend: str, root: Path, unreadable_record: Path
) -> None:
    store = await open_store(root)
    journal = Journal(store)
    crowd = identities(5)
    for identity in crowd:
        await begun(journal, identity)

    seen = [item async for item in store.scan()]

    assert sorted(item.identity for item in seen if isinstance(item, Record)) == sorted(crowd)
    [problem] = [item for item in seen if not isinstance(item, Record)]
    assert isinstance(problem, RecordInvalid)
    assert problem.location == str(unreadable_record)
    assert "cannot be read" in str(problem)
    with pytest.raises(StorageFailed):  # a plain read of it is a storage failure
        await journal.inspect(Identity("hard", "store", "job", "unreadable"))


# ---------------------------------------------------------------------- symlinked fan-outs


def outside_with_bait(outside: Path, donor: bytes, record_name: str) -> None:
    """A directory outside the root that following a link would read, write or sweep."""
    private_dir(outside)
    (outside / record_name).write_bytes(donor)
    (outside / ".lock").write_bytes(b"")
    plant_old(outside / dead_temp_name(), b"someone else's file")


async def donor_record(tmp_path: Path, identity: Identity) -> bytes:
    elsewhere = await open_store(tmp_path / "elsewhere")
    await begun(Journal(elsewhere), identity)
    return await anyio.to_thread.run_sync(elsewhere.path_for(identity).read_bytes)


async def assert_refused_and_outside_untouched(
    store: FileStore, identity: Identity, outside: Path, before: dict[str, Any]
) -> None:
    journal = Journal(store)
    for call in (
        lambda: journal.inspect(identity),
        lambda: journal.begin(identity, INPUTS, DEFINITION),
    ):
        with pytest.raises(StorageFailed) as caught:
            await call()
        assert "symlink" in str(caught.value)
        assert str(store.path_for(identity).parent) in str(caught.value)
    seen = [item async for item in store.scan()]
    assert [type(item) for item in seen if not isinstance(item, Record)] == [StorageFailed]
    assert all(item.identity != identity for item in seen if isinstance(item, Record))
    await store.open()  # the temp sweep at open does not follow it either
    assert await anyio.to_thread.run_sync(tree, outside) == before


async def test_a_fanout_that_is_a_symlink_before_first_use_is_never_followed(
    anyio_backend: str, root: Path, tmp_path: Path
) -> None:
    donor = await donor_record(tmp_path, IDENTITY)
    outside = tmp_path / "outside"
    record = FileStore(str(root)).path_for(IDENTITY)
    await anyio.to_thread.run_sync(outside_with_bait, outside, donor, record.name)
    await anyio.to_thread.run_sync(private_dir, root)
    await anyio.to_thread.run_sync(record.parent.symlink_to, outside)
    before = await anyio.to_thread.run_sync(tree, outside)

    store = await open_store(root)  # opens: the link is never followed, so it is harmless

    assert await anyio.to_thread.run_sync(tree, outside) == before  # the bait temp is kept
    await assert_refused_and_outside_untouched(store, IDENTITY, outside, before)


async def test_a_fanout_swapped_for_a_symlink_after_first_use_is_never_followed(
    anyio_backend: str, root: Path, tmp_path: Path
) -> None:
    store = await open_store(root)
    journal = Journal(store)
    claim = await begun(journal)
    await journal.complete(claim, "ch_1")  # the store has used (and synced) this fan-out
    other = neighbour_of(IDENTITY)
    donor = await donor_record(tmp_path, other)
    record = store.path_for(other)
    outside = tmp_path / "outside"
    await anyio.to_thread.run_sync(outside_with_bait, outside, donor, record.name)
    await anyio.to_thread.run_sync(record.parent.rename, root / "moved-aside")
    await anyio.to_thread.run_sync(record.parent.symlink_to, outside)
    before = await anyio.to_thread.run_sync(tree, outside)

    await assert_refused_and_outside_untouched(store, other, outside, before)
    with pytest.raises(StorageFailed):
        await journal.inspect(IDENTITY)  # never read through the link either


class SwapAtLink(FaultyFileSystem):
    """Just before the record is linked, the fan-out is moved aside and a symlink to
    ``outside`` put in its place."""

    def __init__(self, fanout: Path, outside: Path) -> None:
        super().__init__()
        self.fanout = fanout
        self.outside = outside
        self.swapped = False

    def link(self, source: str, destination: str, *, dir_fd: int | None = None) -> None:
        if destination.endswith(".json") and not self.swapped:
            self.swapped = True
            os.rename(self.fanout, self.fanout.with_name("moved-aside"))
            os.symlink(self.outside, self.fanout)
        super().link(source, destination, dir_fd=dir_fd)


async def test_a_fanout_swapped_in_the_middle_of_a_save_cannot_redirect_it(
    anyio_backend: str, root: Path, tmp_path: Path
) -> None:
    record = FileStore(str(root)).path_for(IDENTITY)
    outside = tmp_path / "outside"
    await anyio.to_thread.run_sync(outside_with_bait, outside, b"{}", "unrelated.json")
    before = await anyio.to_thread.run_sync(tree, outside)
    fs = SwapAtLink(record.parent, outside)
    store = await open_store(root, fs)

    await begun(Journal(store))  # written through the directory it opened

    assert fs.swapped
    assert await anyio.to_thread.run_sync(tree, outside) == before
    moved = root / "moved-aside" / record.name
    assert json.loads(await anyio.to_thread.run_sync(moved.read_bytes))["status"] == "started"


# ---------------------------------------------------------------------- whose root it is


def shared_root(root: Path, mode: int, owner: int | None = None) -> None:
    root.mkdir(mode=0o700)
    os.chmod(root, mode)
    if owner is not None:
        os.chown(root, owner, -1)


@pytest.mark.parametrize(
    ("mode", "owner", "fix"),
    [
        (0o777, None, "chmod go-w"),
        (0o775, None, "chmod go-w"),
        (0o757, None, "chmod go-w"),
        (0o700, 1, "chown"),
    ],
    ids=["world-writable", "group-writable", "others-writable", "another-owner"],
)
async def test_open_refuses_a_root_that_is_not_this_users_alone(
    anyio_backend: str, root: Path, mode: int, owner: int | None, fix: str
) -> None:
    if owner is not None and os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    await anyio.to_thread.run_sync(shared_root, root, mode, owner)

    for opening in (lambda: open_store(root), lambda: Journal.open(str(root))):
        with pytest.raises(StorageFailed) as caught:
            await opening()
        assert caught.value.errno == errno.EPERM
        assert str(root) in str(caught.value)
        assert fix in str(caught.value)
        assert "trust_shared_root=True" in str(caught.value)
    assert await anyio.to_thread.run_sync(os.listdir, root) == []  # nothing written there

    store = await open_store(root, trust_shared_root=True)
    journal = Journal(store)
    claim = await begun(journal)
    assert (await journal.complete(claim, "ch_1")).status == "succeeded"
    trusting = await Journal.open(str(root), trust_shared_root=True)
    assert (await trusting.inspect(IDENTITY)).status == "succeeded"


async def test_a_fanout_shared_with_others_is_refused_at_open_and_when_used(
    anyio_backend: str, root: Path
) -> None:
    store = await open_store(root)
    journal = Journal(store)
    await begun(journal)
    fanout = store.path_for(IDENTITY).parent
    await anyio.to_thread.run_sync(os.chmod, fanout, 0o777)

    with pytest.raises(StorageFailed) as caught:
        await journal.inspect(IDENTITY)
    assert str(fanout) in str(caught.value) and "chmod go-w" in str(caught.value)
    with pytest.raises(StorageFailed):
        await journal.begin(IDENTITY, INPUTS, DEFINITION)
    with pytest.raises(StorageFailed):
        await journal.mark_review(IDENTITY)
    with pytest.raises(StorageFailed) as caught:
        await open_store(root)
    assert str(fanout) in str(caught.value)

    trusting = Journal(await open_store(root, trust_shared_root=True))
    assert (await trusting.inspect(IDENTITY)).status == "started"
    assert (await trusting.mark_review(IDENTITY)).status == "needs_review"


async def test_a_fanout_given_to_another_user_is_refused(anyio_backend: str, root: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    store = await open_store(root)
    journal = Journal(store)
    await begun(journal)
    fanout = store.path_for(IDENTITY).parent
    await anyio.to_thread.run_sync(os.chown, fanout, 1, -1)
    with pytest.raises(StorageFailed) as caught:
        await journal.inspect(IDENTITY)
    assert "chown" in str(caught.value)


# ---------------------------------------------------------------------- settings


async def test_the_first_value_of_a_setting_wins_and_every_store_sees_it(
    anyio_backend: str, root: Path
) -> None:
    first = await open_store(root)
    second = await open_store(root)

    assert await first.setting("input_kind", "sha256") == "sha256"
    assert await second.setting("input_kind", "hmac-sha256:abc") == "sha256"
    assert await second.setting("other", "x") == "x"  # another name is added beside it
    assert await first.setting("other", "y") == "x"
    assert await first.setting("input_kind", "anything") == "sha256"

    document = root / "itemjournal.json"
    info = await anyio.to_thread.run_sync(document.stat)
    assert stat.S_IMODE(info.st_mode) == 0o600
    content = json.loads(await anyio.to_thread.run_sync(document.read_bytes))
    assert content == {
        "application": "itemjournal",
        "version": 1,
        "settings": {"input_kind": "sha256", "other": "x"},
    }
    assert temp_files(root) == []
    assert [item async for item in first.scan()] == []  # neither it nor .lock is a record


async def test_concurrent_first_settings_agree(anyio_backend: str, root: Path) -> None:
    stores = [await open_store(root) for _ in range(6)]
    answers: list[str] = []

    async def ask(store: FileStore, value: str) -> None:
        answers.append(await store.setting("input_kind", value))

    async with anyio.create_task_group() as group:
        for number, store in enumerate(stores):
            group.start_soon(ask, store, f"kind-{number}")

    assert len(set(answers)) == 1
    assert answers[0] in {f"kind-{n}" for n in range(6)}


_SETTING_CHILD = textwrap.dedent(
    """
    import sys, time
    import anyio
    from itemjournal import FileStore

    async def main(root, value, start):
        store = FileStore(root)
        await store.open()
        while time.time() < start:
            await anyio.sleep(0.001)
        print(await store.setting("input_kind", value))

    anyio.run(main, sys.argv[1], sys.argv[2], float(sys.argv[3]))
    """
)


async def test_first_settings_from_several_processes_agree(anyio_backend: str, root: Path) -> None:
    await open_store(root)
    start = time.time() + 0.5

    def run_all() -> list[str]:
        children = [
            subprocess.Popen(
                [sys.executable, "-c", _SETTING_CHILD, str(root), f"kind-{n}", str(start)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for n in range(4)
        ]
        answers = []
        for child in children:
            out, err = child.communicate(timeout=60)
            assert child.returncode == 0, err
            answers.append(out.strip())
        return answers

    answers = await anyio.to_thread.run_sync(run_all)
    assert len(set(answers)) == 1, answers
    store = await open_store(root)
    assert await store.setting("input_kind", "late") == answers[0]


def corrupt(kind: str, document: Path, outside: Path) -> None:
    if kind == "bad-json":
        document.write_text('{"application": "itemjournal", ')
    elif kind == "wrong-shape":
        document.write_text(json.dumps({"application": "itemjournal", "settings": []}))
    elif kind == "other-application":
        document.write_text(json.dumps({"application": "x", "version": 1, "settings": {}}))
    elif kind == "duplicate-key":
        document.write_text(
            '{"application": "itemjournal", "version": 1, "settings": {}, "version": 1}'
        )
    elif kind == "not-utf8":
        document.write_bytes(b'{"application": "\xff"}')
    elif kind == "too-big":
        document.write_bytes(b" " * (64 * 1024 + 1))
    elif kind == "directory":
        document.mkdir()
    elif kind == "fifo":
        os.mkfifo(document, 0o600)
    elif kind == "symlink":
        outside.write_text(
            json.dumps({"application": "itemjournal", "version": 1, "settings": {"k": "v"}})
        )
        document.symlink_to(outside)


def snapshot(path: Path) -> tuple[object, ...]:
    info = path.lstat()
    data = path.read_bytes() if stat.S_ISREG(info.st_mode) else None
    return (info.st_mode, info.st_ino, data)


@pytest.mark.parametrize(
    "kind",
    [
        "bad-json",
        "wrong-shape",
        "other-application",
        "duplicate-key",
        "not-utf8",
        "too-big",
        "directory",
        "fifo",
        "symlink",
    ],
)
async def test_a_settings_document_that_does_not_read_strictly_is_invalid_and_untouched(
    anyio_backend: str, root: Path, tmp_path: Path, kind: str
) -> None:
    store = await open_store(root)
    document = root / "itemjournal.json"
    await anyio.to_thread.run_sync(corrupt, kind, document, tmp_path / "outside.json")
    before = await anyio.to_thread.run_sync(snapshot, document)

    with pytest.raises(RecordInvalid) as caught:
        await store.setting("k", "mine")

    assert caught.value.code == "RECORD_INVALID"
    assert caught.value.location == str(document)
    assert str(document) in str(caught.value)
    assert await anyio.to_thread.run_sync(snapshot, document) == before
    assert temp_files(root) == []
    with pytest.raises(RecordInvalid):
        await open_store(root)  # not a location this store can vouch for
    with pytest.raises(RecordInvalid):
        await Journal.open(str(root))
    assert await anyio.to_thread.run_sync(snapshot, document) == before


async def test_a_setting_is_synced_before_it_is_answered(anyio_backend: str, root: Path) -> None:
    fs = FaultyFileSystem()
    store = await open_store(root, fs)
    await store.setting("k", "v")
    order = [(call.method, call.path) for call in fs.calls if not call.failed]
    document = str(root / "itemjournal.json")
    link = order.index(("link", document))
    assert any(method == "fsync" for method, _ in order[:link])
    assert ("fsync_dir", str(root)) in order[link:]

    fs.fail("fsync_dir", path=root)  # adding a second name: a replace whose sync fails
    with pytest.raises(StorageFailed) as caught:
        await store.setting("k2", "v2")
    assert "unknown" in str(caught.value)
    assert "restored" not in str(caught.value)
    content = json.loads(await anyio.to_thread.run_sync((root / "itemjournal.json").read_bytes))
    assert content["settings"] == {"k": "v"}  # the previous document was put back
    assert temp_files(root) == []


async def test_a_first_setting_whose_sync_fails_leaves_no_document(
    anyio_backend: str, root: Path
) -> None:
    fs = FaultyFileSystem()
    store = await open_store(root, fs)
    fs.fail("fsync_dir", path=root)
    with pytest.raises(StorageFailed) as caught:
        await store.setting("k", "v")
    assert "unknown" in str(caught.value)
    assert not (root / "itemjournal.json").exists()
    assert await store.setting("k", "w") == "w"


async def test_a_setting_waits_for_the_lock_at_most_lock_timeout(
    anyio_backend: str, root: Path
) -> None:
    store = await open_store(root, lock_timeout=0.2)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        started = anyio.current_time()
        with pytest.raises(StorageFailed) as caught:
            await store.setting("k", "v")
        assert caught.value.errno == errno.ETIMEDOUT
        assert anyio.current_time() - started < 2
    finally:
        os.close(fd)
    assert await store.setting("k", "v") == "v"


async def test_a_setting_needs_a_name_and_a_text_value(anyio_backend: str, root: Path) -> None:
    store = await open_store(root)
    for name, value in (("", "v"), ("k", 1), (None, "v")):
        with pytest.raises(ValueError):
            await store.setting(name, value)  # type: ignore[arg-type]


async def test_open_sweeps_a_dead_writers_settings_temp_in_the_root(
    anyio_backend: str, root: Path
) -> None:
    await open_store(root)
    stale = root / dead_temp_name()
    await anyio.to_thread.run_sync(plant_old, stale, b"half")
    await open_store(root)
    assert not stale.exists()


# ---------------------------------------------------------------------- more failure paths


async def test_complete_whose_backup_link_fails_changes_nothing(
    anyio_backend: str, root: Path
) -> None:
    fs = FaultyFileSystem()
    store = await open_store(root, fs)
    journal = Journal(store)
    claim = await begun(journal)
    record = store.path_for(IDENTITY)
    before = await anyio.to_thread.run_sync(record.read_bytes)
    fs.fail("link", error=errno.EMLINK)

    with pytest.raises(StorageFailed) as caught:
        await journal.complete(claim, "ch_1")

    assert caught.value.errno == errno.EMLINK
    assert "previous version" in str(caught.value)
    assert not fs.named("replace")  # nothing was renamed over the record
    assert await anyio.to_thread.run_sync(record.read_bytes) == before
    assert temp_files(root) == []
    assert (await journal.complete(claim, "ch_1")).status == "succeeded"
    assert temp_files(root) == []  # the backup of a successful replace is gone too


class InterruptedDirectorySync(FaultyFileSystem):
    """The directory fsync after the rename is interrupted (a signal handler raising)."""

    def fsync_dir(self, fd: int) -> None:
        if self.named("replace"):
            raise KeyboardInterrupt
        super().fsync_dir(fd)


async def test_an_interrupted_directory_sync_leaves_no_backup_behind(
    anyio_backend: str, root: Path
) -> None:
    fs = InterruptedDirectorySync()
    store = await open_store(root, fs)
    journal = Journal(store)
    claim = await begun(journal)
    with pytest.raises(KeyboardInterrupt):
        await journal.complete(claim, "ch_1")
    assert temp_files(root) == []


async def test_a_fanout_that_cannot_be_created_is_storage_failed(
    anyio_backend: str, root: Path
) -> None:
    fs = FaultyFileSystem()
    store = await open_store(root, fs)
    fs.fail("mkdir", error=errno.ENOSPC)
    with pytest.raises(StorageFailed) as caught:
        await Journal(store).begin(IDENTITY, INPUTS, DEFINITION)
    assert caught.value.errno == errno.ENOSPC
    assert await anyio.to_thread.run_sync(os.listdir, root) == []


async def test_a_fanout_swapped_for_a_symlink_during_a_scan_is_reported(
    anyio_backend: str, root: Path, tmp_path: Path
) -> None:
    store = await open_store(root)
    journal = Journal(store)
    crowd = identities(4)
    for identity in crowd:
        await begun(journal, identity)
    fanouts = sorted({fanout_of(identity) for identity in crowd})
    last = root / fanouts[-1]
    outside = private_dir(tmp_path / "outside")

    def swap() -> None:
        last.rename(root / "moved-aside")
        last.symlink_to(outside)

    scan = store.scan(batch=1)
    seen: list[object] = [await scan.__anext__()]  # listed everything, read one record
    await anyio.to_thread.run_sync(swap)
    seen += [item async for item in scan]

    problems = [item for item in seen if not isinstance(item, Record)]
    assert len(problems) == 1
    assert isinstance(problems[0], StorageFailed)
    assert str(last) in str(problems[0])


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_natively_cancelled_aclose_waits_then_stays_cancelled(
    anyio_backend: str, root: Path
) -> None:
    import asyncio

    fs = Blocking()
    store = await open_store(root, fs)
    journal = Journal(store)
    begin = asyncio.ensure_future(begun(journal))
    await anyio.to_thread.run_sync(fs.entered.wait)
    closing = asyncio.ensure_future(store.aclose())
    try:
        await anyio.wait_all_tasks_blocked()
        closing.cancel()
        await anyio.wait_all_tasks_blocked()
        assert not closing.done(), "a cancelled aclose returned before the call ended"
    finally:
        fs.release.set()
    await begin
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert fs.trip_done.is_set()


async def test_a_setting_whose_sync_fails_on_reading_is_storage_failed(
    anyio_backend: str, root: Path
) -> None:
    fs = FaultyFileSystem()
    store = await open_store(root, fs)
    await store.setting("k", "v")
    fs.fail("fsync_dir", path=root)
    with pytest.raises(StorageFailed) as caught:
        await store.setting("k", "other")
    assert caught.value.errno == errno.EIO
    assert await store.setting("k", "other") == "v"
