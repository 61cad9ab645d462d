"""The file store's own edges: layout surprises, races, interrupted saves, scans."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from itemjournal import (
    Claim,
    ConflictError,
    FileStore,
    FileSystem,
    Identity,
    Journal,
    RecordInvalid,
    StorageFailed,
    definition_digest,
)
from itemjournal._model.records import Record
from itemjournal._stores import workers
from itemjournal._stores.seam import Step

pytestmark = pytest.mark.anyio

ITEM = Identity("fs", "store", "job", "item-1")
OTHER = Identity("fs", "store", "job", "item-2")
DEFINITION = definition_digest("fs-v1")
INPUTS = {"n": "1"}


async def open_store(root: Path, fs: FileSystem | None = None) -> tuple[FileStore, Journal]:
    store = FileStore(str(root), fs=fs)
    await store.open()
    return store, Journal(store)


def temps(root: Path) -> list[Path]:
    return list(root.glob("**/*.tmp"))


async def test_open_refuses_a_root_that_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(StorageFailed) as caught:
        await Journal.open(str(target))
    assert caught.value.errno in (errno.EEXIST, errno.ENOTDIR)
    with pytest.raises(StorageFailed) as caught:
        await Journal.open(str(target / "below"))
    assert isinstance(caught.value.__cause__, OSError)


async def test_a_file_in_place_of_the_fanout_directory(root: Path) -> None:
    store, journal = await open_store(root)
    fanout = store.path_for(ITEM).parent
    fanout.write_text("in the way")
    with pytest.raises(StorageFailed) as caught:
        await journal.begin(ITEM, INPUTS, DEFINITION)
    assert "not a directory" in str(caught.value)
    with pytest.raises(StorageFailed):
        await journal.inspect(ITEM)  # reading through it fails plainly: ENOTDIR
    assert fanout.read_text() == "in the way"


async def test_a_directory_in_place_of_the_lock_file(root: Path) -> None:
    store, journal = await open_store(root)
    lock = store.path_for(ITEM).parent / ".lock"
    lock.mkdir(parents=True)
    with pytest.raises(StorageFailed) as caught:
        await journal.begin(ITEM, INPUTS, DEFINITION)
    assert "lock file" in str(caught.value)


class RivalLink(FileSystem):
    """Another writer, not using the lock, creates the record just before our link."""

    def __init__(self, rival: bytes) -> None:
        self.rival = rival
        self.fired = False

    def link(self, source: str, destination: str, *, dir_fd: int | None = None) -> None:
        if not self.fired:
            self.fired = True
            fd = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd)
            try:
                os.write(fd, self.rival)
            finally:
                os.close(fd)
        super().link(source, destination, dir_fd=dir_fd)


async def test_losing_a_create_race_re_reads_and_decides_again(root: Path, tmp_path: Path) -> None:
    donor_store, donor = await open_store(tmp_path / "donor")
    await donor.begin(ITEM, INPUTS, DEFINITION)
    rival = donor_store.path_for(ITEM).read_bytes()
    store, journal = await open_store(root, RivalLink(rival))
    with pytest.raises(ConflictError) as caught:
        await journal.begin(ITEM, INPUTS, DEFINITION)
    assert caught.value.code == "IN_PROGRESS"  # the rival, this process, is alive
    assert store.path_for(ITEM).read_bytes() == rival
    assert temps(root) == []


class Interrupting(FileSystem):
    """Raises a non-OSError (as a signal handler might) from one chosen call."""

    def __init__(self, method: str) -> None:
        self.method = method

    def __getattribute__(self, name: str) -> object:
        if name == object.__getattribute__(self, "method"):

            def interrupted(*args: object, **kwargs: object) -> None:
                raise KeyboardInterrupt

            return interrupted
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("method", ["write", "link"])
async def test_an_interrupted_first_save_leaves_nothing(root: Path, method: str) -> None:
    _, journal = await open_store(root, Interrupting(method))
    with pytest.raises(KeyboardInterrupt):
        await journal.begin(ITEM, INPUTS, DEFINITION)
    assert temps(root) == []
    assert (await journal.inspect(ITEM)).status == "absent"


async def test_an_interrupted_replace_leaves_the_record(root: Path) -> None:
    store, journal = await open_store(root)
    claim = await journal.begin(ITEM, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    before = store.path_for(ITEM).read_bytes()
    store.fs = Interrupting("replace")
    with pytest.raises(KeyboardInterrupt):
        await journal.complete(claim, "r")
    assert store.path_for(ITEM).read_bytes() == before
    assert temps(root) == []


class Failing(FileSystem):
    """Fails the listed calls (method name → how many times) with EIO."""

    def __init__(self, **budget: int) -> None:
        self.budget = budget

    def _maybe_fail(self, method: str) -> None:
        if self.budget.get(method, 0) > 0:
            self.budget[method] -= 1
            raise OSError(errno.EIO, f"injected {method} failure")

    def unlink(self, path: str, *, dir_fd: int | None = None) -> None:
        if path.endswith(".json"):
            self._maybe_fail("unlink_record")
        else:
            self._maybe_fail("unlink_temp")
        super().unlink(path, dir_fd=dir_fd)

    def fsync_dir(self, fd: int) -> None:
        self._maybe_fail("fsync_dir")
        super().fsync_dir(fd)

    def replace(self, source: str, destination: str, *, dir_fd: int | None = None) -> None:
        self._maybe_fail("replace")
        super().replace(source, destination, dir_fd=dir_fd)


async def test_temp_that_cannot_be_unlinked_after_the_link_is_left_for_the_sweep(
    root: Path,
) -> None:
    _, journal = await open_store(root, Failing(unlink_temp=2))
    claim = await journal.begin(ITEM, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)  # the record is durable; only a spare link remains
    assert len(temps(root)) == 1


async def test_directory_sync_failure_with_a_record_that_cannot_be_removed(root: Path) -> None:
    store, journal = await open_store(root)
    await store.apply(ITEM, lambda current: Step(None, None))  # the fan-out directory exists
    store.fs = Failing(fsync_dir=1, unlink_record=1)
    with pytest.raises(StorageFailed) as caught:
        await journal.begin(ITEM, INPUTS, DEFINITION)
    assert "stays at" in str(caught.value)
    assert "needs review" in str(caught.value)
    view = await journal.inspect(ITEM)
    assert view.status == "started"  # unowned but refusing: never a silent second run
    with pytest.raises(ConflictError):
        await journal.begin(ITEM, INPUTS, DEFINITION)


async def test_directory_sync_failure_on_create_is_not_retried(root: Path) -> None:
    store, journal = await open_store(root)
    await journal.store.apply(ITEM, lambda current: Step(None, None))
    store.fs = Failing(fsync_dir=2)
    with pytest.raises(StorageFailed) as caught:
        await journal.begin(ITEM, INPUTS, DEFINITION)
    assert "durability unknown" in str(caught.value)  # the failed sync is not repeated
    assert store.fs.budget["fsync_dir"] == 1
    assert (await journal.inspect(ITEM)).status == "absent"


async def test_restore_that_fails_says_the_record_may_hold_either_version(root: Path) -> None:
    store, journal = await open_store(root)
    claim = await journal.begin(ITEM, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    store.fs = Failing(fsync_dir=1, replace=0)

    class ThenReplaceFails(Failing):
        def fsync_dir(self, fd: int) -> None:
            if self.budget.get("fsync_dir", 0) == 1:
                self.budget["replace"] = 1  # the restore's replace fails next
            super().fsync_dir(fd)

    store.fs = ThenReplaceFails(fsync_dir=1)
    with pytest.raises(StorageFailed) as caught:
        await journal.complete(claim, "r")
    assert "either version" in str(caught.value)
    assert temps(root) == []
    assert (await journal.inspect(ITEM)).status == "succeeded"  # what the disk holds now


async def test_delete_steps(root: Path) -> None:
    store, journal = await open_store(root)
    await journal.begin(ITEM, INPUTS, DEFINITION)
    gone = Step(None, "gone", delete=True)
    assert await store.apply(ITEM, lambda current: gone) == "gone"
    assert (await journal.inspect(ITEM)).status == "absent"
    assert await store.apply(ITEM, lambda current: gone) == "gone"  # absent: nothing to do

    await journal.begin(ITEM, INPUTS, DEFINITION)
    store.fs = Failing(unlink_record=1)
    with pytest.raises(StorageFailed):
        await store.apply(ITEM, lambda current: gone)
    assert (await journal.inspect(ITEM)).status == "started"
    store.fs = Failing(fsync_dir=1)
    with pytest.raises(StorageFailed) as caught:
        await store.apply(ITEM, lambda current: gone)
    assert "removed" in str(caught.value)


class VanishingRecord(FileSystem):
    """The record disappears (an outside hand) right before our unlink."""

    def unlink(self, path: str, *, dir_fd: int | None = None) -> None:
        if path.endswith(".json"):
            os.unlink(path, dir_fd=dir_fd)
        super().unlink(path, dir_fd=dir_fd)


async def test_delete_of_a_record_that_vanished_is_quiet(root: Path) -> None:
    store, journal = await open_store(root, VanishingRecord())
    await journal.begin(ITEM, INPUTS, DEFINITION)
    assert await store.apply(ITEM, lambda current: Step(None, 1, delete=True)) == 1


async def test_a_record_that_keeps_changing_gives_up(root: Path) -> None:
    class AlwaysRival(FileSystem):
        def link(self, source: str, destination: str, *, dir_fd: int | None = None) -> None:
            raise FileExistsError(errno.EEXIST, "someone else")

    _, journal = await open_store(root, AlwaysRival())
    with pytest.raises(StorageFailed) as caught:
        await journal.begin(ITEM, INPUTS, DEFINITION)
    assert caught.value.errno == errno.EAGAIN
    assert temps(root) == []


async def test_scan_reports_invalid_records_and_ignores_other_files(root: Path) -> None:
    store, journal = await open_store(root)
    await journal.begin(ITEM, INPUTS, DEFINITION)
    await journal.begin(OTHER, INPUTS, DEFINITION)
    store.path_for(OTHER).write_text("{broken")
    misplaced = root / "00" / store.path_for(ITEM).name
    misplaced.parent.mkdir(exist_ok=True)
    misplaced.write_bytes(store.path_for(ITEM).read_bytes())
    (root / "README").write_text("not a record")
    (root / "ab").mkdir(exist_ok=True)
    (root / "ab" / "notes.txt").write_text("not a record")
    seen = [item async for item in store.scan()]
    good = [item for item in seen if isinstance(item, Record)]
    bad = [item for item in seen if isinstance(item, RecordInvalid)]
    assert len(good) + len(bad) == len(seen)
    assert [record.identity for record in good] == [ITEM]
    assert sorted(error.location or "" for error in bad) == sorted(
        [str(store.path_for(OTHER)), str(misplaced)]
    )


async def test_scan_of_a_vanished_root_is_a_storage_failure(root: Path) -> None:
    store, _ = await open_store(root)
    root.rmdir()
    with pytest.raises(StorageFailed):
        [item async for item in store.scan()]


async def test_sweep_of_temps_with_unknown_start_time(root: Path) -> None:
    store, journal = await open_store(root)
    await journal.begin(ITEM, INPUTS, DEFINITION)
    fanout = store.path_for(ITEM).parent
    dead = fanout / f".{2**22 + 1}--{'a' * 32}.tmp"
    live = fanout / f".{os.getpid()}--{'b' * 32}.tmp"
    for path in (dead, live):
        path.write_text("x")
        os.utime(path, (0, 0))
    await store.open()
    assert not dead.exists()
    assert live.exists()


async def test_record_document_is_sorted_json(root: Path) -> None:
    store, journal = await open_store(root)
    await journal.begin(ITEM, INPUTS, DEFINITION)
    text = store.path_for(ITEM).read_text()
    document = json.loads(text)
    assert list(document) == sorted(document)
    assert text.endswith("\n")


async def test_a_status_scan(root: Path) -> None:
    store, journal = await open_store(root)
    claim = await journal.begin(ITEM, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    await journal.begin(OTHER, INPUTS, DEFINITION)
    await journal.complete(claim, "r")
    started = [r async for r in store.scan(status="started")]
    assert [r.identity for r in started if isinstance(r, Record)] == [OTHER]
    assert len(started) == 1


class HeldFsync(FileSystem):
    """Every fsync waits until ``release``; counts how many are waiting at once."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.inside = 0
        self.most = 0

    def fsync(self, fd: int) -> None:
        with self._lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        try:
            assert self.release.wait(10), "the test never released the fsyncs"
        finally:
            with self._lock:
                self.inside -= 1
        super().fsync(fd)


class TwoAtOnce(FileStore):
    trips_at_once = 2


async def test_the_store_runs_trips_at_once_saves_in_threads_and_queues_the_rest(
    root: Path,
) -> None:
    fs = HeldFsync()
    store = TwoAtOnce(str(root), fs=fs)
    await store.open()
    journal = Journal(store)
    items = [Identity("fs", "store", "turns", f"item-{n}") for n in range(6)]
    claims: list[object] = []

    async def begin(identity: Identity) -> None:
        claims.append(await journal.begin(identity, INPUTS, DEFINITION))

    before, workers._POOL = workers._POOL, workers._Pool()  # threads of its own, counted
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for identity in items:
                    tg.start_soon(begin, identity)
                while fs.inside < 2:  # noqa: ASYNC110 - worker threads set no event
                    await anyio.sleep(0.001)
                for _ in range(50):
                    await anyio.lowlevel.checkpoint()
                assert store._trips._in_flight == 6  # all six asked
                # Two saves were handed to threads (the pool had room for 40); the other
                # four wait their turn on the loop.
                assert workers._POOL.threads == 2 and not workers._POOL.queue
                assert fs.inside == 2
                fs.release.set()
    finally:
        fs.release.set()
        workers._POOL = before
    assert fs.most == 2
    assert len(claims) == 6 and all(isinstance(claim, Claim) for claim in claims)
    await store.aclose()


def test_trips_at_once_is_eight_by_default(root: Path) -> None:
    assert FileStore.trips_at_once == 8
    assert FileStore(str(root))._trips._at_once == 8
