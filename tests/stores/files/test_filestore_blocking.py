"""The file store's blocking face (``itemjournal.sync``): each call in its caller's thread,
answering as the awaited call does, excluding the awaited face, other threads, other
processes and forked children on one record, and counted so that closing waits for it."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.to_thread
import pytest
from _blocking_steps import (
    a_scan_stopped_early_does_not_hold_up_closing,
    awaited,
    claim,
    close_waits_for_the_call_under_way,
    count_of,
    faces_racing,
    holding,
    identities,
    increment,
    race,
    same_scans,
)
from _builders import started_record

from itemjournal import FileStore, Identity, InvalidArgument, RecordInvalid, StorageFailed
from itemjournal._model import machine
from itemjournal._model.identity import identity_digest
from itemjournal._model.records import Record, utc_now
from itemjournal._stores.files import locks
from itemjournal._stores.seam import Step

T = TypeVar("T")

ITEM, OTHER, THIRD = identities(3, job="file-blocking")


def opened(root: Path) -> FileStore:
    store = FileStore(str(root))
    store.open_blocking()
    return store


def nothing(current: Record | None) -> Step[None]:
    return Step(None, None)


# ---------------------------------------------------------------------------- answers


def test_each_blocking_call_answers_as_the_awaited_one(root: Path) -> None:
    store = FileStore(str(root))
    store.open_blocking()
    assert root.is_dir()
    awaited(store.open)  # the awaited open finds what the blocking one made
    assert store.setting_blocking("input_kind", "sha256") == "sha256"
    assert awaited(store.setting, "input_kind", "other") == "sha256"
    assert store.setting_blocking("input_kind", "other") == "sha256"
    assert awaited(store.setting, "second", "x") == store.setting_blocking("second", "y") == "x"

    items = identities(40, job="answers")
    for index, identity in enumerate(items):
        step = increment(identity)
        answer = (
            store.apply_blocking(identity, step)
            if index % 2
            else awaited(store.apply, identity, step)
        )
        assert answer == 0
    assert store.apply_blocking(items[0], increment(items[0])) == 1
    assert awaited(store.apply, items[0], increment(items[0])) == 2
    succeeded = started_record(OTHER).advance("complete", "succeeded", utc_now(), receipt="r-1")
    assert store.apply_blocking(OTHER, lambda current: Step(succeeded, "written")) == "written"
    damaged = store.path_for(THIRD)
    damaged.parent.mkdir(mode=0o700, exist_ok=True)
    damaged.write_bytes(b"{ not a record")
    damaged.chmod(0o600)

    for identity in (items[0], items[1], OTHER, Identity("tests", "none", "here", "x")):
        assert store.peek_blocking(identity, count_of) == awaited(store.peek, identity, count_of)
    with pytest.raises(RecordInvalid):
        store.peek_blocking(THIRD, count_of)

    same_scans(store, identity_digest(items[7]))
    everything = list(store.scan_blocking())
    assert len(everything) == 42
    assert sum(isinstance(item, RecordInvalid) for item in everything) == 1

    assert store.tally_blocking() is None
    assert awaited(store.tally) is None

    assert store.check_blocking() == awaited(store.check) == []
    stray = root / items[0].job
    stray.write_text("no business here")
    assert store.check_blocking() == awaited(store.check) != []

    ages = store.ages_blocking([items[0], OTHER, Identity("tests", "none", "here", "x")])
    expected = awaited(store.ages, [items[0], OTHER, Identity("tests", "none", "here", "x")])
    assert (
        [age is None for age in ages]
        == [age is None for age in expected]
        == [
            False,
            False,
            True,
        ]
    )
    assert all(
        abs((age - other).total_seconds()) < 5
        for age, other in zip(ages, expected, strict=True)
        if age is not None and other is not None
    )
    store.close_blocking()


def test_a_step_refused_writes_nothing_and_its_error_comes_through(root: Path) -> None:
    store = opened(root)

    def refuse(current: Record | None) -> Step[None]:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        store.apply_blocking(ITEM, refuse)
    assert not store.path_for(ITEM).exists()
    assert store.apply_blocking(ITEM, lambda current: Step(None, "gone", delete=True)) == "gone"
    store.close_blocking()


def test_blocking_calls_run_in_the_callers_thread_and_keep_nothing_open(root: Path) -> None:
    store = opened(root)
    seen: list[int] = []

    def step(current: Record | None) -> Step[int]:
        seen.append(threading.get_ident())
        return increment(ITEM)(current)

    before = set(os.listdir("/proc/self/fd"))
    for _ in range(3):
        store.apply_blocking(ITEM, step)
    store.peek_blocking(ITEM, lambda record: seen.append(threading.get_ident()))
    assert seen == [threading.get_ident()] * 4
    # No descriptor kept between calls, none of the awaited face's kept ones used.
    assert set(os.listdir("/proc/self/fd")) <= before
    assert not store._fanouts.entries
    assert not locks._CALL_LOCK_FILES.open
    store.close_blocking()


def test_settings_are_checked_before_anything_is_written(root: Path) -> None:
    store = opened(root)
    with pytest.raises(InvalidArgument, match="non-empty string") as caught:
        store.setting_blocking("", "x")
    assert caught.value.code == "INVALID_ARGUMENT"
    assert not (root / "itemjournal.json").exists()


# ---------------------------------------------------------------------------- threads


def test_threads_racing_apply_blocking_lose_no_update_and_grant_one_claim(root: Path) -> None:
    store = opened(root)
    items = identities(8, job="race")
    made, granted = race(store, items, threads=32, rounds=8)
    assert sum(made.values()) == 32 * 8
    for identity in items:
        assert store.peek_blocking(identity, count_of) == made[identity]
        assert granted[identity] == 1
    store.close_blocking()


# ---------------------------------------------------------------------------- other processes

_HOLDER = """
import os, sys
from itemjournal._stores.files.locks import try_lock_record, try_lock_whole
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
if sys.argv[2] == "whole":
    taken = try_lock_whole(fd, sys.argv[1])
else:
    taken = try_lock_record(fd, sys.argv[2])
print("held" if taken else "busy", flush=True)
sys.stdin.read()
"""


@contextmanager
def held_elsewhere(lock_file: Path, what: str) -> Iterator[Callable[[], None]]:
    """Another process holding ``what`` (a record's digest, or ``whole``) of ``lock_file``;
    yields a function that makes it let go (and waits until it has)."""
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(lock_file), what],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdin is not None and process.stdout is not None

    def let_go() -> None:
        if process.poll() is None:
            process.communicate("", timeout=30)

    try:
        assert process.stdout.readline().strip() == "held"
        yield let_go
    finally:
        let_go()


def test_a_record_lock_held_by_another_process_is_waited_for_then_times_out(root: Path) -> None:
    store = opened(root)
    store.apply_blocking(ITEM, nothing)  # the fan-out and its lock file exist
    lock_file = store.path_for(ITEM).parent / ".lock"
    with held_elsewhere(lock_file, identity_digest(ITEM)) as let_go:
        store.lock_timeout = 0.3
        started = time.monotonic()
        with pytest.raises(StorageFailed) as caught:
            store.apply_blocking(ITEM, increment(ITEM))
        assert time.monotonic() - started >= 0.3
        assert caught.value.errno == errno.ETIMEDOUT
        assert "stayed held for 0.3 s" in str(caught.value)
        with pytest.raises(StorageFailed) as awaited_error:
            awaited(store.apply, ITEM, increment(ITEM))
        assert str(awaited_error.value) == str(caught.value)  # the same error, word for word
        assert store.apply_blocking(OTHER, increment(OTHER)) == 0  # another record: free
        let_go()
    store.lock_timeout = 30
    assert store.apply_blocking(ITEM, increment(ITEM)) == 0  # nothing was written meanwhile
    store.close_blocking()


def test_the_settings_lock_held_by_another_process_times_out(root: Path) -> None:
    store = opened(root)
    with held_elsewhere(root / ".lock", "whole") as let_go:
        store.lock_timeout = 0.2
        with pytest.raises(StorageFailed) as caught:
            store.setting_blocking("kind", "one")
        assert caught.value.errno == errno.ETIMEDOUT
        assert f"the settings lock of {root} stayed held for 0.2 s" in str(caught.value)
        let_go()
    assert store.setting_blocking("kind", "one") == "one"


# ---------------------------------------------------------------------------- closing


def test_close_blocking_waits_for_a_call_under_way_and_later_calls_are_refused(
    root: Path,
) -> None:
    store = opened(root)
    close_waits_for_the_call_under_way(store, ITEM, OTHER)
    assert FileStore(str(root)).peek_blocking(ITEM, count_of) == 1  # durable


def test_a_close_during_a_lock_wait_refuses_the_next_attempt(root: Path) -> None:
    store = opened(root)
    store.apply_blocking(ITEM, nothing)
    errors: list[BaseException] = []

    def wait_for_the_lock() -> None:
        try:
            store.apply_blocking(ITEM, increment(ITEM))
        except BaseException as error:
            errors.append(error)

    with held_elsewhere(store.path_for(ITEM).parent / ".lock", identity_digest(ITEM)):
        waiter = threading.Thread(target=wait_for_the_lock)
        waiter.start()
        store.close_blocking()  # does not wait out the lock (30 s): only an attempt
        waiter.join()
    assert len(errors) == 1
    assert isinstance(errors[0], StorageFailed)
    assert "is closed" in str(errors[0])


def test_a_scan_stopped_early_does_not_hold_up_closing(root: Path) -> None:
    a_scan_stopped_early_does_not_hold_up_closing(opened(root))


# ---------------------------------------------------------------------------- both faces


@pytest.mark.anyio
async def test_the_awaited_and_blocking_faces_exclude_each_other_on_one_record(
    root: Path,
) -> None:
    store = FileStore(str(root))
    await store.open()
    assert store._keeps_descriptors  # the awaited face keeps its descriptors (Linux)
    entered, release = threading.Event(), threading.Event()
    step = holding(ITEM, entered, release)

    # The awaited face holds the record, through its kept descriptors.
    async with anyio.create_task_group() as group:
        group.start_soon(store.apply, ITEM, step)
        await anyio.to_thread.run_sync(entered.wait)
        assert store._fanouts.entries
        store.lock_timeout = 0.2
        with pytest.raises(StorageFailed) as caught:
            await anyio.to_thread.run_sync(store.apply_blocking, ITEM, increment(ITEM))
        assert caught.value.errno == errno.ETIMEDOUT
        assert await anyio.to_thread.run_sync(store.apply_blocking, OTHER, increment(OTHER)) == 0
        release.set()

    # The blocking face holds it, through descriptors of its own.
    entered.clear()
    release.clear()
    async with anyio.create_task_group() as group:
        group.start_soon(anyio.to_thread.run_sync, store.apply_blocking, ITEM, step)
        await anyio.to_thread.run_sync(entered.wait)
        with pytest.raises(StorageFailed) as caught:
            await store.apply(ITEM, increment(ITEM))
        assert caught.value.errno == errno.ETIMEDOUT
        assert await store.apply(OTHER, increment(OTHER)) == 1
        release.set()
    assert await store.peek(ITEM, count_of) == 2
    await store.aclose()


@pytest.mark.anyio
async def test_awaited_and_blocking_saves_racing_on_records_lose_no_update(root: Path) -> None:
    store = FileStore(str(root))
    await store.open()
    await faces_racing(store, identities(4, job="faces"), rounds=12)
    await store.aclose()


# ---------------------------------------------------------------------------- fork


def begin_like(identity: Identity, claim_id: str) -> Callable[[Record | None], Step[bool]]:
    """``begin``'s step on the state machine: claim the record; answers whether it did."""

    def step(current: Record | None) -> Step[bool]:
        record = machine.begin(
            current,
            identity=identity,
            input_kind="sha256",
            input_hash="a" * 64,
            definition_hash="d" * 64,
            claim_id=claim_id,
            owner=started_record(identity).owner,  # type: ignore[arg-type]
            now=utc_now(),
        )
        return Step(record, record is not None)

    return step


def complete_like(claim_id: str, receipt: str) -> Callable[[Record | None], Step[str]]:
    def step(current: Record | None) -> Step[str]:
        record = machine.complete(
            current,
            claim_id=claim_id,
            input_hash="a" * 64,
            definition_hash="d" * 64,
            receipt=receipt,
            now=utc_now(),
        )
        return Step(record, record.status)

    return step


def in_child(work: Callable[[], None]) -> int:
    """Fork; the child runs ``work`` and exits 0 (1 on any error, with its traceback on
    stderr); the child's pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child, which coverage does not follow
        code = 1
        try:
            work()
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def exit_code(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_forked_child_works_through_the_blocking_face(root: Path) -> None:
    store = opened(root)
    assert store.apply_blocking(OTHER, increment(OTHER)) == 0

    def child() -> None:
        assert store.apply_blocking(ITEM, begin_like(ITEM, "c" * 32)) is True
        assert store.apply_blocking(ITEM, complete_like("c" * 32, "receipt-1")) == "succeeded"
        assert store.apply_blocking(OTHER, increment(OTHER)) == 1
        assert store.peek_blocking(ITEM, lambda record: record and record.receipt) == "receipt-1"

    assert exit_code(in_child(child)) == 0
    assert store.peek_blocking(ITEM, lambda record: record and record.status) == "succeeded"
    assert store.peek_blocking(OTHER, count_of) == 2
    assert store.apply_blocking(ITEM, begin_like(ITEM, "e" * 32)) is False  # reused
    store.close_blocking()


def test_a_record_locked_by_the_parents_call_in_flight_is_not_the_childs_meanwhile(
    root: Path,
) -> None:
    store = opened(root)
    entered, release = threading.Event(), threading.Event()
    step = holding(ITEM, entered, release)

    caller = threading.Thread(target=store.apply_blocking, args=(ITEM, step))
    caller.start()
    assert entered.wait(30)
    to_parent, from_child = os.pipe()
    from_parent, to_child = os.pipe()

    def child() -> None:
        # The parent's call is under way: its lock excludes the child.
        store.lock_timeout = 0.2
        try:
            store.apply_blocking(ITEM, increment(ITEM))
        except StorageFailed as error:
            assert error.errno == errno.ETIMEDOUT
        else:
            raise AssertionError("the child wrote a record the parent had locked")
        assert store.apply_blocking(OTHER, increment(OTHER)) == 0
        os.write(from_child, b"1")
        assert os.read(from_parent, 1) == b"1"
        # The parent's call has ended: nothing of it inherited here holds the lock still.
        store.lock_timeout = 30
        assert store.apply_blocking(ITEM, increment(ITEM)) == 1

    pid = in_child(child)
    assert os.read(to_parent, 1) == b"1"
    release.set()
    caller.join()
    os.write(to_child, b"1")
    assert exit_code(pid) == 0
    for fd in (to_parent, from_child, from_parent, to_child):
        os.close(fd)
    assert store.peek_blocking(ITEM, count_of) == 2
    assert store.peek_blocking(OTHER, count_of) == 1
    assert store.apply_blocking(ITEM, claim(ITEM, 1)) is True  # the parent's lock: free too
    store.close_blocking()
