"""The file store's kept descriptors: fan-out and lock-file descriptors stay open between
saves, and nothing the guarantees rest on may change because of it."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from _builders import NOW, dead_owner, started_record

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
from itemjournal._model.codec import encode_record
from itemjournal._model.identity import identity_digest
from itemjournal._model.records import Record
from itemjournal._stores.files.locks import try_lock_record
from itemjournal._stores.files.scans import _shows_other_status
from itemjournal._stores.files.temps import _TEMP
from itemjournal._stores.owners import current_pid
from itemjournal._stores.seam import Step

DEFINITION = definition_digest("speed-v1")
INPUTS = {"n": "1"}

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="descriptors are kept on Linux only"
)


def identities_in_one_fanout(count: int) -> list[Identity]:
    """``count`` identities whose records share one fan-out directory."""
    by_prefix: dict[str, list[Identity]] = {}
    n = 0
    while True:
        identity = Identity("speed", "fanout", "job", f"item-{n}")
        n += 1
        group = by_prefix.setdefault(identity_digest(identity)[:2], [])
        group.append(identity)
        if len(group) == count:
            return group


def open_descriptors() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


async def in_thread(function, *args):  # type: ignore[no-untyped-def]
    return await anyio.to_thread.run_sync(function, *args)


pytestmark = [pytest.mark.anyio, linux_only]


@asynccontextmanager
async def saves_under_way(store: FileStore, identities: list[Identity]) -> AsyncIterator[None]:
    """One save per identity held open (its step waits) for the duration of the block,
    so that the store keeps its fan-out descriptors as under concurrent load."""
    entered = threading.Semaphore(0)
    release = threading.Event()

    def step(current: Record | None) -> Step[None]:
        entered.release()
        assert release.wait(10), "the test never released the save"
        return Step(None, None)

    async with anyio.create_task_group() as group:
        for identity in identities:
            group.start_soon(store.apply, identity, step)
        for _ in identities:
            assert await in_thread(entered.acquire, True, 10)
        try:
            yield
        finally:
            release.set()


async def open_journal(root: Path) -> tuple[FileStore, Journal]:
    journal = await Journal.open(str(root))
    store = journal.store
    assert isinstance(store, FileStore)
    return store, journal


async def test_descriptors_are_kept_while_saves_overlap_and_closed_after(
    anyio_backend: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FileStore, "trips_at_once", 32)  # all 20 saves held at once, and one more
    before = await in_thread(open_descriptors)
    store, journal = await open_journal(root)
    held = [Identity("speed", "fd", "job", f"i{n}") for n in range(20)]  # many fan-outs
    async with saves_under_way(store, held):
        kept = len(store._fanouts.entries)
        assert kept > 8
        during = await in_thread(open_descriptors)
        assert len(during - before) >= 2 * kept  # a directory and a lock file per fan-out
        for entry in store._fanouts.entries.values():
            for fd in (entry.dir_fd, entry.lock_fd):
                assert not os.get_inheritable(fd)  # O_CLOEXEC
            assert stat.S_ISDIR(os.fstat(entry.dir_fd).st_mode)
            assert stat.S_ISREG(os.fstat(entry.lock_fd).st_mode)
        claim = await journal.begin((*held[0][:3], "other"), INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        await journal.complete(claim, "done")
    assert store._fanouts.entries == {}  # idle: nothing kept open
    assert await in_thread(open_descriptors) == before
    await journal.aclose()
    assert await in_thread(open_descriptors) == before


async def test_aclose_closes_whatever_is_still_kept(anyio_backend: str, root: Path) -> None:
    store, journal = await open_journal(root)
    identity = Identity("speed", "fd", "job", "kept")
    directory = str(store.path_for(identity).parent)
    before = await in_thread(open_descriptors)
    entry = await in_thread(store._acquire_fanout, os.path.basename(directory), directory)
    store._release_fanout(entry)  # kept, as if a save were still under way
    assert len(await in_thread(open_descriptors) - before) == 2
    await journal.aclose()
    assert store._fanouts.entries == {}
    assert await in_thread(open_descriptors) <= before


async def test_a_fanout_replaced_behind_the_store_is_checked_afresh(
    anyio_backend: str, root: Path, tmp_path: Path
) -> None:
    """A fan-out renamed away (here: out of the root) and recreated while the store keeps
    its descriptor: the store never writes into the directory that moved away; it opens
    and checks the new one, where the record is no longer, so the old claim cannot be
    completed (CLAIM_MISMATCH), and a new claim goes to the new directory."""
    holder, first, second = identities_in_one_fanout(3)
    store, journal = await open_journal(root)
    claim = await journal.begin(first, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    fanout = store.path_for(first).parent
    moved = tmp_path / "moved-away"
    async with saves_under_way(store, [holder]):
        assert fanout.name in store._fanouts.entries
        await in_thread(os.rename, fanout, moved)
        await in_thread(os.mkdir, fanout, 0o700)
        moved_before = await in_thread(listing, moved)

        with pytest.raises(Exception) as caught:
            await journal.complete(claim, "done")
        assert getattr(caught.value, "code", None) == "CLAIM_MISMATCH"  # no record there
        fresh = await journal.begin(second, INPUTS, DEFINITION)
        assert isinstance(fresh, Claim)
        await journal.complete(fresh, "done")

        assert await in_thread(listing, moved) == moved_before  # nothing written out there
        assert store.path_for(second).name in await in_thread(listing, fanout)
    await journal.aclose()


async def test_a_kept_fanout_swapped_for_a_symlink_is_refused(
    anyio_backend: str, root: Path, tmp_path: Path
) -> None:
    holder, first, second = identities_in_one_fanout(3)
    store, journal = await open_journal(root)
    claim = await journal.begin(first, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    fanout = store.path_for(first).parent
    outside = tmp_path / "outside"
    async with saves_under_way(store, [holder]):
        await in_thread(os.rename, fanout, outside)
        await in_thread(os.symlink, outside, fanout)
        outside_before = await in_thread(listing, outside)

        with pytest.raises(StorageFailed, match="symlink"):
            await journal.begin(second, INPUTS, DEFINITION)
        with pytest.raises(StorageFailed, match="symlink"):
            await journal.complete(claim, "done")
        assert await in_thread(listing, outside) == outside_before
    await journal.aclose()


async def test_a_kept_fanout_made_shared_is_refused(anyio_backend: str, root: Path) -> None:
    holder, first, second = identities_in_one_fanout(3)
    store, journal = await open_journal(root)
    claim = await journal.begin(first, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    fanout = store.path_for(first).parent
    async with saves_under_way(store, [holder]):
        await in_thread(os.chmod, fanout, 0o770)
        with pytest.raises(StorageFailed, match="writable by group or others"):
            await journal.begin(second, INPUTS, DEFINITION)
        await in_thread(os.chmod, fanout, 0o700)
        await journal.complete(claim, "done")  # private again
    await journal.aclose()


async def test_a_kept_fanout_removed_is_made_again(anyio_backend: str, root: Path) -> None:
    holder, first = identities_in_one_fanout(2)
    store, journal = await open_journal(root)
    fanout = store.path_for(first).parent
    async with saves_under_way(store, [holder]):
        await in_thread(shutil.rmtree, fanout)
        fresh = await journal.begin(first, INPUTS, DEFINITION)
        assert isinstance(fresh, Claim)
        assert await in_thread(store.path_for(first).exists)
    await journal.aclose()


async def test_saves_of_one_store_on_one_record_exclude_each_other(
    anyio_backend: str, root: Path
) -> None:
    """The saves of one store share one open file description of ``.lock``, which the
    kernel does not exclude from itself: the store must."""
    store = FileStore(str(root))
    await store.open()
    identity = Identity("speed", "lock", "job", "shared")
    guard = threading.Lock()
    inside = 0
    most = 0

    def step(current: Record | None) -> Step[None]:
        nonlocal inside, most
        with guard:
            inside += 1
            most = max(most, inside)
        time.sleep(0.002)
        with guard:
            inside -= 1
        return Step(None, None)

    async with anyio.create_task_group() as group:
        for _ in range(12):
            group.start_soon(store.apply, identity, step)
    assert most == 1
    await store.aclose()


def test_a_forked_child_has_its_own_descriptors_and_pid(root: Path) -> None:
    """A child inherits the parent's kept descriptors, which share the parent's open file
    descriptions and so its record locks: it must open its own, and know its own pid."""
    identity = Identity("speed", "fork", "job", "item")
    digest = identity_digest(identity)
    store = FileStore(str(root))

    async def use() -> None:
        await store.open()
        journal = Journal(store)
        claim = await journal.begin(identity, INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        await journal.complete(claim, "done")

    anyio.run(use)
    directory = str(store.path_for(identity).parent)
    entry = store._acquire_fanout(digest[:2], directory)  # kept, as under load
    assert try_lock_record(entry.lock_fd, digest)  # the parent holds the record's lock
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        status = 0
        try:
            os.close(read_end)
            if store._fanouts.entries or current_pid() != os.getpid():
                status = 2
            else:
                fresh = store._acquire_fanout(digest[:2], directory)
                # The byte is the parent's: only a descriptor of the child's own open
                # file description is refused it (the inherited one would be granted).
                if try_lock_record(fresh.lock_fd, digest):
                    status = 4
                name = store._temp_name()
                if not name.startswith(f".{os.getpid()}-"):
                    status = 5
        except BaseException:
            status = 6
        os._exit(status)
    os.close(write_end)
    os.close(read_end)
    _, code = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(code) == 0
    store._release_fanout(entry)
    anyio.run(store.aclose)


def test_temp_names_are_unique_and_name_their_writer(root: Path) -> None:
    store = FileStore(str(root))
    names = {store._temp_name() for _ in range(1000)}
    assert len(names) == 1000
    for name in names:
        match = _TEMP.fullmatch(name)
        assert match is not None
        assert int(match[1]) == os.getpid()


# ---------------------------------------------------------------------- the status probe

DEAD_PID = 2**22 + 1  # beyond any Linux pid_max: no such process


def test_the_status_probe_reads_the_encoders_layout() -> None:
    record = started_record(Identity("speed", "probe", "job", "one"))
    data = encode_record(record)
    assert not _shows_other_status(data, "started")
    assert _shows_other_status(data, "needs_review")
    # A receipt that spells out another status: escaped inside its string, never matched.
    tricky = '", "status": "started", "updated_at": "'
    done = encode_record(record.advance("complete", "succeeded", NOW, receipt=tricky))
    assert tricky.encode() not in done
    assert _shows_other_status(done, "started")
    assert not _shows_other_status(done, "succeeded")
    pretty = json.dumps(json.loads(done), indent=1).encode()  # another layout: read strictly
    assert not _shows_other_status(pretty, "started")
    assert not _shows_other_status(done[:-20] + b"\n", "started")  # cut short: read strictly


async def test_sweep_and_status_listing_still_read_what_the_probe_cannot_place(
    anyio_backend: str, root: Path
) -> None:
    """An orphaned started record in another layout is still marked; a damaged one is
    still reported; a damaged document of another status is reported by a full scan."""
    store, journal = await open_journal(root)
    gone = dead_owner(DEAD_PID)
    orphan = Identity("speed", "probe", "job", "orphan")
    damaged = Identity("speed", "probe", "job", "damaged")
    other = Identity("speed", "probe", "job", "other")

    def plant() -> None:
        for identity, data in (
            (orphan, json.dumps(json.loads(encode_record(started_record(orphan, gone))))),
            (damaged, '{"status": "started", "updated_at": "'),
            (other, encode_record(started_record(other)).decode().replace('"aaaa', '"zz', 1)),
        ):
            path = store.path_for(identity)
            path.parent.mkdir(mode=0o700, exist_ok=True)
            path.write_text(data if identity != other else data.replace("started", "succeeded"))

    await in_thread(plant)
    report = await journal.sweep()
    assert [view.identity for view in report.marked] == [orphan]
    assert [getattr(p, "location", None) for p in report.problems] == [str(store.path_for(damaged))]
    everything = [item async for item in store.scan()]
    invalid = sorted(item.location or "" for item in everything if isinstance(item, RecordInvalid))
    assert invalid == sorted([str(store.path_for(damaged)), str(store.path_for(other))])
    await journal.aclose()


class RootSyncs(FileSystem):
    """Counts the syncs of one directory (the root)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.opened: dict[int, str] = {}
        self.syncs = 0

    def open_dir(
        self, path: str, *, dir_fd: int | None = None, follow_symlinks: bool = True
    ) -> int:
        fd = super().open_dir(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        self.opened[fd] = path
        return fd

    def fsync_dir(self, fd: int) -> None:
        if self.opened.get(fd) == self.root:
            self.syncs += 1
        super().fsync_dir(fd)

    def close_dir(self, fd: int) -> None:
        self.opened.pop(fd, None)
        super().close_dir(fd)


async def test_a_fanout_made_again_is_synced_into_the_root(anyio_backend: str, root: Path) -> None:
    first, second = identities_in_one_fanout(2)
    fs = RootSyncs(str(root))
    store = FileStore(str(root), fs=fs)
    await store.open()
    journal = Journal(store)
    assert isinstance(await journal.begin(first, INPUTS, DEFINITION), Claim)
    made = fs.syncs
    await in_thread(shutil.rmtree, store.path_for(first).parent)
    assert isinstance(await journal.begin(second, INPUTS, DEFINITION), Claim)
    assert fs.syncs == made + 1
    await journal.aclose()
