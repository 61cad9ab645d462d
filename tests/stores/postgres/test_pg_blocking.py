"""The PostgreSQL store's blocking face (``BlockingStore``) against a real server: each
call answers as its awaited twin does; many threads at once lose no update and grant one
claim per identity; callers beyond the pool wait for it, at most ``lock_timeout``; close
waits for the calls under way; and a store opened before a fork works in the child on
connections and an owner session of the child's own, leaving the parent's alone.

The server is the one ``ITEMJOURNAL_TEST_POSTGRES`` names; without it every test here is
skipped with that reason. Each test works in a schema of its own, dropped afterwards.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import json
import os
import secrets
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest
from _builders import NOW, started_record
from conftest import postgres_schema

from itemjournal import Identity, InvalidArgument, StorageFailed
from itemjournal._model.identity import identity_digest
from itemjournal._model.records import Record
from itemjournal._stores.postgres.store import PostgresStore
from itemjournal._stores.seam import BlockingStore, Step, StepFunction


def ident(job: str, item: str = "-") -> Identity:
    return Identity("pg", "blocking", job, item)


@pytest.fixture
def location() -> Iterator[str]:
    with postgres_schema() as location:
        yield location


def opened(location: str, **options: Any) -> PostgresStore:
    store = PostgresStore(location, **options)
    store.open_blocking()
    return store


def keep(record: Record | None) -> Record | None:
    return record


def claim_of(store: PostgresStore, identity: Identity) -> Record:
    """A ``started`` record of ``identity`` owned by ``store``'s owner session, as a
    journal's ``begin`` makes it (a fresh claim id)."""
    record = started_record(identity, store.owner())
    return dataclasses.replace(record, claim_id=secrets.token_hex(16))


def bump(store: PostgresStore, identity: Identity) -> StepFunction[int]:
    """A read-modify-write step: the record's ``attempt`` plus one (a new claim at 1)."""

    def step(current: Record | None) -> Step[int]:
        if current is None:
            return Step(claim_of(store, identity), 1)
        return Step(dataclasses.replace(current, attempt=current.attempt + 1), current.attempt + 1)

    return step


def claim_once(store: PostgresStore, identity: Identity) -> StepFunction[str | None]:
    """An exclusive claim: a new record when there is none (answering its claim id),
    nothing otherwise (None)."""

    def step(current: Record | None) -> Step[str | None]:
        if current is not None:
            return Step(None, None)
        record = claim_of(store, identity)
        return Step(record, record.claim_id)

    return step


def complete(current: Record | None) -> Step[str]:
    """A step that completes a started record (writes nothing on an absent one)."""
    done = None if current is None else current.advance("complete", "succeeded", NOW, receipt="r")
    return Step(done, "done")


def run_threads(count: int, work: Callable[[int], object]) -> list[object]:
    """``work(0)`` … ``work(count - 1)``, each in a thread of its own, started together;
    their answers, or the exceptions they raised."""
    answers: list[object] = [None] * count
    start = threading.Barrier(count)

    def run(index: int) -> None:
        start.wait()
        try:
            answers[index] = work(index)
        except BaseException as error:  # reported by the test, not lost in the thread
            answers[index] = error

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()
    return answers


# ---------------------------------------------------------------------- each call


def test_the_store_is_a_blocking_store(location: str) -> None:
    store: BlockingStore = PostgresStore(location)
    assert callable(store.apply_blocking)


def test_each_blocking_call_answers_as_its_awaited_twin(location: str) -> None:
    store = opened(location)
    assert store.setting_blocking("kind", "first") == "first"
    assert store.setting_blocking("kind", "second") == "first"
    assert anyio.run(store.setting, "kind", "third") == "first"

    identities = [ident("each", str(number)) for number in range(7)]
    for identity in identities:
        assert store.apply_blocking(identity, bump(store, identity)) == 1
    assert store.apply_blocking(identities[0], bump(store, identities[0])) == 2
    assert store.apply_blocking(identities[1], complete) == "done"

    for identity in [*identities, ident("each", "absent")]:
        assert store.peek_blocking(identity, keep) == anyio.run(store.peek, identity, keep)
    assert store.peek_blocking(identities[0], keep).attempt == 2  # type: ignore[union-attr]
    assert store.peek_blocking(ident("each", "absent"), keep) is None

    async def scanned(**options: Any) -> list[object]:
        return [item async for item in store.scan(**options)]

    for options in (
        {},
        {"batch": 2},
        {"status": "started", "batch": 3},
        {"status": "succeeded"},
        {"status": "released"},
    ):
        assert list(store.scan_blocking(**options)) == anyio.run(
            lambda given=options: scanned(**given)
        )
    everything = list(store.scan_blocking(batch=2))
    assert len(everything) == len(identities)
    middle = everything[3]
    assert isinstance(middle, Record)
    after = store.apply_blocking(middle.identity, lambda current: Step(None, None))
    assert after is None
    key = identity_digest(middle.identity)
    assert list(store.scan_blocking(after=key, batch=2)) == everything[4:]
    with pytest.raises(InvalidArgument):
        next(store.scan_blocking(status="nonsense"))

    tally = store.tally_blocking()
    assert tally == anyio.run(store.tally)
    assert tally.counts["started"] == 6 and tally.counts["succeeded"] == 1
    assert store.check_blocking() == anyio.run(store.check) == []
    asked = [*identities[:2], ident("each", "absent")]
    ages = store.ages_blocking(asked)
    assert [age is None for age in ages] == [False, False, True]
    assert [age is None for age in anyio.run(store.ages, asked)] == [False, False, True]
    assert store.ages_blocking([]) == []

    store.close_blocking()
    store.close_blocking()  # harmless
    with pytest.raises(StorageFailed, match="closed"):
        store.peek_blocking(identities[0], keep)
    with pytest.raises(StorageFailed, match="closed"):
        list(store.scan_blocking())


# ---------------------------------------------------------------------- many threads


def test_many_threads_lose_no_update_and_grant_one_claim_per_identity(location: str) -> None:
    store = opened(location)
    counted = [ident("count", str(number)) for number in range(8)]
    claimed = [ident("claim", str(number)) for number in range(8)]
    rounds = 10

    def work(index: int) -> tuple[list[int], str | None]:
        identity = counted[index % 8]
        bumps = [store.apply_blocking(identity, bump(store, identity)) for _ in range(rounds)]
        target = claimed[index % 8]
        return bumps, store.apply_blocking(target, claim_once(store, target))

    answers = run_threads(32, work)
    errors = [answer for answer in answers if isinstance(answer, BaseException)]
    assert not errors, errors
    # Every read-modify-write saw the one before it: each identity's 4 threads x 10 rounds
    # answered each count from 1 to 40 exactly once.
    for number, identity in enumerate(counted):
        seen = sorted(
            bump_answer
            for index, answer in enumerate(answers)
            if index % 8 == number
            for bump_answer in answer[0]  # type: ignore[index]
        )
        assert seen == list(range(1, 4 * rounds + 1))
        assert store.peek_blocking(identity, keep).attempt == 4 * rounds  # type: ignore[union-attr]
    # One claim per identity, and the stored record is the winner's.
    for number, identity in enumerate(claimed):
        granted = [
            answer[1]  # type: ignore[index]
            for index, answer in enumerate(answers)
            if index % 8 == number and answer[1] is not None  # type: ignore[index]
        ]
        assert len(granted) == 1
        assert store.peek_blocking(identity, keep).claim_id == granted[0]  # type: ignore[union-attr]
    store.close_blocking()


def test_callers_beyond_the_pool_wait_for_it_and_all_get_served(location: str) -> None:
    store = opened(f"{location}&pool_size=2")
    inside = 0
    most = 0
    counting = threading.Lock()
    # Only as many steps run at once as there are pooled connections, and each waits for
    # another: twelve callers get served two by two.
    pairs = threading.Barrier(2, timeout=30)

    def step(current: Record | None) -> Step[int]:
        nonlocal inside, most
        with counting:
            inside += 1
            most = max(most, inside)
        pairs.wait()
        with counting:
            inside -= 1
        return Step(None, 1)

    answers = run_threads(12, lambda index: store.apply_blocking(ident("pool", str(index)), step))
    assert answers == [1] * 12
    assert most == 2
    store.close_blocking()


def test_callers_waiting_for_the_pool_are_served_in_the_order_they_came(location: str) -> None:
    store = opened(f"{location}&pool_size=1")
    pool = store._pool
    assert pool is not None
    served: list[str] = []

    def step(name: str) -> StepFunction[None]:
        def run(current: Record | None) -> Step[None]:
            served.append(name)
            return Step(None, None)

        return run

    def queued() -> int:
        return pool.get_stats().get("requests_queued", 0)

    def wait_until_queued(count: int) -> None:
        deadline = time.monotonic() + 30
        while queued() < count:
            assert time.monotonic() < deadline
            time.sleep(0.001)

    held = pool.getconn()
    callers = []
    for name in ("first", "second"):
        caller = threading.Thread(
            target=store.apply_blocking, args=(ident("order", name), step(name))
        )
        caller.start()
        callers.append(caller)
        wait_until_queued(len(callers))
    # Longer than an awaited trip's slice of waiting: each blocking caller waits in one
    # piece, in its place in the pool's queue, never queued again behind a later one.
    time.sleep(0.2)
    assert queued() == 2
    pool.putconn(held)
    for caller in callers:
        caller.join(30)
    assert served == ["first", "second"]
    store.close_blocking()


def test_a_caller_waits_for_a_pooled_connection_at_most_lock_timeout(location: str) -> None:
    store = opened(f"{location}&pool_size=1", lock_timeout=0.5)
    pool = store._pool
    assert pool is not None
    held = pool.getconn()
    try:
        for call in (
            lambda: store.peek_blocking(ident("busy"), keep),
            lambda: store.apply_blocking(ident("busy"), lambda current: Step(None, None)),
        ):
            began = time.monotonic()
            with pytest.raises(StorageFailed) as failed:
                call()
            waited = time.monotonic() - began
            assert 0.45 <= waited < 5
            assert failed.value.code == "STORAGE_FAILED"
            assert failed.value.errno == errno.ETIMEDOUT
            assert "no connection to" in str(failed.value) and "pool_size=1" in str(failed.value)
    finally:
        pool.putconn(held)
    assert store.peek_blocking(ident("busy"), keep) is None  # served once one is free
    store.close_blocking()


# ---------------------------------------------------------------------- close


def test_close_waits_for_the_calls_under_way_and_refuses_later_ones(location: str) -> None:
    store = opened(location)
    identity = ident("close")
    in_step = threading.Event()
    let_go = threading.Event()

    def slow(current: Record | None) -> Step[str]:
        in_step.set()
        assert let_go.wait(30)
        return Step(claim_of(store, identity), "written")

    answers: list[object] = []
    writer = threading.Thread(target=lambda: answers.append(store.apply_blocking(identity, slow)))
    writer.start()
    assert in_step.wait(30)
    closer = threading.Thread(target=store.close_blocking)
    closer.start()
    deadline = time.monotonic() + 30
    while not store._trips.closed:  # close has begun: it refuses new calls at once
        assert time.monotonic() < deadline
        time.sleep(0.001)
    with pytest.raises(StorageFailed, match="closed"):
        store.peek_blocking(identity, keep)
    with pytest.raises(StorageFailed, match="closed"):
        store.apply_blocking(identity, slow)
    closer.join(0.2)
    assert closer.is_alive()  # still waiting for the write under way
    let_go.set()
    writer.join(30)
    closer.join(30)
    assert not closer.is_alive()
    assert answers == ["written"]

    again = opened(location)
    found = again.peek_blocking(identity, keep)
    assert found is not None and found.status == "started"
    again.close_blocking()


# ---------------------------------------------------------------------- fork


def _in_child(store: PostgresStore, mine: Record, theirs: Identity) -> dict[str, object]:
    """What the forked child does with the store its parent opened."""
    owner = store.owner()
    written = store.apply_blocking(theirs, claim_once(store, theirs))
    found = store.peek_blocking(theirs, keep)
    assert found is not None and found.claim_id == written
    seen = anyio.run(store.peek, mine.identity, keep)  # the awaited face works here too
    assert seen == mine
    answer = {
        "pid": os.getpid(),
        "session": owner.session,
        "session_pid": None if store._session is None else store._session.pid,
        "parent_alive": store.owner_alive(mine.owner),
        "own_alive": store.owner_alive(found.owner),
    }
    store.close_blocking()
    gc.collect()  # nothing inherited is finalised (and so closed) in the child either
    return answer


def test_a_forked_child_works_on_its_own_sessions_and_leaves_the_parents_alone(
    location: str,
) -> None:
    store = opened(location)
    mine, theirs = ident("fork", "parent"), ident("fork", "child")
    granted = store.apply_blocking(mine, claim_once(store, mine))
    record = store.peek_blocking(mine, keep)
    assert record is not None and record.claim_id == granted and record.owner is not None
    parent_session = store._session
    assert parent_session is not None and record.owner.session == parent_session.name

    reading, writing = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        try:
            os.close(reading)
            try:
                answer: dict[str, object] = _in_child(store, record, theirs)
            except BaseException:
                answer = {"error": traceback.format_exc()}
            os.write(writing, json.dumps(answer).encode())
        finally:
            os._exit(0)
    os.close(writing)
    with os.fdopen(reading, "rb") as pipe:
        answer = json.loads(pipe.read() or b"{}")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert "error" not in answer, answer.get("error")

    # The child claimed through an owner session of its own, in its own name.
    assert answer["pid"] == pid
    assert answer["session"] != parent_session.name
    assert answer["session_pid"] != parent_session.pid
    assert answer["parent_alive"] is True and answer["own_alive"] is True
    child = store.peek_blocking(theirs, keep)
    assert child is not None and child.owner is not None
    assert child.owner.pid == pid and child.owner.session == answer["session"]
    assert store.owner_alive(child.owner) is False  # its session ended with the child's close

    # The parent's owner session lives on, still holds its lock, and vouches for its claim.
    assert store._session is parent_session
    with store._connections.connection() as connection:
        row = connection.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (parent_session.pid,)
        ).fetchone()
        assert row == (1,)
        locks = connection.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s AND granted",
            (parent_session.pid,),
        ).fetchone()
        assert locks is not None and locks[0] >= 1
    assert store.owner_alive(record.owner) is True

    # And the parent keeps working, on its pooled connections and its owner session.
    assert store.apply_blocking(mine, complete) == "done"
    assert anyio.run(store.peek, mine, keep).status == "succeeded"  # type: ignore[union-attr]
    assert store.apply_blocking(ident("fork", "after"), claim_once(store, ident("fork", "after")))
    assert store._session is parent_session
    store.close_blocking()


def test_a_store_closed_before_the_fork_stays_closed_in_the_child(location: str) -> None:
    store = opened(location)
    store.close_blocking()
    reading, writing = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(reading)
            try:
                store.peek_blocking(ident("closed"), keep)
                answer = "served"
            except StorageFailed as error:
                answer = "refused" if "closed" in str(error) else repr(error)
            except BaseException:
                answer = traceback.format_exc()
            os.write(writing, answer.encode())
        finally:
            os._exit(0)
    os.close(writing)
    with os.fdopen(reading, "rb") as pipe:
        answer = pipe.read().decode()
    os.waitpid(pid, 0)
    assert answer == "refused"


def test_starting_over_as_a_child_would_makes_a_pool_and_session_of_its_own(
    location: str,
) -> None:
    """What the fork hook does in a child, done here in the test's process (where coverage
    sees it): the store starts over with parts none of which is connected, connects at its
    first use, and vouches for its next claim with an owner session of its own; the parts
    it had are left alone, still working, until their owner closes them."""
    store = opened(location)
    first = claim_of(store, ident("over", "a"))
    store.apply_blocking(ident("over", "a"), lambda current: Step(first, None))
    old_session = first.owner.session if first.owner is not None else None
    inherited = store._start_over()
    try:
        assert isinstance(inherited, tuple)
        assert store._pool is None  # nothing connected until the first use
        second = claim_of(store, ident("over", "b"))
        store.apply_blocking(ident("over", "b"), lambda current: Step(second, None))
        assert second.owner is not None and second.owner.session != old_session
        assert store.peek_blocking(ident("over", "a"), keep) == first  # still readable
        assert store.owner_alive(first.owner) is True  # the old session was never closed
    finally:
        store.close_blocking()
        _trips, old_connections, old_lock, _commits, _step = inherited
        old_lock.close()
        pool = old_connections.detach()
        if pool is not None:
            pool.close()


def test_a_store_closed_before_starting_over_stays_closed(location: str) -> None:
    store = opened(location)
    store.close_blocking()
    store._start_over()
    with pytest.raises(StorageFailed):
        store.peek_blocking(ident("closed"), keep)
