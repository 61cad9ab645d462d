"""The SQLite store: group commit, isolation of refusals, foreign and corrupt files."""

from __future__ import annotations

import errno
import sqlite3
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
from _builders import started_record

from itemjournal import (
    Claim,
    ConflictError,
    Identity,
    InvalidArgument,
    Journal,
    RecordInvalid,
    RecordView,
    SQLiteStore,
    Step,
    StorageFailed,
    definition_digest,
)
from itemjournal._model.identity import identity_digest
from itemjournal._model.records import Record
from itemjournal._stores.sqlite import writer as writer_module
from itemjournal._stores.sqlite.operation import _Operation
from itemjournal._stores.sqlite.reads import _FIRST, _page_queries
from itemjournal._stores.sqlite.schema import SCHEMA_VERSION

pytestmark = pytest.mark.anyio

DEFINITION = definition_digest("sqlite-v1")
INPUTS = {"n": "1"}


def item(n: int) -> tuple[str, str, str, str]:
    return ("sq", "group", "commit", f"item-{n}")


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "journal.db"


async def open_journal(db: Path) -> tuple[SQLiteStore, Journal]:
    journal = await Journal.open(f"sqlite://{db}")
    store = journal.store
    assert isinstance(store, SQLiteStore)
    return store, journal


def count_commits(store: SQLiteStore) -> list[str]:
    """Trace the writer connection's statements (SQLite's own account of them)."""
    statements: list[str] = []
    assert store._writer is not None
    store._writer.set_trace_callback(statements.append)
    return statements


async def test_concurrent_cycles_share_commits(db: Path) -> None:
    store, journal = await open_journal(db)
    statements = count_commits(store)
    before = store.commits
    answers: dict[int, tuple[Claim, RecordView]] = {}

    async def cycle(n: int) -> None:
        claim = await journal.begin(item(n), {"n": str(n)}, DEFINITION)
        assert isinstance(claim, Claim)
        answers[n] = (claim, await journal.complete(claim, f"receipt-{n}"))

    async with anyio.create_task_group() as tg:
        for n in range(64):
            tg.start_soon(cycle, n)
    commits = statements.count("COMMIT")
    print(f"\n64 begin+complete cycles (128 writes) in {commits} commits")
    assert commits == store.commits - before
    assert commits <= 128 // 4  # well below one per operation
    for n, (claim, view) in answers.items():  # every caller got exactly its own answer
        assert claim.identity.item == f"item-{n}"
        assert view.identity == claim.identity
        assert view.receipt == f"receipt-{n}"
        assert (await journal.inspect(item(n))).receipt == f"receipt-{n}"


async def test_a_lone_operation_commits_at_once(db: Path) -> None:
    store, journal = await open_journal(db)
    statements = count_commits(store)
    claim = await journal.begin(item(1), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    assert statements.count("BEGIN IMMEDIATE") == statements.count("COMMIT") == 1


async def test_refusals_do_not_undo_their_batch_neighbours(db: Path) -> None:
    store, journal = await open_journal(db)
    for n in range(0, 64, 2):  # even items are already started: their begin is refused
        await journal.begin(item(n), INPUTS, DEFINITION)
    statements = count_commits(store)
    outcomes: dict[int, str] = {}

    async def begin(n: int) -> None:
        try:
            outcome = await journal.begin(item(n), INPUTS, DEFINITION)
        except ConflictError as error:
            outcomes[n] = error.code
        else:
            outcomes[n] = type(outcome).__name__

    async with anyio.create_task_group() as tg:
        for n in range(64):
            tg.start_soon(begin, n)
    assert statements.count("COMMIT") < 32  # refusals and claims did share transactions
    assert "ROLLBACK" not in statements
    for n in range(64):
        assert outcomes[n] == ("IN_PROGRESS" if n % 2 == 0 else "Claim")
        assert (await journal.inspect(item(n))).status == "started"


async def test_a_failed_write_acknowledges_nothing(db: Path) -> None:
    _, journal = await open_journal(db)
    first = await journal.begin(item(0), INPUTS, DEFINITION)
    assert isinstance(first, Claim)
    with sqlite3.connect(db) as connection:  # make every write of a record fail in SQLite
        for event in ("INSERT", "UPDATE"):
            connection.execute(
                f"CREATE TRIGGER refuse_{event.lower()} BEFORE {event} ON itemjournal_records "
                "BEGIN SELECT RAISE(ABORT, 'injected failure'); END"
            )
    with pytest.raises(StorageFailed) as caught:
        await journal.begin(item(1), INPUTS, DEFINITION)
    assert isinstance(caught.value.__cause__, sqlite3.Error)
    with pytest.raises(ConflictError):  # a refusal writes nothing, so it is still a refusal
        await journal.begin(item(0), INPUTS, DEFINITION)
    with pytest.raises(StorageFailed):
        await journal.complete(first, "r")
    with sqlite3.connect(db) as connection:
        connection.execute("DROP TRIGGER refuse_insert")
        connection.execute("DROP TRIGGER refuse_update")
    assert (await journal.inspect(item(1))).status == "absent"
    assert (await journal.inspect(item(0))).status == "started"
    assert (await journal.complete(first, "r")).status == "succeeded"


async def test_a_write_lock_that_cannot_be_had(db: Path) -> None:
    store, journal = await open_journal(db)
    assert store._writer is not None
    store._writer.execute("PRAGMA query_only = 1")
    with pytest.raises(StorageFailed, match="cannot start a write transaction"):
        await journal.begin(item(1), INPUTS, DEFINITION)
    store._writer.execute("PRAGMA query_only = 0")
    assert isinstance(await journal.begin(item(1), INPUTS, DEFINITION), Claim)


async def test_cancelled_waiters_never_run(db: Path) -> None:
    store, journal = await open_journal(db)
    statements = count_commits(store)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await journal.begin(item(0), INPUTS, DEFINITION)
    assert statements == []
    async with anyio.create_task_group() as tg:
        for n in range(16):
            tg.start_soon(journal.begin, item(n), INPUTS, DEFINITION)
        await anyio.lowlevel.checkpoint()
        tg.cancel_scope.cancel()
    claimed = [n for n in range(16) if (await journal.inspect(item(n))).status == "started"]
    # whatever was cancelled before its batch ran left nothing; the rest is durable
    for n in set(range(16)) - set(claimed):
        assert (await journal.inspect(item(n))).status == "absent"
    for n in range(16, 20):  # and the queue still works afterwards
        assert isinstance(await journal.begin(item(n), INPUTS, DEFINITION), Claim)


async def test_the_same_document_as_the_file_store(db: Path) -> None:
    _, journal = await open_journal(db)
    claim = await journal.begin(item(1), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    with sqlite3.connect(db) as connection:
        digest, status, document = connection.execute(
            "SELECT digest, status, document FROM itemjournal_records"
        ).fetchone()
    assert digest == identity_digest(claim.identity) == claim.key
    assert status == "started"
    assert b'"status": "started"' in document


async def test_reopening_is_idempotent(db: Path) -> None:
    _, first = await open_journal(db)
    claim = await first.begin(item(1), INPUTS, DEFINITION)
    await first.aclose()
    await first.aclose()
    with pytest.raises(StorageFailed):
        await first.inspect(item(1))
    _, second = await open_journal(db)
    assert isinstance(claim, Claim)
    assert (await second.complete(claim, "r")).status == "succeeded"
    assert repr(second.store) == f"SQLiteStore({str(db)!r})"
    assert second.store.location == f"sqlite://{db}"


async def test_locations() -> None:
    for location in ("sqlite://relative.db", "sqlite:relative.db", "sqlite:////"[:9] + "x.db"):
        with pytest.raises(InvalidArgument) as caught:
            await Journal.open(location)
        assert caught.value.code == "ABSOLUTE_ROOT_REQUIRED"


def files_beside(db: Path) -> list[str]:
    return sorted(path.name for path in db.parent.iterdir())


async def test_garbage_file_is_storage_failed(db: Path) -> None:
    db.write_bytes(b"this is not a database, " * 100)
    db.chmod(0o600)
    with pytest.raises(StorageFailed) as caught:
        await Journal.open(f"sqlite://{db}")
    assert "not a database" in str(caught.value)
    assert db.read_bytes() == b"this is not a database, " * 100
    assert files_beside(db) == [db.name]  # no -wal, no -shm


def make_foreign_database(db: Path) -> bytes:
    connection = sqlite3.connect(db, isolation_level=None)
    connection.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    connection.execute("INSERT INTO users (name) VALUES ('ada')")
    connection.close()
    db.chmod(0o600)
    return db.read_bytes()


async def test_foreign_database_is_refused_untouched(db: Path) -> None:
    before = make_foreign_database(db)
    with pytest.raises(StorageFailed) as caught:
        await Journal.open(f"sqlite://{db}")
    assert "something else" in str(caught.value)
    assert db.read_bytes() == before  # byte for byte: not even switched to WAL
    assert files_beside(db) == [db.name]  # no -wal, no -shm left behind
    connection = sqlite3.connect(db)
    tables = {r[0] for r in connection.execute("SELECT name FROM sqlite_master")}
    connection.close()
    assert tables == {"users"}


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [("application", "other", "not made by itemjournal"), ("schema_version", "9", "version")],
)
async def test_meta_of_another_kind_is_refused(
    db: Path, key: str, value: str, message: str
) -> None:
    _, journal = await open_journal(db)
    await journal.aclose()
    connection = sqlite3.connect(db, isolation_level=None)
    connection.execute("UPDATE itemjournal_meta SET value = ? WHERE key = ?", (value, key))
    connection.close()
    before = db.read_bytes()
    with pytest.raises(StorageFailed, match=message):
        await Journal.open(f"sqlite://{db}")
    assert db.read_bytes() == before


@pytest.mark.parametrize(
    ("column", "value"),
    [("document", b"{not json"), ("document", "text, not bytes"), ("status", "succeeded")],
)
async def test_a_bad_row_is_record_invalid_and_left_alone(
    db: Path, column: str, value: object
) -> None:
    store, journal = await open_journal(db)
    await journal.begin(item(1), INPUTS, DEFINITION)
    with sqlite3.connect(db) as connection:
        connection.execute(f"UPDATE itemjournal_records SET {column} = ?", (value,))
    for call in (
        journal.inspect(item(1)),
        journal.begin(item(1), INPUTS, DEFINITION),
        journal.mark_review(item(1)),
    ):
        with pytest.raises(RecordInvalid):
            await call
    for status in (None, "started", "succeeded", "needs_review", "released"):
        items = [entry async for entry in store.scan(status=status)]
        assert len(items) == 1, status  # whatever the scan asks, the bad row is in it
        assert isinstance(items[0], RecordInvalid)
    await journal.sweep()
    connection = sqlite3.connect(db)
    stored = connection.execute(f"SELECT {column} FROM itemjournal_records").fetchone()[0]
    connection.close()
    assert stored == value  # never overwritten


async def test_scan_pages_through_everything(db: Path) -> None:
    store, journal = await open_journal(db)
    for n in range(10):
        await journal.begin(item(n), INPUTS, DEFINITION)
    seen = [entry async for entry in store.scan(batch=3)]
    assert sorted(r.identity.item for r in seen if not isinstance(r, Exception)) == sorted(
        f"item-{n}" for n in range(10)
    )


async def test_file_modes(db: Path) -> None:
    await open_journal(db)
    assert db.stat().st_mode & 0o777 == 0o600


# ---------------------------------------------------------------------- the commit queue


class Gate:
    """A step that holds its batch (in the worker thread) until the test opens the gate."""

    def __init__(self) -> None:
        self.entered = anyio.Event()  # set from the worker thread, through the event loop
        self.open = threading.Event()
        self.loop = anyio.lowlevel.current_token()  # the writer thread is not anyio's

    def step(self, current: Record | None) -> Step[str]:
        anyio.from_thread.run_sync(self.entered.set, token=self.loop)
        assert self.open.wait(10)
        return Step(None, "gate")


def writer(n: int, ran: list[int]) -> Callable[[Record | None], Step[int]]:
    """A step that writes a started record for ``item(n)`` and notes that it ran."""

    def step(current: Record | None) -> Step[int]:
        ran.append(n)
        record = started_record(Identity(*item(n)))
        return Step(record, n)

    return step


async def queued(store: SQLiteStore, count: int) -> None:
    """Let every task started so far run until it blocks: then they are in the queue."""
    await anyio.wait_all_tasks_blocked()
    assert len(store._queue) == count


async def test_a_waiter_cancelled_in_the_queue_never_runs(db: Path) -> None:
    store, journal = await open_journal(db)
    gate, ran = Gate(), list[int]()
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.apply, Identity(*item(0)), gate.step)
        await gate.entered.wait()  # the first batch is running and holds the queue
        with anyio.CancelScope() as scope:
            tg.start_soon(store.apply, Identity(*item(2)), writer(2, ran))
            scope.cancel()
            await store.apply(Identity(*item(1)), writer(1, ran))
        assert scope.cancelled_caught
        gate.open.set()
    assert ran == [2]
    assert (await journal.inspect(item(1))).status == "absent"
    assert (await journal.inspect(item(2))).status == "started"


async def test_a_waiter_cancelled_inside_a_running_batch_waits_for_it(db: Path) -> None:
    store, journal = await open_journal(db)
    first, second, ran = Gate(), Gate(), list[int]()
    outcome: list[str] = []

    waiter_scope = anyio.CancelScope()

    async def cancelled_waiter() -> None:
        with waiter_scope:
            try:
                await store.apply(Identity(*item(3)), writer(3, ran))
            finally:
                outcome.append("batch done" if second.open.is_set() else "too early")
        outcome.append("cancelled" if waiter_scope.cancelled_caught else "not cancelled")

    async with anyio.create_task_group() as tg:
        tg.start_soon(store.apply, Identity(*item(0)), first.step)
        await first.entered.wait()
        tg.start_soon(store.apply, Identity(*item(1)), second.step)  # leads the next batch
        await queued(store, 1)
        tg.start_soon(cancelled_waiter)
        await queued(store, 2)
        first.open.set()
        await second.entered.wait()  # batch 2 = [item 1, item 3] is running
        waiter_scope.cancel()  # cancels the waiter while its batch runs
        await anyio.wait_all_tasks_blocked()  # the waiter has seen its cancel
        assert outcome == []  # still waiting for the batch
        second.open.set()
    assert outcome == ["batch done", "cancelled"]
    assert ran == [3]  # it ran once, in the batch it was part of
    assert (await journal.inspect(item(3))).status == "started"


async def test_calls_cancelled_at_the_head_of_the_queue_leave_the_rest_to_run(db: Path) -> None:
    store, journal = await open_journal(db)
    gate, ran = Gate(), list[int]()
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.apply, Identity(*item(0)), gate.step)
        await gate.entered.wait()
        with anyio.CancelScope() as doomed:
            tg.start_soon(store.apply, Identity(*item(5)), writer(5, ran))  # queued behind
            await queued(store, 1)
            # The next call in line is cancelled before the gate opens.
            async with anyio.create_task_group() as inner:
                inner.start_soon(store.apply, Identity(*item(4)), writer(4, ran))
                await queued(store, 2)
                inner.cancel_scope.cancel()
            doomed.cancel()
        gate.open.set()
    assert ran == [5]
    assert (await journal.inspect(item(4))).status == "absent"
    assert (await journal.inspect(item(5))).status == "started"
    assert isinstance(await journal.begin(item(6), INPUTS, DEFINITION), Claim)


async def test_batches_are_run_by_the_writer_thread_without_worker_trips(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes go to the store's own writer thread through its queue, and the callers are
    woken through their event loop: no anyio worker-thread trip per batch, nor per call."""
    store, journal = await open_journal(db)
    claim = await journal.begin(item(0), INPUTS, DEFINITION)  # this process named once
    assert isinstance(claim, Claim)
    threads: set[str] = set()
    assert store._writer is not None
    store._writer.set_trace_callback(lambda _: threads.add(threading.current_thread().name))
    trips: list[object] = []
    real = anyio.to_thread.run_sync

    async def counted(function: Callable[..., object], *args: object, **options: object) -> object:
        trips.append(function)
        return await real(function, *args, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)

    async def cycle(n: int) -> None:
        claim = await journal.begin(item(n), INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        await journal.complete(claim, f"r{n}")

    before = store.commits
    async with anyio.create_task_group() as tg:
        for n in range(1, 33):
            tg.start_soon(cycle, n)
    monkeypatch.undo()
    print(f"\n32 cycles in {store.commits - before} commits, {len(trips)} worker trips")
    assert trips == []
    assert threads == {f"itemjournal writer {store.path}"}
    await journal.aclose()


async def test_the_writer_thread_ends_when_idle_and_when_closed(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_module, "_IDLE", 0.2)
    store, journal = await open_journal(db)
    claim = await journal.begin(item(1), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    first = store._thread
    assert first is not None
    with anyio.fail_after(5):
        while first.is_alive():  # noqa: ASYNC110 - a thread ending sets no event
            await anyio.sleep(0.01)
    assert store._thread is None
    assert (await journal.complete(claim, "r")).status == "succeeded"  # a new one serves it
    second = store._thread
    assert second is not None and second is not first
    await journal.aclose()
    assert not second.is_alive() and store._thread is None


async def test_a_writer_thread_that_cannot_start_fails_its_call_which_never_runs(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, journal = await open_journal(db)
    await journal.aclose()  # its writer thread ended
    store, journal = await open_journal(db)
    start = threading.Thread.start

    def refuse(thread: threading.Thread) -> None:
        if thread.name.startswith("itemjournal writer"):
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(StorageFailed, match="cannot start the writer thread") as caught:
        await journal.begin(item(1), INPUTS, DEFINITION)
    assert "nothing was written" in str(caught.value)
    assert store._queue == []
    monkeypatch.undo()
    claim = await journal.begin(item(2), INPUTS, DEFINITION)  # a thread starts now
    assert isinstance(claim, Claim)
    assert (await journal.inspect(item(1))).status == "absent"  # and ran only this call
    await journal.aclose()


async def test_a_closed_store_refuses_work(db: Path) -> None:
    store, journal = await open_journal(db)
    await journal.aclose()
    with pytest.raises(StorageFailed, match="closed"):
        await journal.begin(item(1), INPUTS, DEFINITION)
    ran: list[int] = []
    store._run_batch([_Operation.of(Identity(*item(1)), writer(1, ran))])
    assert ran == []


async def test_unreadable_database_on_read(db: Path) -> None:
    store, journal = await open_journal(db)
    await journal.begin(item(1), INPUTS, DEFINITION)
    reader = await anyio.to_thread.run_sync(store._reader)
    del reader
    with sqlite3.connect(db) as connection:
        connection.execute("DROP TABLE itemjournal_records")
    with pytest.raises(StorageFailed):
        await journal.inspect(item(1))
    with pytest.raises(StorageFailed):
        [entry async for entry in store.scan()]


async def test_a_status_scan_uses_the_open_records_index(db: Path) -> None:
    store, journal = await open_journal(db)
    for n in range(6):
        claim = await journal.begin(item(n), INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        if n % 2:
            await journal.complete(claim, f"r{n}")
    started = [r async for r in store.scan(status="started")]
    assert sorted(r.identity.item for r in started if not isinstance(r, Exception)) == [
        "item-0",
        "item-2",
        "item-4",
    ]
    done = [r async for r in store.scan(status="succeeded")]
    assert len(done) == 3
    assert [r async for r in store.scan(status="no such status")] == []
    with sqlite3.connect(db) as connection:
        for status in ("started", "needs_review"):
            main, suspect = _page_queries(status, _FIRST)
            plan = str(connection.execute(f"EXPLAIN QUERY PLAN {main}", (b"", 10)).fetchall())
            assert "SEARCH" in plan and "itemjournal_records_open" in plan, plan
            # the rows SQL cannot vouch for come from their own (normally empty) index
            plan = str(connection.execute(f"EXPLAIN QUERY PLAN {suspect}", (b"", 10)).fetchall())
            assert "SEARCH" in plan and "itemjournal_records_suspect" in plan, plan
        [every] = _page_queries("released", _FIRST)  # no index: every row, checked in Python
        plan = str(connection.execute(f"EXPLAIN QUERY PLAN {every}", (b"", 10)).fetchall())
        assert "itemjournal_records_digest" in plan and "itemjournal_records_open" not in plan, plan


# ---------------------------------------------------------------------- lifecycle, locks


async def test_closing_while_calls_are_under_way(db: Path) -> None:
    store, journal = await open_journal(db)
    outcomes: list[str] = []

    async def call(n: int) -> None:
        try:
            if n % 2:
                await journal.inspect(item(n))
            else:
                await journal.begin(item(n), INPUTS, DEFINITION)
        except StorageFailed:
            outcomes.append("refused")
        else:
            outcomes.append("done")

    async with anyio.create_task_group() as tg:
        for n in range(100):
            tg.start_soon(call, n)
        while not (store._writing or store._reading):
            await anyio.lowlevel.checkpoint()
        await journal.aclose()  # waits for what is under way; later calls are refused
    assert len(outcomes) == 100
    assert "done" in outcomes
    with pytest.raises(StorageFailed, match="closed"):
        await journal.inspect(item(0))


async def test_reader_connections_are_pooled(db: Path) -> None:
    store, journal = await open_journal(db)
    for _ in range(3):
        async with anyio.create_task_group() as tg:
            for n in range(64):
                tg.start_soon(journal.inspect, item(n))
    assert store._reading == 0
    assert len(store._idle_readers) <= 40  # at most one per worker thread ever in use


def hold_write_lock(db: Path) -> sqlite3.Connection:
    """Another process's writer, holding the write lock until it is rolled back."""
    holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    return holder


def release(holder: sqlite3.Connection) -> None:
    holder.execute("ROLLBACK")
    holder.close()


def on_retry(store: SQLiteStore) -> anyio.Event:
    """An event set once the store has found the write lock taken and is trying again."""
    retrying = anyio.Event()
    loop = anyio.lowlevel.current_token()  # the writer thread is not anyio's
    tries: list[str] = []

    def trace(statement: str) -> None:
        if statement == "BEGIN IMMEDIATE":
            tries.append(statement)
            if len(tries) == 2:
                anyio.from_thread.run_sync(retrying.set, token=loop)

    assert store._writer is not None
    store._writer.set_trace_callback(trace)
    return retrying


async def cancel_when(event: anyio.Event, call: Callable[[], Awaitable[object]]) -> float:
    """Run ``call``, cancel it once ``event`` is set; seconds from the cancel to its end."""
    scope = anyio.CancelScope()
    cancelled_at: list[float] = []

    async def run() -> None:
        with scope:
            await call()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await event.wait()
        cancelled_at.append(anyio.current_time())
        scope.cancel()
    assert scope.cancelled_caught
    return anyio.current_time() - cancelled_at[0]


async def test_waiting_for_another_process_write_lock_is_cancellable(db: Path) -> None:
    store = SQLiteStore(str(db), busy_timeout=0.3)
    await store.open()
    journal = Journal(store)
    retrying = on_retry(store)
    holder = await anyio.to_thread.run_sync(hold_write_lock, db)
    try:
        elapsed = await cancel_when(retrying, lambda: journal.begin(item(1), INPUTS, DEFINITION))
        print(f"\nbegin cancelled while waiting for the write lock: {elapsed * 1000:.1f} ms")
        # nothing was written, so there is nothing to wait for: well before the busy
        # timeout (0.3 s), whatever else the machine is doing
        assert elapsed < 0.25
        with pytest.raises(StorageFailed) as caught:
            await journal.begin(item(2), INPUTS, DEFINITION)
        assert caught.value.errno == errno.ETIMEDOUT
    finally:
        await anyio.to_thread.run_sync(release, holder)
    assert (await journal.inspect(item(1))).status == "absent"
    assert isinstance(await journal.begin(item(1), INPUTS, DEFINITION), Claim)
    await journal.aclose()


async def test_every_caller_of_a_failed_batch_gets_its_own_error(db: Path) -> None:
    _, journal = await open_journal(db)
    with sqlite3.connect(db) as connection:
        connection.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON itemjournal_records "
            "BEGIN SELECT RAISE(ABORT, 'injected failure'); END"
        )
    errors: list[BaseException] = []

    async def begin(n: int) -> None:
        try:
            await journal.begin(item(n), INPUTS, DEFINITION)
        except StorageFailed as error:
            errors.append(error)

    async with anyio.create_task_group() as tg:
        for n in range(8):
            tg.start_soon(begin, n)
    assert len(errors) == 8
    assert len({id(error) for error in errors}) == 8


# ---------------------------------------------------------------------- earlier schema versions

# Schema version 1, as that version created it: the rows in a table keyed by their digest.
_V1_SUSPECT = (
    "typeof(digest) != 'text' OR length(CAST(digest AS BLOB)) != 64 "
    "OR digest GLOB '*[^0-9a-f]*' "
    "OR typeof(status) != 'text' "
    "OR status NOT IN ('started', 'succeeded', 'needs_review', 'released') "
    "OR typeof(document) != 'blob' "
    "OR CASE WHEN json_valid(CAST(document AS TEXT)) "
    "THEN json_extract(CAST(document AS TEXT), '$.status') IS NOT status ELSE 1 END"
)
_V1_SCHEMA = [
    "CREATE TABLE itemjournal_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
    "CREATE TABLE itemjournal_records (digest TEXT PRIMARY KEY, status TEXT NOT NULL, "
    "document BLOB NOT NULL) WITHOUT ROWID",
    "CREATE INDEX itemjournal_records_open ON itemjournal_records (status) "
    "WHERE status IN ('started', 'needs_review')",
    f"CREATE INDEX itemjournal_records_suspect ON itemjournal_records (digest) WHERE {_V1_SUSPECT}",
]


def make_version_1(db: Path, rows: list[tuple[object, object, object]]) -> None:
    connection = sqlite3.connect(db, isolation_level=None)
    connection.execute("PRAGMA journal_mode = WAL")
    for statement in _V1_SCHEMA:
        connection.execute(statement)
    connection.executemany(
        "INSERT INTO itemjournal_meta (key, value) VALUES (?, ?)",
        [("application", "itemjournal"), ("schema_version", "1"), ("setting.kept", "yes")],
    )
    connection.executemany(
        "INSERT INTO itemjournal_records (digest, status, document) VALUES (?, ?, ?)", rows
    )
    connection.close()
    db.chmod(0o600)


def all_rows(db: Path) -> list[tuple[object, object, object]]:
    with sqlite3.connect(db) as connection:
        return connection.execute(
            "SELECT digest, status, document FROM itemjournal_records ORDER BY digest"
        ).fetchall()


async def test_a_version_1_database_is_migrated_with_every_row(db: Path, tmp_path: Path) -> None:
    # Real records, made by this version elsewhere, then planted in a version 1 database.
    source = tmp_path / "source.db"
    _, maker = await open_journal(source)
    claims: dict[int, Claim] = {}
    for n in range(6):
        claim = await maker.begin(item(n), INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        claims[n] = claim
        if n % 3 == 1:
            await maker.complete(claim, f"r{n}")
        elif n % 3 == 2:
            await maker.mark_review(item(n))
    await maker.aclose()
    bad = ("ab" * 32, "succeeded", b"{not json")  # unreadable, kept as it is
    rows = sorted([*all_rows(source), bad], key=lambda row: str(row[0]))
    await anyio.to_thread.run_sync(make_version_1, db, rows)

    # Two openers at once: one migrates, the other finds the new schema.
    journals: list[Journal] = []

    async def opener() -> None:
        journals.append((await open_journal(db))[1])

    async with anyio.create_task_group() as tg:
        tg.start_soon(opener)
        tg.start_soon(opener)
    store = journals[0].store
    assert isinstance(store, SQLiteStore)

    assert all_rows(db) == rows  # every row, byte for byte
    with sqlite3.connect(db) as connection:
        meta = dict(connection.execute("SELECT key, value FROM itemjournal_meta").fetchall())
        names = {r[0] for r in connection.execute("SELECT name FROM sqlite_master")}
        [table] = connection.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'itemjournal_records'"
        ).fetchone()
    assert meta["application"] == "itemjournal"
    assert meta["schema_version"] == str(SCHEMA_VERSION)
    assert meta["setting.kept"] == "yes"
    assert "WITHOUT ROWID" not in table and "id INTEGER PRIMARY KEY" in table
    assert {"itemjournal_records_digest", "itemjournal_records_open"} <= names
    assert not any("upgrade" in name for name in names)
    assert await store.setting("kept", "no") == "yes"
    assert await store.check() == []

    # Every record reads as before; the unreadable row is still RECORD_INVALID.
    journal = journals[1]
    for n in range(6):
        view = await journal.inspect(item(n))
        assert view is not None
        assert view.status == ("started", "succeeded", "needs_review")[n % 3]
    started = [r async for r in store.scan(status="started")]
    assert sorted(r.identity.item for r in started if isinstance(r, Record)) == [
        "item-0",
        "item-3",
    ]
    invalid = [r for r in started if isinstance(r, RecordInvalid)]
    assert [str(e.location).rsplit("#", 1)[1] for e in invalid] == ["ab" * 32]

    # And it works: a migrated claim completes, a new claim is exclusive.
    assert (await journal.complete(claims[0], "r0")).status == "succeeded"
    fresh = await journal.begin(item(99), INPUTS, DEFINITION)
    assert isinstance(fresh, Claim)
    with pytest.raises(ConflictError):
        await journals[0].begin(item(99), INPUTS, DEFINITION)
    for each in journals:
        await each.aclose()
    _, again = await open_journal(db)  # reopening the migrated database changes nothing
    assert (await again.inspect(item(0))) is not None
    await again.aclose()


async def test_a_version_1_database_without_its_records_table_is_completed(db: Path) -> None:
    await anyio.to_thread.run_sync(make_version_1, db, [])
    with sqlite3.connect(db, isolation_level=None) as connection:
        connection.execute("DROP TABLE itemjournal_records")
    _, journal = await open_journal(db)
    claim = await journal.begin(item(1), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    await journal.aclose()
    with sqlite3.connect(db) as connection:
        version = connection.execute(
            "SELECT value FROM itemjournal_meta WHERE key = 'schema_version'"
        ).fetchone()
    assert version == (str(SCHEMA_VERSION),)
