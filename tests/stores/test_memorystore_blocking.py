"""The in-memory store's blocking face (``itemjournal.sync``): each call in its caller's
thread, answering as the awaited call does, one identity's read-step-write at a time
whichever face runs it, and counted so that closing waits for it."""

from __future__ import annotations

import dataclasses
import os
import threading

import anyio
import anyio.to_thread
import pytest
from _blocking_steps import (
    a_scan_stopped_early_does_not_hold_up_closing,
    awaited,
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

from itemjournal import Identity, InvalidArgument, RecordInvalid
from itemjournal._model.identity import identity_digest
from itemjournal._model.records import Record, utc_now
from itemjournal._stores.seam import Step
from itemjournal.testing import MemoryStore

ITEM, OTHER, THIRD = identities(3, job="memory-blocking")


def test_each_blocking_call_answers_as_the_awaited_one() -> None:
    store = MemoryStore()
    store.open_blocking()
    assert store.setting_blocking("input_kind", "sha256") == "sha256"
    assert awaited(store.setting, "input_kind", "other") == "sha256"
    assert awaited(store.setting, "second", "x") == store.setting_blocking("second", "y") == "x"
    with pytest.raises(InvalidArgument):
        store.setting_blocking("", "x")

    items = identities(30, job="answers")
    for index, identity in enumerate(items):
        step = increment(identity)
        if index % 2:
            assert store.apply_blocking(identity, step) == 0
        else:
            assert awaited(store.apply, identity, step) == 0
    assert store.apply_blocking(items[0], increment(items[0])) == 1
    succeeded = started_record(OTHER).advance("complete", "succeeded", utc_now(), receipt="r-1")
    assert store.apply_blocking(OTHER, lambda current: Step(succeeded, "written")) == "written"
    store.put_document(THIRD, b"{ not a record")

    for identity in (items[0], items[1], OTHER, Identity("tests", "none", "here", "x")):
        assert store.peek_blocking(identity, count_of) == awaited(store.peek, identity, count_of)
    with pytest.raises(RecordInvalid):
        store.peek_blocking(THIRD, count_of)

    same_scans(store, identity_digest(items[7]))
    assert len(list(store.scan_blocking())) == 32
    with pytest.raises(InvalidArgument):
        next(store.scan_blocking(batch=0))

    tally = store.tally_blocking()
    assert tally == awaited(store.tally)
    assert tally.exact
    assert tally.counts["started"] == 30
    assert tally.counts["succeeded"] == 1
    assert tally.counts["invalid"] == 1
    assert store.check_blocking() == awaited(store.check) == []
    assert store.ages_blocking([ITEM, OTHER]) == awaited(store.ages, [ITEM, OTHER]) == [None] * 2
    store.close_blocking()


def test_steps_run_in_the_callers_thread_and_may_read_files_there() -> None:
    store = MemoryStore()
    gone = dataclasses.replace(store.owner(), pid=2**22 + 17)  # no such process
    seen: list[tuple[int, bool | None]] = []

    def step(current: Record | None) -> Step[bool | None]:
        alive = store.owner_alive(gone)  # reads /proc: here, at once, never run twice
        seen.append((threading.get_ident(), alive))
        return Step(None, alive)

    assert store.apply_blocking(ITEM, step) is False
    assert store.peek_blocking(ITEM, lambda record: threading.get_ident()) == threading.get_ident()
    assert seen == [(threading.get_ident(), False)]


def test_threads_racing_apply_blocking_lose_no_update_and_grant_one_claim() -> None:
    store = MemoryStore()
    items = identities(8, job="race")
    made, granted = race(store, items, threads=32, rounds=40)
    assert sum(made.values()) == 32 * 40
    for identity in items:
        assert store.peek_blocking(identity, count_of) == made[identity]
        assert granted[identity] == 1


def test_close_blocking_waits_for_a_call_under_way_and_later_calls_are_refused() -> None:
    store = MemoryStore()
    close_waits_for_the_call_under_way(store, ITEM, OTHER)
    assert store.document(ITEM) is not None  # the records stay in memory


def test_a_scan_stopped_early_does_not_hold_up_closing() -> None:
    a_scan_stopped_early_does_not_hold_up_closing(MemoryStore())


@pytest.mark.anyio
async def test_an_awaited_step_waits_for_an_identity_a_blocking_call_holds() -> None:
    store = MemoryStore()
    entered, release = threading.Event(), threading.Event()
    step = holding(ITEM, entered, release)

    found: list[int] = []

    async def awaited_increment() -> None:
        found.append(await store.apply(ITEM, increment(ITEM)))

    async with anyio.create_task_group() as group:
        group.start_soon(anyio.to_thread.run_sync, store.apply_blocking, ITEM, step)
        await anyio.to_thread.run_sync(entered.wait)
        group.start_soon(awaited_increment)
        assert await store.apply(OTHER, increment(OTHER)) == 0  # another identity: free
        release.set()
    assert found == [1]  # it ran after the blocking call's write, not beside it
    assert await store.peek(ITEM, count_of) == 2


@pytest.mark.anyio
async def test_awaited_and_blocking_steps_racing_lose_no_update() -> None:
    await faces_racing(MemoryStore(), identities(4, job="faces"), rounds=50)


def test_a_forked_child_is_not_stopped_by_an_identity_lock_held_in_the_parent() -> None:
    store = MemoryStore()
    entered, release = threading.Event(), threading.Event()
    step = holding(ITEM, entered, release)

    caller = threading.Thread(target=store.apply_blocking, args=(ITEM, step))
    caller.start()
    assert entered.wait(30)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child, which coverage does not follow
        code = 1
        try:
            # The parent's call holds ITEM's lock, but that thread is not in the child.
            assert store.apply_blocking(ITEM, increment(ITEM)) == 0
            assert store.peek_blocking(ITEM, count_of) == 1
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    release.set()
    caller.join()
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.peek_blocking(ITEM, count_of) == 1  # the child's copy is its own
