"""The SQLite store's blocking face: the same answers as the awaited calls, the same
batches, interrupts, closing, and a store opened before ``os.fork`` used in the child."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import anyio
import pytest
from _builders import started_record

from itemjournal import Identity, SQLiteStore, Step, StorageFailed
from itemjournal._model.identity import identity_digest
from itemjournal._model.records import Record
from itemjournal._stores.seam import BlockingStore


def ident(name: str) -> Identity:
    return Identity("sq", "blocking", "face", name)


def put(name: str, status: str = "started") -> Callable[[Record | None], Step[str]]:
    """A step that writes a record of ``ident(name)`` in ``status``."""

    def step(current: Record | None) -> Step[str]:
        record = started_record(ident(name))
        if status != "started":
            record = record.advance("complete", status, record.updated_at, receipt="r")
        return Step(record, name)

    return step


def increment(current: Record | None) -> Step[int]:
    """Read-modify-write: the record's ``attempt`` counts the increments (1 = none yet)."""
    assert current is not None
    return Step(dataclasses.replace(current, attempt=current.attempt + 1), current.attempt)


def claim(name: str, claimant: str) -> Callable[[Record | None], Step[bool]]:
    """An exclusive claim: granted (True) only when nobody holds the record yet."""

    def step(current: Record | None) -> Step[bool]:
        if current is not None:
            return Step(None, False)
        record = dataclasses.replace(started_record(ident(name)), claim_id=claimant)
        return Step(record, True)

    return step


def status_of(record: Record | None) -> str:
    return "absent" if record is None else record.status


class Gate:
    """A step that holds its batch (in the writer thread) until the test opens the gate."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.open = threading.Event()
        self.ran = 0

    def step(self, current: Record | None) -> Step[str]:
        self.ran += 1
        self.entered.set()
        assert self.open.wait(10)
        return Step(started_record(ident("gate")), "gate")


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "journal.db"


@pytest.fixture
def store(db: Path) -> Iterator[SQLiteStore]:
    opened = SQLiteStore(db)
    opened.open_blocking()
    yield opened
    opened.close_blocking()


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait for a state of another thread that signals nothing (a queue's length)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.0005)


@contextlib.contextmanager
def write_lock_held_elsewhere(db: Path) -> Iterator[None]:
    """Another process holding the database's write lock (``BEGIN IMMEDIATE``)."""
    script = (
        "import sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "c.execute('BEGIN IMMEDIATE')\n"
        "print('held', flush=True)\n"
        "sys.stdin.readline()\n"
        "c.execute('ROLLBACK')\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script, str(db)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdin is not None
    try:
        assert holder.stdout.readline() == "held\n"
        yield
    finally:
        holder.stdin.write("\n")
        holder.stdin.close()
        assert holder.wait(10) == 0
        holder.stdout.close()


# ---------------------------------------------------------------------- the same answers


def test_each_call_answers_as_the_awaited_one(store: SQLiteStore, db: Path) -> None:
    typed: BlockingStore = store  # the store has the whole blocking face
    assert typed.setting_blocking("digest", "sha256") == "sha256"
    assert typed.setting_blocking("digest", "blake2") == "sha256"  # the first value stands
    for n in range(7):
        assert (
            store.apply_blocking(ident(f"r{n}"), put(f"r{n}", "succeeded" if n % 2 else "started"))
            == f"r{n}"
        )
    callers: list[str] = []

    def view(record: Record | None) -> str:
        callers.append(threading.current_thread().name)
        return status_of(record)

    first = next(store.scan_blocking())
    assert isinstance(first, Record)
    first_key = identity_digest(first.identity)
    blocking = {
        "peek": [store.peek_blocking(ident(name), view) for name in ("r0", "r1", "nobody")],
        "scan": [list(store.scan_blocking())],
        "scan started": list(store.scan_blocking(status="started")),
        "scan after": list(store.scan_blocking(after=first_key, batch=2)),
        "tally": store.tally_blocking(),
        "check": store.check_blocking(),
        "setting": store.setting_blocking("digest", "other"),
    }
    ages = store.ages_blocking([ident("r0"), ident("nobody")])
    assert callers == [threading.current_thread().name] * 3  # read in the caller's thread

    async def awaited() -> tuple[dict[str, object], list[timedelta | None]]:
        return {
            "peek": [await store.peek(ident(name), status_of) for name in ("r0", "r1", "nobody")],
            "scan": [[entry async for entry in store.scan()]],
            "scan started": [entry async for entry in store.scan(status="started")],
            "scan after": [entry async for entry in store.scan(after=first_key, batch=2)],
            "tally": await store.tally(),
            "check": await store.check(),
            "setting": await store.setting("digest", "other"),
        }, await store.ages([ident("r0"), ident("nobody")])

    answers, awaited_ages = anyio.run(awaited)
    assert blocking == answers
    assert blocking["peek"] == ["started", "succeeded", "absent"]
    assert len(blocking["scan"][0]) == 7  # type: ignore[index]
    assert len(blocking["scan after"]) == 6  # type: ignore[arg-type]
    assert blocking["check"] == []
    assert ages[1] is None and awaited_ages[1] is None
    assert ages[0] is not None and awaited_ages[0] is not None
    assert ages[0].total_seconds() < 60 and awaited_ages[0].total_seconds() < 60

    store.close_blocking()
    store.close_blocking()  # twice is harmless
    for call in (
        lambda: store.apply_blocking(ident("late"), put("late")),
        lambda: store.peek_blocking(ident("r0"), status_of),
        lambda: list(store.scan_blocking()),
        lambda: store.setting_blocking("digest", "x"),
    ):
        with pytest.raises(StorageFailed, match="closed"):
            call()
    again = SQLiteStore(db)  # what the blocking face wrote, the awaited one reads
    anyio.run(again.open)
    assert anyio.run(again.peek, ident("r1"), status_of) == "succeeded"
    anyio.run(again.aclose)


def test_a_refusal_and_an_unreadable_row_are_the_callers_alone(store: SQLiteStore) -> None:
    def refuse(current: Record | None) -> Step[str]:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        store.apply_blocking(ident("x"), refuse)
    assert store.peek_blocking(ident("x"), status_of) == "absent"
    assert store.apply_blocking(ident("x"), put("x")) == "x"


# ---------------------------------------------------------------------- batches


def test_threads_lose_no_update_and_share_commits(store: SQLiteStore) -> None:
    names = [f"n{k}" for k in range(8)]
    for name in names:
        store.apply_blocking(ident(name), put(name))
    before = store.commits
    rounds, threads = 10, 32
    start = threading.Barrier(threads)
    granted: list[tuple[int, str]] = []
    failures: list[BaseException] = []

    def work(t: int) -> None:
        try:
            start.wait()
            for _ in range(rounds):
                store.apply_blocking(ident(names[t % 8]), increment)
            if store.apply_blocking(
                ident(f"claim-{t % 8}"), claim(f"claim-{t % 8}", f"thread-{t}")
            ):
                granted.append((t % 8, f"thread-{t}"))
        except BaseException as error:  # pragma: no cover - reported below
            failures.append(error)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert failures == []
    operations = threads * (rounds + 1)
    commits = store.commits - before
    print(f"\n{operations} blocking operations from {threads} threads in {commits} commits")
    assert commits < operations  # batched: fewer commits than operations
    for name in names:  # every increment of the 4 threads on each identity
        assert store.peek_blocking(ident(name), lambda r: r and r.attempt) == 1 + 4 * rounds
    assert sorted(slot for slot, _ in granted) == list(range(8))  # one claim per identity
    for slot, claimant in granted:
        record = store.peek_blocking(ident(f"claim-{slot}"), lambda r: r)
        assert record is not None and record.claim_id == claimant


def test_queued_threads_are_one_batch(store: SQLiteStore) -> None:
    gate = Gate()
    holder = threading.Thread(target=store.apply_blocking, args=(ident("gate"), gate.step))
    holder.start()
    assert gate.entered.wait(10)  # the writer is inside the first batch
    before = store.commits
    answers: list[str] = []
    callers = [
        threading.Thread(
            target=lambda n=n: answers.append(store.apply_blocking(ident(f"q{n}"), put(f"q{n}")))
        )
        for n in range(32)
    ]
    for caller in callers:
        caller.start()
    wait_until(lambda: len(store._queue) == 32)
    gate.open.set()
    for thread in [holder, *callers]:
        thread.join()
    assert sorted(answers) == sorted(f"q{n}" for n in range(32))
    assert store.commits - before == 2  # the gate's batch, then all 32 in one


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_awaiting_and_blocking_callers_share_a_batch(store: SQLiteStore, backend: str) -> None:
    gate = Gate()
    holder = threading.Thread(target=store.apply_blocking, args=(ident("gate"), gate.step))
    holder.start()
    assert gate.entered.wait(10)
    before = store.commits
    answers: list[str] = []
    threads = [
        threading.Thread(
            target=lambda n=n: answers.append(store.apply_blocking(ident(f"b{n}"), put(f"b{n}")))
        )
        for n in range(8)
    ]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(store._queue) == 8)

    async def awaiting() -> None:
        async def one(n: int) -> None:
            answers.append(await store.apply(ident(f"a{n}"), put(f"a{n}")))

        async with anyio.create_task_group() as tg:
            for n in range(8):
                tg.start_soon(one, n)
            await anyio.wait_all_tasks_blocked()
            assert len(store._queue) == 16  # both kinds wait in the one queue
            gate.open.set()

    anyio.run(awaiting, backend=backend)
    for thread in [holder, *threads]:
        thread.join()
    assert sorted(answers) == sorted([f"a{n}" for n in range(8)] + [f"b{n}" for n in range(8)])
    assert store.commits - before == 2  # the gate's batch, then one for all sixteen


# ------------------------------------------------------------- a lone write, in its thread


def ran_in(threads: list[threading.Thread], name: str) -> Callable[[Record | None], Step[str]]:
    """``put(name)``, noting the thread the step ran in."""

    def step(current: Record | None) -> Step[str]:
        threads.append(threading.current_thread())
        return put(name)(current)

    return step


def test_a_lone_write_runs_in_its_callers_thread_outside_the_main_thread(
    store: SQLiteStore,
) -> None:
    seen: list[threading.Thread] = []
    caller = threading.Thread(target=store.apply_blocking, args=(ident("t"), ran_in(seen, "t")))
    caller.start()
    caller.join(10)
    store.apply_blocking(ident("m"), ran_in(seen, "m"))  # the main thread: the writer's
    assert seen[0] is caller
    assert seen[1] is not threading.main_thread()
    assert seen[1].name.startswith("itemjournal writer")
    assert store.peek_blocking(ident("t"), status_of) == "started"
    assert store.peek_blocking(ident("m"), status_of) == "started"


def test_a_lone_write_that_finds_the_write_lock_taken_waits_in_the_queue(db: Path) -> None:
    store = SQLiteStore(db, busy_timeout=10)
    store.open_blocking()
    seen: list[threading.Thread] = []
    answers: list[str] = []
    with write_lock_held_elsewhere(db):
        caller = threading.Thread(
            target=lambda: answers.append(store.apply_blocking(ident("w"), ran_in(seen, "w")))
        )
        caller.start()
        wait_until(lambda: store._thread is not None)  # sent to the queue's thread
        time.sleep(0.05)
        assert answers == [] and caller.is_alive()
    caller.join(10)
    assert answers == ["w"]
    assert [thread.name.startswith("itemjournal writer") for thread in seen][-1]
    store.close_blocking()


@pytest.mark.parametrize("closing", ["blocking", "awaited"])
def test_close_waits_for_a_lone_write(db: Path, closing: str) -> None:
    store = SQLiteStore(db)
    store.open_blocking()
    gate = Gate()
    outcome: list[str] = []
    holder = threading.Thread(
        target=lambda: outcome.append(store.apply_blocking(ident("gate"), gate.step))
    )
    holder.start()
    assert gate.entered.wait(10)
    assert store._thread is None  # no writer thread: the holder runs its write alone
    close = store.close_blocking if closing == "blocking" else lambda: anyio.run(store.aclose)
    closer = threading.Thread(target=close)
    closer.start()
    wait_until(lambda: store._closed)
    time.sleep(0.05)
    assert closer.is_alive()  # still waiting for the lone write
    gate.open.set()
    for thread in (holder, closer):
        thread.join(10)
        assert not thread.is_alive()
    assert outcome == ["gate"]
    reopened = SQLiteStore(db)
    reopened.open_blocking()
    assert reopened.peek_blocking(ident("gate"), status_of) == "started"
    reopened.close_blocking()


# ---------------------------------------------------------------------- locks, closing


def test_another_process_write_lock_times_out(db: Path) -> None:
    store = SQLiteStore(db, busy_timeout=0.3)
    store.open_blocking()
    ran: list[str] = []

    def step(current: Record | None) -> Step[str]:
        ran.append("ran")
        return put("late")(current)

    with write_lock_held_elsewhere(db):
        started = time.monotonic()
        with pytest.raises(StorageFailed) as caught:
            store.apply_blocking(ident("late"), step)
        waited = time.monotonic() - started
        assert store.peek_blocking(ident("late"), status_of) == "absent"  # reads go on
    assert caught.value.errno == errno.ETIMEDOUT
    assert waited >= 0.3
    assert ran == []
    assert store.apply_blocking(ident("late"), step) == "late"
    store.close_blocking()


def test_open_blocking_waits_for_another_process_then_times_out(tmp_path: Path) -> None:
    db = tmp_path / "new.db"
    maker = SQLiteStore(db)
    maker.open_blocking()
    maker.close_blocking()
    with write_lock_held_elsewhere(db):  # opening needs no write lock on a made database
        store = SQLiteStore(db, busy_timeout=0.2)
        store.open_blocking()
        store.close_blocking()


def test_close_waits_for_blocking_and_awaited_calls(store: SQLiteStore) -> None:
    gate = Gate()
    outcome: list[str] = []
    holder = threading.Thread(
        target=lambda: outcome.append(store.apply_blocking(ident("gate"), gate.step))
    )
    holder.start()
    assert gate.entered.wait(10)
    queued = threading.Thread(
        target=lambda: outcome.append(store.apply_blocking(ident("queued"), put("queued")))
    )
    queued.start()
    wait_until(lambda: len(store._queue) == 1)
    closer = threading.Thread(target=lambda: anyio.run(store.aclose))  # the awaited close
    closer.start()
    wait_until(lambda: store._closed)
    with pytest.raises(StorageFailed, match="closed"):
        store.apply_blocking(ident("refused"), put("refused"))
    assert closer.is_alive()  # still waiting for the batch and the queue
    gate.open.set()
    for thread in (holder, queued, closer):
        thread.join(10)
        assert not thread.is_alive()
    assert outcome == ["gate", "queued"]  # both done before the connections closed
    assert store._writer is None and store._idle_readers == []


def test_close_blocking_waits_for_awaited_calls(db: Path) -> None:
    store = SQLiteStore(db)
    store.open_blocking()
    gate = Gate()
    outcome: list[str] = []

    async def awaited() -> None:
        outcome.append(await store.apply(ident("gate"), gate.step))

    caller = threading.Thread(target=lambda: anyio.run(awaited))
    caller.start()
    assert gate.entered.wait(10)
    closer = threading.Thread(target=store.close_blocking)
    closer.start()
    wait_until(lambda: store._closed)
    assert closer.is_alive()
    gate.open.set()
    for thread in (caller, closer):
        thread.join(10)
        assert not thread.is_alive()
    assert outcome == ["gate"]
    assert store._writer is None


def test_closing_while_many_calls_are_in_flight(store: SQLiteStore) -> None:
    outcomes: list[str] = []
    start = threading.Barrier(17)

    def call(n: int) -> None:
        start.wait()
        for k in range(50):
            try:
                if n % 2:
                    store.peek_blocking(ident(f"c{n}"), status_of)
                else:
                    store.apply_blocking(ident(f"c{n}-{k}"), put(f"c{n}-{k}"))
            except StorageFailed as error:
                assert "closed" in str(error)
                outcomes.append("refused")
                return
            outcomes.append("done")

    threads = [threading.Thread(target=call, args=(n,)) for n in range(16)]
    for thread in threads:
        thread.start()
    start.wait()
    wait_until(lambda: "done" in outcomes)
    store.close_blocking()
    for thread in threads:
        thread.join()
    assert "done" in outcomes
    assert store._writer is None and store._idle_readers == [] and store._reading == 0
    with sqlite3.connect(store.path) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)


# ---------------------------------------------------------------------- interrupts


@contextlib.contextmanager
def interrupts() -> Iterator[Callable[[], None]]:
    """Python's own SIGINT handler in this (main) thread, and a function that interrupts
    it from another thread, as a Ctrl-C would."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    main = threading.main_thread().ident
    assert main is not None
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield lambda: signal.pthread_kill(main, signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_interrupted_waiter_leaves_the_queue_and_never_runs(db: Path) -> None:
    store = SQLiteStore(db, busy_timeout=30)
    store.open_blocking()
    ran: list[str] = []

    def step(current: Record | None) -> Step[str]:
        ran.append("ran")
        return put("never")(current)

    retrying = threading.Event()  # the writer found the lock taken, and tries again
    tries: list[str] = []

    def trace(statement: str) -> None:
        if statement == "BEGIN IMMEDIATE":
            tries.append(statement)
            if len(tries) == 2:
                retrying.set()

    assert store._writer is not None
    store._writer.set_trace_callback(trace)
    with interrupts() as interrupt, write_lock_held_elsewhere(db):
        helper = threading.Thread(target=lambda: (retrying.wait(10), interrupt()))
        helper.start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            store.apply_blocking(ident("never"), step)
        assert time.monotonic() - started < 10  # long before the lock's timeout
        helper.join()
        wait_until(lambda: not store._writing)  # out of the queue, or failed by its batch
    assert ran == []
    assert store.peek_blocking(ident("never"), status_of) == "absent"
    assert store.apply_blocking(ident("after"), put("after")) == "after"  # the queue works
    assert ran == []
    store.close_blocking()


def test_an_interrupt_inside_a_running_batch_waits_for_it(store: SQLiteStore) -> None:
    gate = Gate()
    settled: list[bool] = []

    def interrupt_twice_then_open(interrupt: Callable[[], None]) -> None:
        assert gate.entered.wait(10)
        interrupt()
        time.sleep(0.05)
        interrupt()  # a second Ctrl-C: ignored while the batch settles
        time.sleep(0.05)
        gate.open.set()

    with interrupts() as interrupt:
        helper = threading.Thread(target=interrupt_twice_then_open, args=(interrupt,))
        helper.start()
        with pytest.raises(KeyboardInterrupt):
            store.apply_blocking(ident("gate"), gate.step)
        settled.append(gate.open.is_set())
        helper.join()
    assert settled == [True]  # raised only once the batch was done
    assert gate.ran == 1
    assert store.peek_blocking(ident("gate"), status_of) == "started"  # and its write stands
    assert store.apply_blocking(ident("after"), put("after")) == "after"


# ---------------------------------------------------------------------- fork


def child_work(store: SQLiteStore, ready: int, go: int, done: int) -> None:
    """In the forked child: write through both faces, see the parent's rows, write more
    after the parent has closed its store, and check the database."""
    for n in range(10):
        store.apply_blocking(ident(f"child-{n}"), put(f"child-{n}"))

    async def awaited() -> None:
        for n in range(10, 20):
            await store.apply(ident(f"child-{n}"), put(f"child-{n}"))

    anyio.run(awaited)
    os.write(ready, b"x")
    assert os.read(go, 1) == b"x"  # the parent wrote its rows and closed its store
    for n in range(10):
        assert store.peek_blocking(ident(f"parent-{n}"), status_of) == "started"
    for n in range(20, 30):
        store.apply_blocking(ident(f"child-{n}"), put(f"child-{n}"))
    assert store.check_blocking() == []
    store.close_blocking()
    os.write(done, b"x")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_store_opened_before_fork_works_in_the_child(store: SQLiteStore) -> None:
    store.apply_blocking(ident("before"), put("before"))
    stop = threading.Event()
    busy: list[int] = []

    def keep_writing() -> None:  # a batch may be under way as the fork comes
        n = 0
        while not stop.is_set():
            store.apply_blocking(ident(f"busy-{n % 5}"), put(f"busy-{n % 5}"))
            n += 1
        busy.append(n)

    writer = threading.Thread(target=keep_writing)
    writer.start()
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - measured in the child, not here
            code = 1
            try:
                child_work(store, ready_w, go_r, done_w)
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        for n in range(10):  # concurrently with the child's writes
            store.apply_blocking(ident(f"parent-{n}"), put(f"parent-{n}"))
        stop.set()
        writer.join()
        assert os.read(ready_r, 1) == b"x"
        for n in range(20):
            assert store.peek_blocking(ident(f"child-{n}"), status_of) == "started"
        store.close_blocking()  # the parent's last connection closes while the child works
        os.write(go_w, b"x")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.read(done_r, 1) == b"x"
    finally:
        stop.set()
        for fd in (ready_r, ready_w, go_r, go_w, done_r, done_w):
            os.close(fd)
    assert busy and busy[0] > 0
    reopened = SQLiteStore(store.path)
    reopened.open_blocking()
    for name in ["before", *(f"child-{n}" for n in range(30)), *(f"parent-{n}" for n in range(10))]:
        assert reopened.peek_blocking(ident(name), status_of) == "started", name
    assert reopened.check_blocking() == []
    reopened.close_blocking()
    with sqlite3.connect(store.path) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchone() == ("ok",)
