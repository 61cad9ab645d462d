"""Steps, races and scenarios for the tests of the stores' blocking faces (``BlockingStore``),
shared by the file and memory stores' tests.

A counter lives in a record's ``attempt`` (the count is ``attempt - 1``): ``increment`` is
a read-modify-write that a lost update would show. A claim lives in its ``claim_id``:
``claim`` grants it only while it still is ``UNCLAIMED``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.to_thread
import pytest
from _builders import started_record

from itemjournal import Identity, RecordInvalid, StorageFailed
from itemjournal._model.records import Record
from itemjournal._stores.seam import BlockingStore, Step, StepFunction

UNCLAIMED = "b" * 32  # the claim id of ``started_record``

Scanned = Record | RecordInvalid | StorageFailed


def identities(count: int, job: str = "blocking") -> list[Identity]:
    return [Identity("tests", "stores", job, f"item-{index}") for index in range(count)]


def increment(identity: Identity) -> StepFunction[int]:
    """Add one to the record's count; answers the count it found."""

    def step(current: Record | None) -> Step[int]:
        record = current or started_record(identity)
        return Step(dataclasses.replace(record, attempt=record.attempt + 1), record.attempt - 1)

    return step


def claim(identity: Identity, who: int) -> StepFunction[bool]:
    """Take the record's claim for ``who`` if nobody has it; answers whether it did."""

    def step(current: Record | None) -> Step[bool]:
        record = current or started_record(identity)
        if record.claim_id != UNCLAIMED:
            return Step(None, False)
        return Step(dataclasses.replace(record, claim_id=f"{who:032x}"), True)

    return step


def count_of(record: Record | None) -> int:
    return 0 if record is None else record.attempt - 1


def race(
    store: BlockingStore, items: Sequence[Identity], *, threads: int = 32, rounds: int = 8
) -> tuple[Counter[Identity], Counter[Identity]]:
    """``threads`` threads, let go at once, each making ``rounds`` increments and claims
    through ``apply_blocking`` over ``items`` in turn; (increments made, claims granted)
    per identity. Raises the first error a thread met."""
    made: Counter[Identity] = Counter()
    granted: Counter[Identity] = Counter()
    errors: list[BaseException] = []
    guard = threading.Lock()
    start = threading.Barrier(threads)

    def work(who: int) -> None:
        try:
            start.wait()
            for turn in range(rounds):
                identity = items[(who + turn) % len(items)]
                store.apply_blocking(identity, increment(identity))
                won = store.apply_blocking(identity, claim(identity, who))
                with guard:
                    made[identity] += 1
                    granted[identity] += won
        except BaseException as error:
            errors.append(error)
            start.abort()

    workers = [threading.Thread(target=work, args=(who,)) for who in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return made, granted


# ---------------------------------------------------------------------------- the awaited face


def awaited(function: Callable[..., Any], *args: Any) -> Any:
    """The awaited call's answer, on an event loop of its own."""

    async def call() -> Any:
        return await function(*args)

    return anyio.run(call)


def same_scans(store: Any, after: str) -> None:
    """``scan_blocking`` yields what ``scan`` does (problems by kind and text), in order,
    for a full scan, status scans, scans after a key and small batches."""

    async def scanned(options: dict[str, Any]) -> list[Scanned]:
        return [item async for item in store.scan(**options)]

    def shown(items: list[Scanned]) -> list[object]:
        return [item if isinstance(item, Record) else (type(item), str(item)) for item in items]

    for options in (
        {},
        {"status": "started"},
        {"status": "succeeded"},
        {"after": after},
        {"status": "started", "after": after, "batch": 3},
        {"batch": 1},
    ):
        blocking = list(store.scan_blocking(**options))
        assert shown(blocking) == shown(anyio.run(scanned, options)), options


# ---------------------------------------------------------------------------- closing


def holding(
    identity: Identity, entered: threading.Event, release: threading.Event
) -> StepFunction[int]:
    """``increment``, once ``release`` is set; sets ``entered`` first."""

    def step(current: Record | None) -> Step[int]:
        entered.set()
        assert release.wait(30)
        return increment(identity)(current)

    return step


def close_waits_for_the_call_under_way(store: Any, first: Identity, second: Identity) -> None:
    """``close_blocking`` waits for an ``apply_blocking`` under way in another thread,
    refuses new calls meanwhile, and every call (of either face) after it."""
    entered, release = threading.Event(), threading.Event()
    answers: list[int] = []
    step = holding(first, entered, release)
    caller = threading.Thread(target=lambda: answers.append(store.apply_blocking(first, step)))
    caller.start()
    assert entered.wait(30)
    closer = threading.Thread(target=store.close_blocking)
    closer.start()
    while not store._trips.closed:  # the close has begun
        time.sleep(0.001)
    assert closer.is_alive()  # and waits for the call under way
    with pytest.raises(StorageFailed, match="is closed"):
        store.apply_blocking(second, increment(second))
    release.set()
    caller.join()
    closer.join()
    assert answers == [0]  # the call under way finished, its write kept
    for refused in (
        lambda: store.apply_blocking(first, increment(first)),
        lambda: store.peek_blocking(first, count_of),
        lambda: list(store.scan_blocking()),
        lambda: store.setting_blocking("a", "b"),
        store.open_blocking,
        store.tally_blocking,
        store.check_blocking,
        lambda: store.ages_blocking([first]),
        lambda: awaited(store.apply, first, increment(first)),
    ):
        with pytest.raises(StorageFailed, match="is closed"):
            refused()
    store.close_blocking()  # closing twice is harmless
    awaited(store.aclose)


def a_scan_stopped_early_does_not_hold_up_closing(store: Any) -> None:
    for identity in identities(5, job="scan"):
        store.apply_blocking(identity, increment(identity))
    scan = store.scan_blocking(batch=2)
    next(scan)
    store.close_blocking()
    next(scan)  # the rest of the batch already read
    with pytest.raises(StorageFailed, match="is closed"):
        list(scan)


async def faces_racing(store: Any, items: Sequence[Identity], rounds: int) -> None:
    """Three tasks of awaited increments and three threads of blocking ones on each of
    ``items``; not one update is lost."""

    async def awaited_increments(identity: Identity) -> None:
        for _ in range(rounds):
            await store.apply(identity, increment(identity))

    def blocking_increments(identity: Identity) -> None:
        for _ in range(rounds):
            store.apply_blocking(identity, increment(identity))

    async with anyio.create_task_group() as group:
        for identity in items:
            for _ in range(3):
                group.start_soon(awaited_increments, identity)
                group.start_soon(anyio.to_thread.run_sync, blocking_increments, identity)
    for identity in items:
        assert await store.peek(identity, count_of) == 6 * rounds
