"""The PostgreSQL store against a real server: its own connections ended at random points,
outcomes lost in ``COMMIT`` settled by a fresh read, an exhausted pool, cancellation, owner
liveness across processes (and so across hosts), and what a location may say.

The server is the one ``ITEMJOURNAL_TEST_POSTGRES`` names; without it every test here is
skipped with that reason. Each test works in a schema of its own, dropped afterwards.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import _pg
import anyio
import psycopg
import pytest
from conftest import postgres_url

from itemjournal import (
    Claim,
    ConflictError,
    Identity,
    InvalidArgument,
    Journal,
    RecordInvalid,
    StorageFailed,
    definition_digest,
)
from itemjournal._model.identity import identity_digest
from itemjournal._model.records import Record
from itemjournal._stores.postgres.store import PostgresStore

DEFINITION = definition_digest("pgstore-v1")
INPUTS = {"n": 1}


@pytest.fixture
def store_kind() -> str:
    """Only the PostgreSQL store here (``location`` and ``make_journal`` follow it)."""
    postgres_url()
    return "postgres"


def ident(*labels: str) -> Identity:
    return Identity("pg", *labels)


async def record_of(journal: Journal, identity: Identity) -> Record | None:
    """The stored record exactly as the store reads it (``None``: there is none)."""

    def keep(record: Record | None) -> Record | None:
        return record

    return await journal.store.peek(identity, keep)


def end_session(connection: psycopg.Connection[Any], pid: int) -> None:
    """End the server session ``pid`` through ``connection`` and wait until it is gone
    (``pg_terminate_backend``'s own wait polls ten times a second: too slow here)."""
    connection.execute("SELECT pg_terminate_backend(%s)", (pid,))
    deadline = time.monotonic() + 5
    while connection.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
        assert time.monotonic() < deadline, f"session {pid} did not end"
        time.sleep(0.001)


def terminate(location: str, pid: int) -> None:
    """End the server session ``pid`` and wait until it is gone."""
    connection, _ = _pg.connect(location)
    with connection:
        end_session(connection, pid)


def store_of(journal: Journal) -> PostgresStore:
    store = journal.store
    assert isinstance(store, PostgresStore)
    return store


def with_parameter(location: str, name: str, value: str) -> str:
    return f"{location}&{urllib.parse.urlencode({name: value})}"


# ---------------------------------------------------------------------- faults


class Killer:
    """Ends the server session of the store's own connection at a chosen point of the next
    operation, from a connection of its own. Points:

    ``read``       before the row is read (the pooled connection was ended while idle)
    ``held``       before a claim's write, which checks that the owner lock is still held
    ``write``      after the step decided, before the row is written
    ``commit``     just before ``COMMIT``
    ``in_commit``  from another thread, 0-2 ms after ``COMMIT`` is sent
    ``random``     from a timer, 0-4 ms after the operation took its connection
    ``none``       not at all
    """

    POINTS = ("none", "read", "held", "write", "commit", "in_commit", "random")

    def __init__(self, location: str, store: PostgresStore, rng: random.Random) -> None:
        self.location = location
        self.rng = rng
        self.point = "none"
        self.fired: Counter[str] = Counter()
        self.threads: list[threading.Thread] = []
        self._connection, _ = _pg.connect(location)
        self._lock = threading.Lock()
        self._kill_lock = threading.Lock()
        real_attempt, real_held = store._attempt, store._held
        real_write, real_commit = store._write, store._commit

        def attempt(connection: psycopg.Connection[Any], *args: Any) -> Any:
            if self._take("read"):
                self.kill(connection.info.backend_pid)
            elif self._take("random"):
                timer = threading.Timer(
                    self.rng.uniform(0, 0.004), self.kill, (connection.info.backend_pid,)
                )
                timer.start()
                self.threads.append(timer)
            return real_attempt(connection, *args)

        def held(connection: psycopg.Connection[Any], token: int) -> Any:
            if self._take("held"):
                self.kill(connection.info.backend_pid)
            return real_held(connection, token)

        def write(connection: psycopg.Connection[Any], *args: Any, **options: Any) -> Any:
            if self._take("write") or (options.get("vouch") is not None and self._take("held")):
                self.kill(connection.info.backend_pid)
            return real_write(connection, *args, **options)

        def commit(connection: psycopg.Connection[Any], *args: Any) -> Any:
            if self._take("commit"):
                self.kill(connection.info.backend_pid)
            elif self._take("in_commit"):
                delay = self.rng.uniform(0, 0.002)
                thread = threading.Thread(
                    target=self.kill, args=(connection.info.backend_pid, delay)
                )
                thread.start()
                self.threads.append(thread)
            return real_commit(connection, *args)

        store._attempt = attempt  # type: ignore[method-assign]
        store._held = held  # type: ignore[method-assign]
        store._write = write  # type: ignore[method-assign]
        store._commit = commit  # type: ignore[method-assign]

    def _take(self, point: str) -> bool:
        with self._lock:
            if self.point != point:
                return False
            self.point = "none"
            self.fired[point] += 1
            return True

    def kill(self, pid: int, delay: float = 0.0) -> None:
        time.sleep(delay)
        with self._kill_lock:
            end_session(self._connection, pid)

    def arm(self, point: str) -> None:
        with self._lock:
            self.point = point

    def close(self) -> None:
        for thread in self.threads:
            thread.join()
        self._connection.close()


def outcome_of(error: StorageFailed) -> str:
    """``nothing`` (the message says nothing was written) or ``unknown``; nothing else."""
    assert error.code == "STORAGE_FAILED"
    assert isinstance(error, OSError)
    text = str(error)
    if "unknown" in text:
        return "unknown"
    assert "nothing was written" in text, text
    return "nothing"


@pytest.mark.anyio
@pytest.mark.slow
async def test_ended_sessions_at_random_points(location: str, anyio_backend: str) -> None:
    rng = random.Random(f"pg-faults-{anyio_backend}")
    journal = await Journal.open(location)
    reader = await Journal.open(location)  # a fresh reader: a pool (and sessions) of its own
    store = store_of(journal)
    killer = Killer(location, store, rng)
    results: Counter[str] = Counter()
    claims_granted: Counter[Identity] = Counter()
    iterations = 200

    async def attempt_op(operation: Callable[[], Any], tries: int) -> tuple[str, Any]:
        # The first three tries of an operation meet a fault; later ones run in peace.
        killer.arm(rng.choice(Killer.POINTS) if tries < 3 else "none")
        settled = store.unknown_settled
        try:
            answer = await operation()
        except StorageFailed as error:
            outcome = outcome_of(error)
            if store.unknown_settled > settled:
                assert outcome == "nothing" and "not saved" in str(error), error
                results["lost commits settled as not saved"] += 1
            return outcome, error
        except ConflictError as error:
            return "conflict", error
        finally:
            killer.arm("none")
        if store.unknown_settled > settled:
            results["lost commits settled as saved"] += 1
        return "ok", answer

    try:
        for n in range(iterations):
            identity = ident("faults", "item", f"i{n}")
            claim: Claim | None = None
            unknown_begin = False
            for tries in range(6):
                before = await record_of(reader, identity)
                outcome, answer = await attempt_op(
                    lambda identity=identity: journal.begin(identity, INPUTS, DEFINITION), tries
                )
                after = await record_of(reader, identity)
                results[f"begin {outcome}"] += 1
                if outcome == "ok":
                    assert isinstance(answer, Claim)
                    claims_granted[identity] += 1
                    assert after is not None and after.status == "started"
                    assert after.claim_id == answer.claim_id
                    claim = answer
                    break
                if outcome == "nothing":
                    assert after == before, answer
                    continue
                if outcome == "unknown":
                    assert after == before or (after is not None and after.status == "started")
                    unknown_begin = unknown_begin or after != before
                    continue
                # A begin whose earlier outcome was lost but saved: our own claim, running.
                assert unknown_begin, answer
                assert answer.code == "IN_PROGRESS", answer
                break
            if claim is None:
                continue
            receipt = f"r{n}"
            for tries in range(6):
                before = await record_of(reader, identity)
                assert before is not None
                outcome, answer = await attempt_op(
                    lambda claim=claim, receipt=receipt: journal.complete(claim, receipt), tries
                )
                after = await record_of(reader, identity)
                assert after is not None
                results[f"complete {outcome}"] += 1
                if outcome == "ok":
                    assert answer.status == "succeeded"
                    assert after.status == "succeeded"
                    assert after.receipt == receipt
                    assert after.claim_id == claim.claim_id
                    break
                if outcome == "nothing":
                    assert after == before, answer
                    continue
                if outcome == "unknown":
                    assert after == before or (
                        after.status == "succeeded" and after.receipt == receipt
                    )
                    continue
                # An earlier complete was saved although its answer was lost.
                assert answer.code == "NOT_STARTED", answer
                assert after.status == "succeeded" and after.receipt == receipt
                break
            else:
                pytest.fail(f"{identity} could not be completed in 6 tries")
        killer.close()
        # No identity was ever granted two claims, and every record reads back whole.
        assert max(claims_granted.values()) == 1
        records = 0
        async for record in reader.store.scan():
            assert not isinstance(record, Exception), record
            records += 1
            assert record.attempt == 1
            assert [event.event for event in record.history].count("begin") == 1
        assert records >= len(claims_granted)
    finally:
        killer.close()
        await journal.aclose()
        await reader.aclose()
    assert results["begin ok"] + results["begin conflict"] >= iterations * 9 // 10
    figures = ", ".join(f"{name} {count}" for name, count in sorted(results.items()))
    kills = ", ".join(f"{point} {count}" for point, count in sorted(killer.fired.items()))
    print(
        f"\n{anyio_backend}: {iterations} begin+complete with sessions ended ({kills}): "
        f"{figures}; {records} records, no double claim"
    )


class LostCommit:
    """Replace the next ``COMMIT`` of a store's own connection by ``how``:

    ``saved``    the server commits, its answer is lost (the session lingers)
    ``lost``     the session is ended just before ``COMMIT``: it never commits
    """

    def __init__(self, location: str, store: PostgresStore, how: str) -> None:
        self.pids: list[int] = []
        real_commit = store._commit

        def commit(connection: psycopg.Connection[Any], *args: Any) -> Any:
            store._commit = real_commit  # type: ignore[method-assign]
            pid = connection.info.backend_pid
            self.pids.append(pid)
            real = connection.commit

            def committing() -> None:
                if how == "saved":
                    real()
                    raise psycopg.OperationalError("server closed the connection unexpectedly")
                terminate(location, pid)
                real()

            connection.commit = committing  # type: ignore[method-assign]
            try:
                return real_commit(connection, *args)
            finally:
                del connection.commit

        store._commit = commit  # type: ignore[method-assign]


def session_exists(location: str, pid: int) -> bool:
    connection, _ = _pg.connect(location)
    with connection:
        row = connection.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
    return bool(row and row[0])


@pytest.mark.anyio
async def test_a_commit_whose_answer_was_lost_is_settled_as_saved(location: str) -> None:
    journal = await Journal.open(location)
    reader = await Journal.open(location)
    store = store_of(journal)
    identity = ident("settle", "saved", "x")
    lost = LostCommit(location, store, "saved")
    claim = await journal.begin(identity, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    assert store.unknown_settled == 1
    # The session that ran the commit was fenced (ended) before the re-read.
    assert not session_exists(location, lost.pids[0])
    record = await record_of(reader, identity)
    assert record is not None and record.claim_id == claim.claim_id
    # The settled claim is an ordinary claim: completing it works.
    done = await journal.complete(claim, "receipt-1")
    assert done.status == "succeeded"
    await journal.aclose()
    await reader.aclose()


@pytest.mark.anyio
async def test_a_commit_lost_before_it_ran_is_settled_as_not_saved(location: str) -> None:
    journal = await Journal.open(location)
    reader = await Journal.open(location)
    store = store_of(journal)
    claim = await journal.begin(ident("settle", "not", "x"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    # A begin whose commit is lost: no claim, no record.
    LostCommit(location, store, "lost")
    with pytest.raises(StorageFailed) as caught:
        await journal.begin(ident("settle", "not", "y"), INPUTS, DEFINITION)
    assert "not saved" in str(caught.value) and "nothing was written" in str(caught.value)
    assert store.unknown_settled == 1
    assert await record_of(reader, ident("settle", "not", "y")) is None
    # A complete whose commit is lost: the record is still started, with the same claim.
    before = await record_of(reader, claim.identity)
    LostCommit(location, store, "lost")
    with pytest.raises(StorageFailed) as caught:
        await journal.complete(claim, "receipt-1")
    assert outcome_of(caught.value) == "nothing"
    assert store.unknown_settled == 2
    assert await record_of(reader, claim.identity) == before
    assert (await journal.complete(claim, "receipt-1")).status == "succeeded"
    await journal.aclose()
    await reader.aclose()


@pytest.mark.anyio
async def test_a_lost_commit_that_cannot_be_read_again_is_unknown(
    location: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = await Journal.open(location)
    store = store_of(journal)
    LostCommit(location, store, "lost")

    def unreachable(*args: object, **kwargs: object) -> psycopg.Connection[Any]:
        raise psycopg.OperationalError("connection refused: the server cannot be reached")

    with monkeypatch.context() as patch:
        patch.setattr(psycopg, "connect", unreachable)
        with pytest.raises(StorageFailed) as caught:
            await journal.begin(ident("settle", "unknown", "x"), INPUTS, DEFINITION)
    text = str(caught.value)
    assert outcome_of(caught.value) == "unknown"
    assert "whether it was saved is unknown" in text
    assert "cannot read it again" in text
    assert "nothing was written" not in text
    assert isinstance(caught.value.__cause__, psycopg.Error)
    assert store.unknown_settled == 0
    await journal.aclose()


# ---------------------------------------------------------------------- waits and timeouts


@pytest.mark.anyio
async def test_an_exhausted_pool_fails_clearly_after_its_timeout(location: str) -> None:
    journal = await Journal.open(with_parameter(location, "pool_size", "1"), lock_timeout=0.5)
    store = store_of(journal)
    assert store.pool_size == 1
    pool = store._pool
    assert pool is not None
    held = await anyio.to_thread.run_sync(pool.getconn)  # the only connection is busy
    try:
        started = time.monotonic()
        with pytest.raises(StorageFailed) as caught:
            await journal.begin(ident("pool", "exhausted", "x"), INPUTS, DEFINITION)
        waited = time.monotonic() - started
    finally:
        pool.putconn(held)
    assert 0.45 <= waited < 2.5, waited
    assert caught.value.errno == errno.ETIMEDOUT
    assert "pool_size=1" in str(caught.value)
    assert "0.5 s" in str(caught.value)
    # The pool is whole again afterwards.
    assert isinstance(
        await journal.begin(ident("pool", "exhausted", "x"), INPUTS, DEFINITION), Claim
    )
    await journal.aclose()
    print(f"\nexhausted pool (pool_size=1, lock_timeout=0.5): STORAGE_FAILED after {waited:.2f} s")


@pytest.mark.anyio
async def test_a_held_row_times_out_with_etimedout(location: str) -> None:
    journal = await Journal.open(with_parameter(location, "pool_size", "1"), lock_timeout=0.3)
    claim = await journal.begin(ident("row", "held", "x"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    holder = await anyio.to_thread.run_sync(_pg.hold_row, location, claim.key)
    try:
        started = time.monotonic()
        with pytest.raises(StorageFailed) as caught:
            await journal.complete(claim, "receipt-1")
        waited = time.monotonic() - started
    finally:
        holder.close()
    assert 0.25 <= waited < 2.5, waited
    assert caught.value.errno == errno.ETIMEDOUT
    assert outcome_of(caught.value) == "nothing"
    # The one pooled connection was given back: the call goes through now.
    assert (await journal.complete(claim, "receipt-1")).status == "succeeded"
    await journal.aclose()


# ---------------------------------------------------------------------- cancellation


@pytest.mark.anyio
async def test_cancellation_at_random_points(location: str, anyio_backend: str) -> None:
    rng = random.Random(f"pg-cancel-{anyio_backend}")
    journal = await Journal.open(location)
    reader = await Journal.open(location)
    counts: Counter[str] = Counter()
    rounds = 120
    for n in range(rounds):
        identity = ident("cancel", "item", f"i{n}")
        claim: Claim | Any = None
        with anyio.move_on_after(rng.choice((0, rng.uniform(0, 0.012)))):
            claim = await journal.begin(identity, INPUTS, DEFINITION)
        record = await record_of(reader, identity)
        if claim is None:  # cancelled: it left nothing behind
            assert record is None, record
            counts["begin cancelled"] += 1
            continue
        assert isinstance(claim, Claim)
        assert record is not None and record.status == "started"
        assert record.claim_id == claim.claim_id
        counts["begin granted"] += 1
        done = None
        with anyio.move_on_after(rng.choice((0, rng.uniform(0, 0.012)))):
            done = await journal.complete(claim, f"r{n}")
        after = await record_of(reader, identity)
        assert after is not None
        if done is not None:
            assert done.status == after.status == "succeeded"
            counts["complete done"] += 1
        elif after == record:
            counts["complete cancelled, untouched"] += 1
        else:  # cancelled once the commit had begun: as a completed call leaves it
            assert after.status == "succeeded" and after.receipt == f"r{n}"
            assert after.claim_id == claim.claim_id
            counts["complete cancelled, completed"] += 1

    # Cancelled while waiting for a row another session holds: the wait ends at once.
    slowest = 0.0
    for n in range(6):
        identity = ident("cancel", "held", f"i{n}")
        claim = await journal.begin(identity, INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        before = await record_of(reader, identity)
        holder = await anyio.to_thread.run_sync(_pg.hold_row, location, claim.key)
        try:
            delay = rng.uniform(0.01, 0.05)
            started = time.monotonic()
            with anyio.move_on_after(delay) as scope:
                await journal.complete(claim, "never")
            slowest = max(slowest, time.monotonic() - started - delay)
            assert scope.cancelled_caught
        finally:
            holder.close()
        assert await record_of(reader, identity) == before
        # ...and a claim whose insert waits for another session's uncommitted row.
        fresh = ident("cancel", "insert", f"i{n}")
        holder = await anyio.to_thread.run_sync(_pg.hold_row, location, identity_digest(fresh))
        try:
            delay = rng.uniform(0.01, 0.05)
            started = time.monotonic()
            with anyio.move_on_after(delay) as scope:
                await journal.begin(fresh, INPUTS, DEFINITION)
            slowest = max(slowest, time.monotonic() - started - delay)
            assert scope.cancelled_caught
        finally:
            holder.close()
        assert await record_of(reader, fresh) is None
        counts["waits cancelled"] += 2
    # Interrupted, not waited out (30 s): about 10 ms here, past 1 s on a loaded machine.
    assert slowest < 5.0, slowest

    # No cancelled call left a transaction holding a row, and the pool still serves.
    connection, schema = _pg.connect(location, autocommit=False)
    with connection:
        rows = connection.execute(f"SELECT digest FROM {schema}.records FOR UPDATE NOWAIT")
        assert len(rows.fetchall()) == counts["begin granted"] + 6
    claim = await journal.begin(ident("cancel", "after", "x"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    assert (await journal.complete(claim, "done")).status == "succeeded"
    await journal.aclose()
    await reader.aclose()
    figures = ", ".join(f"{name} {count}" for name, count in sorted(counts.items()))
    print(
        f"\n{anyio_backend}: {rounds} rounds: {figures}; cancelled waits ended at most "
        f"{slowest * 1000:.0f} ms after their deadline"
    )


# ---------------------------------------------------------------------- owners


HOLDER = """
import sys
import anyio
from itemjournal import Claim, Journal, definition_digest

async def main(location, items):
    journal = await Journal.open(location)
    for item in items.split(","):
        claim = await journal.begin(
            ("pg", "host", "owner", item), {"n": 1}, definition_digest("pgstore-v1")
        )
        assert isinstance(claim, Claim)
    print("held", flush=True)
    await anyio.to_thread.run_sync(sys.stdin.readline)

anyio.run(main, sys.argv[1], sys.argv[2], backend=sys.argv[3])
"""


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_killed_hosts_claims_are_seen_gone(location: str, anyio_backend: str) -> None:
    journal = await Journal.open(location)
    host = subprocess.Popen(
        [sys.executable, "-c", HOLDER, location, "a,b", anyio_backend],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert host.stdout is not None
    try:
        with anyio.fail_after(60):
            line = await anyio.to_thread.run_sync(host.stdout.readline)
        assert line.strip() == "held"
        a, b = ident("host", "owner", "a"), ident("host", "owner", "b")
        # While it lives: alive, not swept, in progress.
        view = await journal.inspect(a)
        assert view.status == "started" and view.owner_alive is True
        assert view.owner is not None and view.owner.pid == host.pid
        assert view.owner.session.startswith("pg:")
        assert view.owner.session != store_of(journal).owner().session
        assert (await journal.sweep()).marked == ()
        with pytest.raises(ConflictError) as refused:
            await journal.begin(a, INPUTS, DEFINITION)
        assert refused.value.code == "IN_PROGRESS"
        host.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        await anyio.to_thread.run_sync(host.wait)
        with anyio.fail_after(15):
            while (await journal.inspect(a)).owner_alive is not False:  # noqa: ASYNC110 - the server decides
                await anyio.sleep(0.02)
        seen = time.monotonic() - killed
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
        host.stdout.close()
        if host.stdin is not None:
            host.stdin.close()
    # begin finds the dead owner and marks its claim for review; sweep takes the other.
    with pytest.raises(ConflictError) as refused:
        await journal.begin(a, INPUTS, DEFINITION)
    assert refused.value.code == "REVIEW_REQUIRED"
    view = await journal.inspect(a)
    assert view.status == "needs_review"
    assert view.review_reason == "owner session gone"
    swept = (await journal.sweep()).marked
    assert [v.identity for v in swept] == [b]
    assert swept[0].review_reason == "owner session gone"
    await journal.aclose()
    print(f"\n{anyio_backend}: a SIGKILLed host's claim seen gone after {seen:.3f} s")


@pytest.mark.anyio
async def test_a_lost_owner_session_is_renewed_before_the_next_claim(location: str) -> None:
    mine = await Journal.open(location)
    other = await Journal.open(location)
    store = store_of(mine)
    x, y = ident("session", "lost", "x"), ident("session", "lost", "y")
    first = await mine.begin(x, INPUTS, DEFINITION)
    assert isinstance(first, Claim)
    session = store._session
    assert session is not None
    view = await other.inspect(x)
    assert view.owner is not None and view.owner.session == session.name
    assert view.owner_alive is True  # held by a live store in this process
    assert (await mine.inspect(x)).owner_alive is True

    await anyio.to_thread.run_sync(terminate, location, session.pid)
    assert (await other.inspect(x)).owner_alive is False  # the lock went with its session

    second = await mine.begin(y, INPUTS, DEFINITION)
    assert isinstance(second, Claim)
    renewed = store._session
    assert renewed is not None and renewed.pid != session.pid
    view = await other.inspect(y)
    assert view.owner is not None and view.owner.session == renewed.name != session.name
    assert view.owner_alive is True
    # The earlier claim is gone for everyone, its own store too: marked for review, and
    # its late complete is refused, never a second run.
    assert (await mine.inspect(x)).owner_alive is False
    with pytest.raises(ConflictError) as refused:
        await other.begin(x, INPUTS, DEFINITION)
    assert refused.value.code == "REVIEW_REQUIRED"
    with pytest.raises(ConflictError) as refused:
        await mine.complete(first, "late")
    assert refused.value.code == "NOT_STARTED"
    assert (await mine.complete(second, "fine")).status == "succeeded"
    await mine.aclose()
    await other.aclose()


# ---------------------------------------------------------------------- locations


def _with_password(url: str, password: str) -> str:
    parts = urllib.parse.urlsplit(url)
    user, _, host = parts.netloc.rpartition("@")
    return urllib.parse.urlunsplit(
        parts._replace(netloc=f"{user.split(':')[0] or 'postgres'}:{password}@{host}")
    )


def _messages(error: BaseException | None) -> Iterator[str]:
    while error is not None:
        yield str(error)
        yield repr(error)
        error = error.__cause__ or error.__context__


@pytest.mark.anyio
async def test_a_password_is_never_shown(location: str) -> None:
    secret = "s3cr3t-" + "pw"
    closed = f"postgresql://someone:{secret}@127.0.0.1:1/test?schema=x&connect_timeout=1"
    store = PostgresStore(closed)
    for text in (repr(store), store.location):
        assert secret not in text and "***" in text
    query_form = f"postgresql://someone@127.0.0.1:1/test?password={secret}"
    assert secret not in PostgresStore(query_form).location
    for unreachable in (closed, query_form):
        with pytest.raises(StorageFailed) as caught:
            await Journal.open(unreachable, lock_timeout=0.5)
        assert all(secret not in text for text in _messages(caught.value)), caught.value
        assert "127.0.0.1" in str(caught.value)

    # On a server that takes the URL (trust authentication ignores the password).
    if urllib.parse.urlsplit(location).password is not None:
        pytest.skip("the test server's URL carries a password of its own")
    journal = await Journal.open(_with_password(location, secret))
    for text in (repr(journal.store), store_of(journal).location, repr(journal)):
        assert secret not in text
    claim = await journal.begin(ident("secret", "x", "y"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    await anyio.to_thread.run_sync(_pg.put_document, location, claim.key, b"{not json")
    with pytest.raises(RecordInvalid) as bad:
        await journal.inspect(claim.identity)
    assert all(secret not in text for text in _messages(bad.value))
    assert bad.value.location is not None and secret not in bad.value.location
    await journal.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("schema", ["Upper", "1st", "a-b", "", "x" * 64, "a;drop", "é"])
async def test_a_bad_schema_is_invalid_argument(location: str, schema: str) -> None:
    url, _ = _pg.split(location)
    with pytest.raises(InvalidArgument) as caught:
        await Journal.open(with_parameter(url + "?x=1", "schema", schema))
    assert caught.value.code == "INVALID_ARGUMENT"
    assert "schema" in str(caught.value)


@pytest.mark.anyio
@pytest.mark.parametrize("size", ["0", "101", "-1", "x", "", "1.5", " 2"])
async def test_a_bad_pool_size_is_invalid_argument(location: str, size: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        await Journal.open(with_parameter(location, "pool_size", size))
    assert caught.value.code == "INVALID_ARGUMENT"
    assert "pool_size" in str(caught.value)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("tables", "said"),
    [
        (["CREATE TABLE {s}.records (id int)"], "did not make"),
        (["CREATE TABLE {s}.meta (key text PRIMARY KEY, value text)"], "did not make"),
        (
            [
                "CREATE TABLE {s}.records (id int)",
                "CREATE TABLE {s}.meta (key text PRIMARY KEY, value text)",
                "INSERT INTO {s}.meta VALUES ('kind', 'something-else')",
            ],
            "not made by itemjournal",
        ),
        (
            ["CREATE TABLE {s}.records (id int)", "CREATE TABLE {s}.meta (id int)"],
            "not made by itemjournal",
        ),
        (
            ["CREATE TABLE {s}.records (id int)", "CREATE TABLE {s}.meta (key int, value int)"],
            "not made by itemjournal",
        ),
        (
            ["CREATE TABLE {s}.records (id int)", "CREATE TABLE {s}.meta (key jsonb, value int)"],
            "not made by itemjournal",
        ),
    ],
)
async def test_tables_made_by_another_program_are_refused(
    location: str, tables: list[str], said: str
) -> None:
    connection, schema = _pg.connect(location)
    with connection:
        connection.execute(f"CREATE SCHEMA {schema}")
        for statement in tables:
            connection.execute(statement.format(s=schema))
    with pytest.raises(StorageFailed) as caught:
        await Journal.open(location)
    assert said in str(caught.value)
    assert "?schema=" in str(caught.value) or said == "not made by itemjournal"
    connection, schema = _pg.connect(location)
    with connection:  # nothing of theirs was touched
        found = connection.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = %s", (schema,)
        ).fetchone()
    assert found is not None and found[0] == len([t for t in tables if "CREATE" in t])


OPENER = """
import sys
import anyio
from itemjournal import Journal

async def main(location):
    print("ready", flush=True)
    await anyio.to_thread.run_sync(sys.stdin.readline)
    journal = await Journal.open(location)
    await journal.aclose()
    print("opened", flush=True)

anyio.run(main, sys.argv[1])
"""


def test_first_openers_racing_to_create_the_schema_all_succeed(location: str) -> None:
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER, location],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    for process in processes:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def open_in_thread() -> None:
        async def main() -> None:
            journal = await Journal.open(location)
            await journal.aclose()

        try:
            barrier.wait()
            anyio.run(main)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=open_in_thread) for _ in range(4)]
    for process in processes:
        assert process.stdin is not None
        process.stdin.write("go\n")
        process.stdin.flush()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    outputs = [process.communicate(timeout=60)[0] for process in processes]
    assert errors == []
    assert all(process.returncode == 0 for process in processes), outputs
    assert all(out.strip() == "opened" for out in outputs)

    async def use() -> None:
        journal = await Journal.open(location)
        assert await journal.store.check() == []
        claim = await journal.begin(ident("race", "open", "x"), INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        await journal.aclose()

    anyio.run(use)


@pytest.mark.anyio
@pytest.mark.parametrize("scheme", ["postgres", "PostgreSQL"])
async def test_other_spellings_of_the_scheme(location: str, scheme: str) -> None:
    url = f"{scheme}://{location.partition('://')[2]}"
    journal = await Journal.open(url)
    assert store_of(journal).location.startswith(f"{scheme.lower()}://")
    claim = await journal.begin(ident("scheme", scheme.lower(), "x"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    assert (await journal.inspect(claim.identity)).status == "started"
    await journal.aclose()


@pytest.mark.anyio
async def test_other_url_parameters_reach_the_server(location: str) -> None:
    name = f"ijtest-{os.getpid()}-{random.randrange(1 << 30)}"
    journal = await Journal.open(with_parameter(location, "application_name", name))
    store = store_of(journal)
    claim = await journal.begin(ident("params", "x", "y"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    connection, _ = _pg.connect(location)
    with connection:
        pids = {
            row[0]
            for row in connection.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (name,)
            )
        }
    session = store._session
    assert session is not None and session.pid in pids
    assert len(pids) >= 2  # the owner lock's connection and at least one pooled one
    await journal.aclose()
