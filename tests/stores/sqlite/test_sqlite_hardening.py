"""The SQLite store under hostile conditions: every answer true, every wait cancellable,
every row readable on its own, and nothing touched that is not the journal's."""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

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
from itemjournal._stores.sqlite.schema import _SUSPECT_CONDITION, SCHEMA_VERSION

pytestmark = pytest.mark.anyio

DEFINITION = definition_digest("sqlite-hardening-v1")
INPUTS = {"n": "1"}
WORKER = str(Path(__file__).parents[2] / "_mp_worker.py")
MP_DEFINITION = definition_digest("mp-v1")  # what the worker process begins with


def item(n: int | str, job: str = "job") -> tuple[str, str, str, str]:
    return ("sq", "hardening", job, f"item-{n}")


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "journal.db"


async def open_store(db: Path, **options: Any) -> tuple[SQLiteStore, Journal]:
    store = SQLiteStore(str(db), **options)
    await store.open()
    return store, Journal(store)


def execute(db: Path, *statements: tuple[str, tuple[object, ...]]) -> None:
    """Run statements through a plain connection of its own (another program's)."""
    connection = sqlite3.connect(db, isolation_level=None)
    try:
        for sql, parameters in statements:
            connection.execute(sql, parameters)
    finally:
        connection.close()


def hold_write_lock(db: Path, *, wal: bool = True) -> sqlite3.Connection:
    """Another process's writer, holding the write lock until ``release``."""
    holder = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    if wal:
        holder.execute("PRAGMA journal_mode = WAL")
    holder.execute("BEGIN IMMEDIATE")
    return holder


def release(holder: sqlite3.Connection) -> None:
    holder.execute("ROLLBACK")
    holder.close()


def private_file(path: Path, data: bytes = b"") -> None:
    path.write_bytes(data)
    path.chmod(0o600)


class Gate:
    """A step that holds its batch (in the worker thread) until the test opens the gate,
    so that the calls started meanwhile all queue for the next batch."""

    def __init__(self) -> None:
        self.entered = anyio.Event()
        self.open = threading.Event()
        self.loop = anyio.lowlevel.current_token()  # the writer thread is not anyio's

    def step(self, current: Record | None) -> Step[str]:
        anyio.from_thread.run_sync(self.entered.set, token=self.loop)
        assert self.open.wait(10)
        return Step(None, "gate")


async def one_batch(
    store: SQLiteStore,
    calls: list[Callable[[], Coroutine[Any, Any, None]]],
    before: Callable[[], None],
) -> None:
    """Run ``calls`` together in ONE batch; ``before`` runs just before that batch."""
    gate = Gate()
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.apply, Identity(*item("gate", "gate")), gate.step)
        await gate.entered.wait()
        for call in calls:
            tg.start_soon(call)
        await anyio.wait_all_tasks_blocked()
        assert len(store._queue) == len(calls)
        before()
        gate.open.set()


# ---------------------------------------------------------------------- 0: POSIX locks


def test_opening_never_opens_the_database_file_itself(
    db: Path, monkeypatch: pytest.MonkeyPatch, anyio_backend: str
) -> None:
    """Closing any descriptor of the database drops this process's locks on it, SQLite's
    own included; so nothing but SQLite may open the file, not even to create it."""
    opened: list[str] = []
    real_open = os.open

    def spy(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(os.fspath(path))
        return int(real_open(path, *args, **kwargs))

    async def open_twice() -> None:
        first = await Journal.open(f"sqlite://{db}")
        second = await Journal.open(f"sqlite://{db}")  # the file exists: still not opened
        await second.aclose()
        await first.aclose()

    monkeypatch.setattr(os, "open", spy)
    anyio.run(open_twice, backend=anyio_backend)
    monkeypatch.undo()
    assert str(db) not in opened
    assert db.stat().st_mode & 0o777 == 0o600
    assert not [name for name in os.listdir(db.parent) if name.endswith(".new")]


def spawn_contender(location: str, backend: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, WORKER, "contend", location, backend],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def ask(process: subprocess.Popen[str], n: int) -> dict[str, str]:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(f"{n}\n")
    process.stdin.flush()
    return dict(json.loads(process.stdout.readline()))


async def test_claims_stay_exclusive_with_many_journals_on_one_database(
    db: Path, anyio_backend: str
) -> None:
    """Two journals of this process on one database, and another process that opens and
    closes plain connections to it, round after round: that process must never get a
    claim this process holds, and nothing here may fail with a disk I/O error."""
    location = f"sqlite://{db}"
    journals = [await Journal.open(location), await Journal.open(location)]
    contender = spawn_contender(location, anyio_backend)
    answers: Counter[str] = Counter()
    try:
        for n in range(12):
            claim = await journals[n % 2].begin(
                ("mp", "locks", "held", f"i{n}"), INPUTS, MP_DEFINITION
            )
            assert isinstance(claim, Claim)
            # Another journal of this process opens (and an old one closes) meanwhile.
            await journals[(n + 1) % 2].aclose()
            journals[(n + 1) % 2] = await Journal.open(location)
            answer = await anyio.to_thread.run_sync(ask, contender, n)
            answers[answer["answer"]] += 1
            # held here, by a live owner: a refusal, never a Claim (nor an I/O error)
            assert answer["answer"] in ("IN_PROGRESS", "REVIEW_REQUIRED"), answer
            for journal in journals:
                assert (await journal.inspect(claim.identity)).status == "started"
    finally:
        assert contender.stdin is not None
        contender.stdin.close()
        await anyio.to_thread.run_sync(contender.wait)
        assert contender.stdout is not None
        contender.stdout.close()
        for journal in journals:
            await journal.aclose()
    print(f"\n12 rounds against another process's connections: {dict(answers)}")


# ---------------------------------------------------------------------- 1: the batch


class Injected(BaseException):
    """Stands for a KeyboardInterrupt, SystemExit or the like, without their effects
    on the test runner."""


def io_error() -> sqlite3.Error:
    error = sqlite3.OperationalError("disk I/O error")
    error.sqlite_errorcode = sqlite3.SQLITE_IOERR_READ  # type: ignore[attr-defined]
    return error


KINDS: dict[str, Callable[[], BaseException]] = {
    "sqlite3.Error": lambda: sqlite3.OperationalError("injected failure"),
    "sqlite3.Error (I/O)": io_error,  # may have ended the transaction: never one row's alone
    "MemoryError": MemoryError,
    "BaseException": lambda: Injected("injected"),
}


class FaultyWriter:
    """The writer connection, failing the statement at ``fail_at`` (0 = the first after
    it is installed), and every ROLLBACK too with ``fail_rollback``."""

    def __init__(
        self,
        real: sqlite3.Connection,
        fail_at: int | None,
        make: Callable[[], BaseException],
        *,
        fail_rollback: bool = False,
    ) -> None:
        self.real = real
        self.fail_at = fail_at
        self.make = make
        self.fail_rollback = fail_rollback
        self.statements: list[str] = []
        self.failed: list[str] = []

    def execute(self, sql: str, parameters: Any = ()) -> sqlite3.Cursor:
        index = len(self.statements)
        self.statements.append(sql.split(maxsplit=1)[0])
        if index == self.fail_at or (self.fail_rollback and sql == "ROLLBACK"):
            self.failed.append(sql.split(maxsplit=1)[0])
            raise self.make()
        return self.real.execute(sql, parameters)

    @property
    def in_transaction(self) -> bool:
        return self.real.in_transaction

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


REFUSED = 6  # the one call of a round that is refused (its record is already started)


class Round:
    """A batch of 8, interleaved: three completes of started records, four begins of new
    identities and one begin of a started identity (a refusal, which writes nothing)."""

    def __init__(self, store: SQLiteStore, journal: Journal, name: str) -> None:
        self.store = store
        self.journal = journal
        self.name = name
        self.claims: dict[int, Claim] = {}
        self.outcomes: dict[int, object] = {}

    def identity(self, n: int) -> tuple[str, str, str, str]:
        return item(n, self.name)

    async def prepare(self) -> None:
        for n in range(0, 8, 2):
            claim = await self.journal.begin(self.identity(n), INPUTS, DEFINITION)
            assert isinstance(claim, Claim)
            self.claims[n] = claim

    def call(self, n: int) -> Callable[[], Coroutine[Any, Any, None]]:
        async def run() -> None:
            try:
                if n in self.claims and n != REFUSED:
                    self.outcomes[n] = await self.journal.complete(self.claims[n], f"r{n}")
                else:
                    self.outcomes[n] = await self.journal.begin(
                        self.identity(n), INPUTS, DEFINITION
                    )
            except (Exception, Injected) as error:
                self.outcomes[n] = error

        return run

    async def run(self, before: Callable[[], None]) -> None:
        await one_batch(self.store, [self.call(n) for n in range(8)], before)

    async def check(self, *, unknown_allowed: bool) -> Counter[str]:
        """Every answer agrees with what is stored; returns a tally of the answers."""
        tally: Counter[str] = Counter()
        assert sorted(self.outcomes) == list(range(8))
        for n, outcome in self.outcomes.items():
            view = await self.journal.inspect(self.identity(n))
            if n == REFUSED:
                before = after = "started"
            elif n in self.claims:
                before, after = "started", "succeeded"
            else:
                before, after = "absent", "started"
            if isinstance(outcome, RecordView | Claim):
                tally["acknowledged"] += 1
                assert view.status == after, (n, outcome, view)
                if n in self.claims:
                    assert view.receipt == f"r{n}"
                continue
            assert isinstance(outcome, BaseException)
            if isinstance(outcome, ConflictError):
                assert n == REFUSED and outcome.code in ("IN_PROGRESS", "REVIEW_REQUIRED")
                tally["refused"] += 1
            elif isinstance(outcome, StorageFailed) and "unknown" in str(outcome):
                tally["unknown"] += 1
                assert unknown_allowed, outcome
                assert view.status in (before, after)
                continue
            elif isinstance(outcome, StorageFailed):
                assert "nothing was written" in str(outcome), outcome
                tally["nothing written"] += 1
            else:
                tally[type(outcome).__name__] += 1
            assert view.status == before, (n, outcome, view)
            assert view.receipt is None
        return tally


async def still_works(store: SQLiteStore, journal: Journal, name: str) -> None:
    # the writer is out of its transaction, or was discarded (to be reopened on demand)
    assert store._writer is None or not store._writer.in_transaction
    assert not store._writing
    claim = await journal.begin(item("after", name), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    assert (await journal.complete(claim, "r")).status == "succeeded"
    assert store._writer is not None and not store._writer.in_transaction


async def count_statements(store: SQLiteStore, journal: Journal) -> list[str]:
    """The writer's statements for one healthy batch of 8."""
    round_ = Round(store, journal, "count")
    await round_.prepare()
    spy = FaultyWriter(store._writer, None, MemoryError)  # type: ignore[arg-type]

    def install() -> None:
        store._writer = spy  # type: ignore[assignment]

    await round_.run(install)
    store._writer = spy.real
    assert await round_.check(unknown_allowed=False) == {"acknowledged": 7, "refused": 1}
    return spy.statements


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fail_rollback", [False, True], ids=["", "rollback-fails-too"])
async def test_a_statement_failing_anywhere_in_a_batch_leaves_every_answer_true(
    db: Path, kind: str, fail_rollback: bool
) -> None:
    store, journal = await open_store(db)
    statements = await count_statements(store, journal)
    assert sorted(statements) == sorted(["BEGIN", "COMMIT"] + ["SELECT"] * 8 + ["INSERT"] * 7)
    tallies: Counter[str] = Counter()
    for position in range(len(statements)):
        name = f"s{position}"
        round_ = Round(store, journal, name)
        await round_.prepare()
        real = store._writer
        assert real is not None
        faulty = FaultyWriter(real, position, KINDS[kind], fail_rollback=fail_rollback)

        def install(faulty: FaultyWriter = faulty) -> None:
            store._writer = faulty  # type: ignore[assignment]

        await round_.run(install)
        if store._writer is faulty:  # type: ignore[comparison-overlap]
            store._writer = real
        else:
            assert fail_rollback  # only a failed rollback discards the writer
        failed = faulty.failed[0]  # the statement that failed (the order varies on trio)
        tally = await round_.check(unknown_allowed=failed == "COMMIT")
        tallies.update(tally)
        if failed == "SELECT" and kind == "sqlite3.Error":
            # a row that cannot be read costs its own call only
            assert tally["nothing written"] == 1, tally
            assert tally["acknowledged"] + tally["refused"] == 7, tally
        await still_works(store, journal, name)
    variant = ", rollback failing too" if fail_rollback else ""
    print(f"\n{kind}{variant}, each of {len(statements)} statements: {dict(tallies)}")
    await journal.aclose()


@pytest.mark.parametrize("kind", KINDS)
async def test_a_step_failing_anywhere_in_a_batch_leaves_every_answer_true(
    db: Path, kind: str
) -> None:
    store, journal = await open_store(db)
    original = store.apply
    tallies: Counter[str] = Counter()
    for position in range(8):
        name = f"p{position}"
        round_ = Round(store, journal, name)
        await round_.prepare()
        seen = [0]

        def faulty_apply(
            identity: Identity,
            step: Any,
            position: int = position,
            seen: list[int] = seen,
            job: str = name,
        ) -> Any:
            def wrapped(current: Record | None) -> Any:
                index, seen[0] = seen[0], seen[0] + 1  # the position in the batch
                if index == position:
                    raise KINDS[kind]()
                return step(current)

            return original(identity, wrapped if identity.job == job else step)

        store.apply = faulty_apply  # type: ignore[method-assign]
        await round_.run(lambda: None)
        store.apply = original  # type: ignore[method-assign]
        assert seen[0] == (position + 1 if kind == "BaseException" else 8)
        tally = await round_.check(unknown_allowed=False)
        tallies.update(tally)
        if kind == "BaseException":  # the whole batch is given up; the step's caller
            assert tally["Injected"] == 1, tally  # sees its own exception, no write stands
            assert tally["acknowledged"] == tally["unknown"] == 0, tally
        else:  # an ordinary exception is that caller's own answer
            assert tally[type(KINDS[kind]()).__name__] == 1, tally
            assert tally["acknowledged"] + tally["refused"] == 7, tally
        await still_works(store, journal, name)
    print(f"\nstep raising {kind} at each of 8 positions: {dict(tallies)}")
    await journal.aclose()


async def test_a_failed_commit_says_the_outcome_is_unknown(db: Path) -> None:
    store, journal = await open_store(db)
    real = store._writer
    assert real is not None
    outcomes: list[object] = []

    async def begin() -> None:
        try:
            outcomes.append(await journal.begin(item(1), INPUTS, DEFINITION))
        except StorageFailed as error:
            outcomes.append(error)

    faulty = FaultyWriter(real, 3, lambda: sqlite3.OperationalError("disk I/O error"))
    await one_batch(store, [begin], lambda: setattr(store, "_writer", faulty))
    store._writer = real
    [outcome] = outcomes
    assert isinstance(outcome, StorageFailed)
    assert "unknown" in str(outcome)
    assert "nothing was written" not in str(outcome)
    assert isinstance(outcome.__cause__, sqlite3.Error)


# ---------------------------------------------------------------------- 3: cancel a wait


def on_retry(store: SQLiteStore) -> anyio.Event:
    """Set once the store found the write lock taken and is trying again."""
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


def writer(n: int, ran: list[int]) -> Callable[[Record | None], Step[int]]:
    def step(current: Record | None) -> Step[int]:
        ran.append(n)
        return Step(started_record(Identity(*item(n))), n)

    return step


async def test_a_store_call_waiting_for_the_write_lock_is_cancelled_at_once(db: Path) -> None:
    store, journal = await open_store(db, busy_timeout=30)
    retrying = on_retry(store)
    holder: sqlite3.Connection | None = await anyio.to_thread.run_sync(hold_write_lock, db)
    ran: list[int] = []
    leader_scope = anyio.CancelScope()
    results: list[object] = []
    try:
        async with anyio.create_task_group() as tg:

            async def leader() -> None:
                with leader_scope:
                    await store.apply(Identity(*item(1)), writer(1, ran))

            async def follower() -> None:
                results.append(await store.apply(Identity(*item(2)), writer(2, ran)))

            tg.start_soon(leader)
            await retrying.wait()
            tg.start_soon(follower)  # queued behind the waiting leader
            await anyio.wait_all_tasks_blocked()
            cancelled_at = anyio.current_time()
            leader_scope.cancel()
            with anyio.fail_after(5):
                while not leader_scope.cancelled_caught:
                    await anyio.lowlevel.checkpoint()
            elapsed = anyio.current_time() - cancelled_at
            print(f"\nstore call cancelled while waiting for the lock: {elapsed * 1000:.1f} ms")
            # At once, not after the busy timeout (30 s): at most the retry trip under way
            # is waited for, which a loaded machine can stretch past 100 ms.
            assert elapsed < 1.0
            # it left the queue; the call behind it leads now (and waits for the lock)
            assert Identity(*item(1)) not in [op.identity for op in store._queue]
            assert store._writing
            held, holder = holder, None
            assert held is not None
            await anyio.to_thread.run_sync(release, held)
    finally:
        if holder is not None:
            await anyio.to_thread.run_sync(release, holder)
    assert ran == [2] and results == [2]  # the cancelled call never ran; the next one led
    assert not store._writing
    assert (await journal.inspect(item(1))).status == "absent"
    assert (await journal.inspect(item(2))).status == "started"


# ---------------------------------------------------------------------- 9: status scans

BAD_ROWS: dict[str, tuple[str, str, str]] = {
    # name: (digest, status, document), each an SQL expression; ? is a started document
    "status column unknown": ("'{key}'", "'bogus'", "CAST(? AS BLOB)"),
    "status column a number": ("'{key}'", "7", "CAST(? AS BLOB)"),
    "status column disagrees": ("'{key}'", "'succeeded'", "CAST(? AS BLOB)"),
    "status column not UTF-8": ("'{key}'", "CAST(x'73ff' AS TEXT)", "CAST(? AS BLOB)"),
    "document not JSON": ("'{key}'", "'released'", "CAST('{{nope' AS BLOB)"),
    "document JSON of another shape": ("'{key}'", "'released'", "CAST('[1, 2]' AS BLOB)"),
    "document text": ("'{key}'", "'started'", "CAST(? AS TEXT)"),
    "document text, not UTF-8": ("'{key}'", "'succeeded'", "CAST(x'ff7b7d' AS TEXT)"),
    "key not UTF-8": ("CAST(x'ff{key}' AS TEXT)", "'started'", "CAST(? AS BLOB)"),
    "key a blob": ("x'{key}'", "'needs_review'", "CAST(? AS BLOB)"),
    "key not a digest": ("'{key}X'", "'started'", "CAST(? AS BLOB)"),
}
# Sound as far as SQL can tell (a digest, a status its document repeats), but stored
# under another identity's digest: scans of its own status find it (and full scans).
COPIED = ("'{key}'", "'started'", "CAST(? AS BLOB)")


def plant_rows(db: Path, document: bytes, rows: list[tuple[str, str, str]]) -> None:
    statements = []
    for n, (digest, status, body) in enumerate(rows):
        key = f"{n:02d}" + "0" * 62
        sql = (
            "INSERT INTO itemjournal_records (digest, status, document) VALUES "
            f"({digest.format(key=key)}, {status}, {body})"
        )
        statements.append((sql, (document,) if "?" in body else ()))
    execute(db, *statements)


async def test_a_status_scan_returns_every_row_whose_status_is_in_doubt(db: Path) -> None:
    store, journal = await open_store(db)
    wanted: dict[str, set[str]] = {s: set() for s in ("started", "succeeded", "needs_review")}
    for n in range(12):
        claim = await journal.begin(item(n), INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        if n % 3 == 1:
            await journal.complete(claim, f"r{n}")
        elif n % 3 == 2:
            await journal.mark_review(item(n))
        status = ("started", "succeeded", "needs_review")[n % 3]
        wanted[status].add(f"item-{n}")
    connection = sqlite3.connect(db)
    [started] = connection.execute(
        "SELECT document FROM itemjournal_records WHERE digest = ?",
        (identity_digest(Identity(*item(0))),),
    ).fetchone()
    connection.close()
    await anyio.to_thread.run_sync(plant_rows, db, started, [*BAD_ROWS.values(), COPIED])
    copied = f"{len(BAD_ROWS):02d}" + "0" * 62
    statuses: tuple[str | None, ...] = (None, *wanted, "released", "no such status")
    for asked in statuses:
        for batch in (2, 3, 256):  # pages of every size, joining both queries of a page
            seen = [entry async for entry in store.scan(status=asked, batch=batch)]
            bad = [entry for entry in seen if isinstance(entry, RecordInvalid)]
            good = sorted(e.identity.item for e in seen if isinstance(e, Record))
            assert len(seen) == len(bad) + len(good)
            locations = [str(e.location) for e in bad]
            assert len(set(locations)) == len(locations)  # each once
            assert len([e for e in locations if not e.endswith(copied)]) == len(BAD_ROWS), (
                asked,
                batch,
                [str(e) for e in bad],
            )
            # the copied row: found by the scans that read every row, and by its own status's
            assert any(e.endswith(copied) for e in locations) is (asked != "needs_review"), (
                asked,
                batch,
            )
            expected = (
                sorted(set().union(*wanted.values()))
                if asked is None
                else sorted(wanted.get(asked, ()))
            )
            assert good == expected, (asked, batch)


# ---------------------------------------------------------------------- 12: open waits


@pytest.mark.parametrize("wal", [True, False], ids=["wal", "rollback-journal"])
async def test_opening_while_another_process_holds_the_lock_is_cancellable(
    db: Path, wal: bool
) -> None:
    await anyio.to_thread.run_sync(private_file, db)
    holder = await anyio.to_thread.run_sync(lambda: hold_write_lock(db, wal=wal))
    try:
        store = SQLiteStore(str(db), busy_timeout=3)
        started = anyio.current_time()
        with anyio.move_on_after(0.05) as scope:
            await store.open()
        elapsed = anyio.current_time() - started - 0.05
        print(f"\nopen cancelled while waiting for the lock: ended {elapsed * 1000:.1f} ms after")
        assert scope.cancelled_caught
        # well before the busy timeout (3 s): only the trip under way is waited for,
        # which takes longer than usual on a loaded machine
        assert elapsed < 1.0
    finally:
        await anyio.to_thread.run_sync(release, holder)
    store = SQLiteStore(str(db))
    await store.open()
    assert await Journal(store).begin(item(1), INPUTS, DEFINITION)
    await store.aclose()


async def test_opening_gives_up_after_the_busy_timeout(db: Path) -> None:
    await anyio.to_thread.run_sync(private_file, db)
    holder = await anyio.to_thread.run_sync(hold_write_lock, db)
    try:
        store = SQLiteStore(str(db), busy_timeout=0.2)
        started = anyio.current_time()
        with pytest.raises(StorageFailed) as caught:
            await store.open()
        elapsed = anyio.current_time() - started
    finally:
        await anyio.to_thread.run_sync(release, holder)
    assert caught.value.errno == errno.ETIMEDOUT
    assert "another process held a lock" in str(caught.value)
    assert 0.2 <= elapsed < 1


async def test_opening_a_journal_takes_no_write_lock(db: Path) -> None:
    store, _ = await open_store(db)
    await store.aclose()
    holder = await anyio.to_thread.run_sync(hold_write_lock, db)
    try:
        again = SQLiteStore(str(db), busy_timeout=0.2)
        with anyio.fail_after(1):
            await again.open()  # nothing to create: it only reads
        await again.aclose()
    finally:
        await anyio.to_thread.run_sync(release, holder)


# ---------------------------------------------------------------------- 15: whose files


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


async def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(StorageFailed) as caught:
        await Journal.open(f"sqlite://{shared}/journal.db")
    assert caught.value.errno == errno.EPERM
    assert "chmod go-w" in str(caught.value) and "trust_shared_root=True" in str(caught.value)
    assert listing(shared) == []  # nothing was created there
    store, journal = await open_store(shared / "journal.db", trust_shared_root=True)
    assert isinstance(await journal.begin(item(1), INPUTS, DEFINITION), Claim)
    await store.aclose()


async def test_a_database_others_can_write_is_refused_untouched(db: Path) -> None:
    store, journal = await open_store(db)
    await journal.begin(item(1), INPUTS, DEFINITION)
    await store.aclose()
    db.chmod(0o666)
    before = db.read_bytes()
    with pytest.raises(StorageFailed) as caught:
        await SQLiteStore(str(db)).open()
    assert "writable by group or others" in str(caught.value)
    assert f"chmod go-w {db}" in str(caught.value)
    assert db.read_bytes() == before
    assert listing(db.parent) == [db.name]
    store, journal = await open_store(db, trust_shared_root=True)
    assert (await journal.inspect(item(1))).status == "started"
    await store.aclose()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away takes root")
@pytest.mark.parametrize("what", ["database", "directory"])
async def test_a_database_owned_by_someone_else_is_refused(tmp_path: Path, what: str) -> None:
    directory = tmp_path / "d"
    directory.mkdir(mode=0o700)
    db = directory / "journal.db"
    store, _ = await open_store(db)
    await store.aclose()
    os.chown(db if what == "database" else directory, 1, -1)
    before = db.read_bytes()
    with pytest.raises(StorageFailed) as caught:
        await SQLiteStore(str(db)).open()
    assert "owned by uid 1" in str(caught.value) and "chown" in str(caught.value)
    assert db.read_bytes() == before
    store, _ = await open_store(db, trust_shared_root=True)
    await store.aclose()


# ---------------------------------------------------------------------- 16: one bad row

CORRUPTIONS = {
    "document text, not UTF-8": ("document", "CAST(x'ff7b' AS TEXT)"),
    "status not UTF-8": ("status", "CAST(x'73ff' AS TEXT)"),
    "document a number": ("document", "42"),
    "document not JSON": ("document", "CAST('{{' AS BLOB)"),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
async def test_one_corrupted_row_costs_its_own_call_only(db: Path, corruption: str) -> None:
    store, journal = await open_store(db)
    bad = item("bad")
    await journal.begin(bad, INPUTS, DEFINITION)
    column, value = CORRUPTIONS[corruption]
    await anyio.to_thread.run_sync(
        execute, db, (f"UPDATE itemjournal_records SET {column} = {value}", ())
    )
    outcomes: dict[int, object] = {}

    def call(n: int) -> Callable[[], Coroutine[Any, Any, None]]:
        async def run() -> None:
            try:
                outcomes[n] = await journal.begin(bad if n == 50 else item(n), INPUTS, DEFINITION)
            except Exception as error:
                outcomes[n] = error

        return run

    commits = store.commits
    await one_batch(store, [call(n) for n in range(96)], lambda: None)
    kinds = Counter(
        getattr(outcome, "code", type(outcome).__name__) for outcome in outcomes.values()
    )
    print(f"\n96 calls in one batch, one on a row with {corruption}: {dict(kinds)}")
    assert kinds == {"Claim": 95, "RECORD_INVALID": 1}, kinds
    assert store.commits == commits + 2  # the gate's batch, then all 96 in one
    for n in range(96):
        if n != 50:
            assert (await journal.inspect(item(n))).status == "started"
    with pytest.raises(RecordInvalid):
        await journal.inspect(bad)


# ---------------------------------------------------------------------- 18: settings


async def test_a_setting_is_recorded_once_and_the_first_value_wins(db: Path) -> None:
    first, _ = await open_store(db)
    second, _ = await open_store(db)
    assert await first.setting("input_kind", "sha256") == "sha256"
    assert await second.setting("input_kind", "hmac-sha256:abc") == "sha256"
    assert await first.setting("input_kind", "other") == "sha256"
    assert await second.setting("another", "x") == "x"
    await first.aclose()
    await second.aclose()
    again, _ = await open_store(db)  # durable, and the database still opens as ours
    assert await again.setting("input_kind", "y") == "sha256"
    assert await again.setting("another", "z") == "x"
    await again.aclose()


async def test_racing_first_settings_agree(db: Path) -> None:
    stores = [(await open_store(db))[0] for _ in range(4)]
    answers: list[str] = []

    async def record(store: SQLiteStore, value: str) -> None:
        answers.append(await store.setting("kind", value))

    async with anyio.create_task_group() as tg:
        for n, store in enumerate(stores):
            for m in range(3):
                tg.start_soon(record, store, f"value-{n}-{m}")
    assert len(answers) == 12 and len(set(answers)) == 1
    for store in stores:
        await store.aclose()


async def test_settings_never_overwrite_what_says_whose_database_it_is(db: Path) -> None:
    store, _ = await open_store(db)
    assert await store.setting("application", "something else") == "something else"
    assert await store.setting("schema_version", "99") == "99"
    await store.aclose()
    connection = sqlite3.connect(db)
    meta = dict(connection.execute("SELECT key, value FROM itemjournal_meta").fetchall())
    connection.close()
    assert meta["application"] == "itemjournal"
    assert meta["schema_version"] == str(SCHEMA_VERSION)
    again, _ = await open_store(db)
    await again.aclose()


async def test_a_setting_is_text(db: Path) -> None:
    store, _ = await open_store(db)
    with pytest.raises(InvalidArgument):
        await store.setting("kind", b"bytes")  # type: ignore[arg-type]
    await store.aclose()
    with pytest.raises(StorageFailed, match="closed"):
        await store.setting("kind", "x")


async def test_recording_a_setting_waits_for_the_lock_like_any_write(db: Path) -> None:
    store, _ = await open_store(db, busy_timeout=0.2)
    assert await store.setting("known", "a") == "a"
    holder = await anyio.to_thread.run_sync(hold_write_lock, db)
    try:
        assert await store.setting("known", "b") == "a"  # recorded: read without the lock
        with pytest.raises(StorageFailed) as caught:
            await store.setting("new", "b")
        assert caught.value.errno == errno.ETIMEDOUT
    finally:
        await anyio.to_thread.run_sync(release, holder)
    assert await store.setting("new", "c") == "c"
    await store.aclose()


# ---------------------------------------------------------------------- closing


async def test_closing_waits_for_a_batch_under_way(db: Path) -> None:
    store, journal = await open_store(db)
    gate = Gate()
    answers: list[object] = []

    async def begin() -> None:
        answers.append(await journal.begin(item(1), INPUTS, DEFINITION))

    async with anyio.create_task_group() as tg:
        tg.start_soon(store.apply, Identity(*item("gate", "gate")), gate.step)
        await gate.entered.wait()
        tg.start_soon(begin)
        await anyio.wait_all_tasks_blocked()

        async def close() -> None:
            await journal.aclose()
            answers.append("closed")

        tg.start_soon(close)
        await anyio.wait_all_tasks_blocked()
        assert answers == []  # still waiting for the batch and the call queued behind it
        gate.open.set()
    assert isinstance(answers[0], Claim) and answers[1] == "closed"
    with pytest.raises(StorageFailed, match="closed"):
        await journal.inspect(item(1))


def test_an_unexpected_error_reading_a_row_is_that_rows_storage_failed(db: Path) -> None:
    """Not RECORD_INVALID, but still about that row alone (a scan yields it as an item,
    a batch gives it to that caller only)."""
    store = SQLiteStore(str(db))

    def broken(*args: object) -> Record:
        raise ZeroDivisionError("a bug")

    store._decode = broken  # type: ignore[method-assign,assignment]
    with pytest.raises(StorageFailed) as caught:
        store._read_row("d" * 64, "started", b"{}")
    assert isinstance(caught.value.__cause__, ZeroDivisionError)


# ---------------------------------------------------------------------- odd locations


def test_a_bytes_path_is_refused_clearly() -> None:
    with pytest.raises(InvalidArgument) as caught:
        SQLiteStore(b"/tmp/journal.db")  # type: ignore[arg-type]
    assert caught.value.code == "ABSOLUTE_ROOT_REQUIRED"


async def test_something_other_than_a_file_at_the_path_is_refused(tmp_path: Path) -> None:
    (tmp_path / "journal.db").mkdir(mode=0o700)
    with pytest.raises(StorageFailed, match="not a regular file"):
        await SQLiteStore(str(tmp_path / "journal.db")).open()
    await anyio.to_thread.run_sync(private_file, tmp_path / "plain")
    with pytest.raises(StorageFailed, match="cannot create") as caught:
        await SQLiteStore(str(tmp_path / "plain" / "journal.db")).open()
    assert caught.value.errno == errno.ENOTDIR


async def test_a_journal_whose_creation_stopped_half_way_is_finished(db: Path) -> None:
    await anyio.to_thread.run_sync(private_file, db)
    await anyio.to_thread.run_sync(
        execute, db, ("CREATE TABLE itemjournal_meta (key TEXT PRIMARY KEY, value TEXT)", ())
    )
    store, journal = await open_store(db)
    assert isinstance(await journal.begin(item(1), INPUTS, DEFINITION), Claim)
    await store.aclose()


async def test_a_setting_that_is_not_text_is_storage_failed(db: Path) -> None:
    store, _ = await open_store(db)
    await anyio.to_thread.run_sync(
        execute, db, ("INSERT INTO itemjournal_meta VALUES ('setting.kind', x'ff')", ())
    )
    with pytest.raises(StorageFailed, match="not readable text"):
        await store.setting("kind", "x")
    await store.aclose()


async def test_a_writer_that_cannot_be_reopened_fails_its_batch_and_is_tried_again(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, journal = await open_store(db)
    real = store._writer
    assert real is not None
    faulty = FaultyWriter(real, 1, MemoryError, fail_rollback=True)
    outcomes: list[object] = []

    async def begin(n: int) -> None:
        try:
            outcomes.append(await journal.begin(item(n), INPUTS, DEFINITION))
        except StorageFailed as error:
            outcomes.append(error)

    await one_batch(store, [lambda: begin(1)], lambda: setattr(store, "_writer", faulty))
    assert store._writer is None  # the rollback failed too: the connection was discarded
    connect = store._connect

    def refuse(**options: Any) -> sqlite3.Connection:
        raise sqlite3.OperationalError("unable to open database file")

    monkeypatch.setattr(store, "_connect", refuse)
    await begin(2)
    monkeypatch.setattr(store, "_connect", connect)
    await begin(3)
    first, second, third = outcomes
    assert isinstance(first, StorageFailed) and "nothing was written" in str(first)
    assert isinstance(second, StorageFailed) and "cannot reopen" in str(second)
    assert isinstance(third, Claim)
    for n, status in ((1, "absent"), (2, "absent"), (3, "started")):
        assert (await journal.inspect(item(n))).status == status
    await journal.aclose()


_OPEN_ONCE = """
import sys, anyio
from itemjournal import Journal

async def main():
    journal = await Journal.open(sys.argv[1])
    await journal.aclose()

anyio.run(main)
"""


def test_processes_opening_a_new_database_at_once_all_succeed(tmp_path: Path) -> None:
    """Several workers starting together (uvicorn --workers 4) on a database that does not
    exist yet: while one switches it to WAL, the others wait, none fails."""
    import subprocess
    import sys

    failures: list[str] = []
    for round_ in range(4):
        location = f"sqlite://{tmp_path}/r{round_}/journal.db"
        children = [
            subprocess.Popen(
                [sys.executable, "-c", _OPEN_ONCE, location],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(6)
        ]
        for child in children:
            _, err = child.communicate(timeout=60)
            if child.returncode != 0:
                failures.append(err.strip().splitlines()[-1])
    assert failures == []


async def test_a_document_that_names_its_column_status_only_elsewhere_is_in_doubt(
    db: Path,
) -> None:
    """The suspect test is a byte search for the status as the journal writes it: a
    status named in the history, or a document spaced or ordered another way, is no
    proof; such rows come with every status scan."""
    store, journal = await open_store(db)
    claim = await journal.begin(item(0), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    await journal.complete(claim, "r0", result='{"status": "started", "updated_at": 1}')
    review = await journal.begin(item(1), INPUTS, DEFINITION)
    assert isinstance(review, Claim)
    await journal.mark_review(item(1))
    connection = sqlite3.connect(db)
    [document] = connection.execute(
        "SELECT document FROM itemjournal_records WHERE digest = ?",
        (identity_digest(Identity(*item(1))),),
    ).fetchone()
    suspect = connection.execute(
        "SELECT count(*) FROM itemjournal_records INDEXED BY itemjournal_records_suspect "
        f"WHERE {_SUSPECT_CONDITION}"
    ).fetchone()[0]
    connection.close()
    assert suspect == 0  # a healthy journal: the index is empty
    assert b'"status": "needs_review", "updated_at": ' in document
    history = document.replace(b'"status": "started"}', b'"status": "released"}')
    assert history != document
    compact = json.dumps(json.loads(document), separators=(",", ":")).encode()
    planted = {
        # a needs_review record whose history says released, under the column released
        "history": ("released", history),
        # the same record spaced another way, under another status
        "spacing": ("succeeded", compact),
        # and under its own status: sound, but SQL cannot tell
        "spacing, agreeing": ("needs_review", compact),
    }
    keys = {name: f"{n:02d}" + "f" * 62 for n, name in enumerate(planted)}
    execute(
        db,
        *[
            (
                "INSERT INTO itemjournal_records (digest, status, document) VALUES (?, ?, ?)",
                (keys[name], column, body),
            )
            for name, (column, body) in planted.items()
        ],
    )
    for batch in (1, 2, 256):
        seen = [entry async for entry in store.scan(status="needs_review", batch=batch)]
        bad = sorted(
            str(e.location).rsplit("#", 1)[1] for e in seen if isinstance(e, RecordInvalid)
        )
        assert bad == sorted(keys.values()), batch  # stored under other digests: all invalid
        good = [e.identity.item for e in seen if isinstance(e, Record)]
        assert good == ["item-1"], batch
        started = [entry async for entry in store.scan(status="started", batch=batch)]
        assert len(started) == len(keys), batch  # every row in doubt, in every open scan
    await store.aclose()
