"""The PostgreSQL store behind Debian's PgBouncer, started by the tests on a free loopback
port in front of a cluster of their own: transaction (and statement) pooling refused at open
unless the owner-lock session has a direct connection (``owner_url``), and then liveness
exact under load; no advisory lock left on any server session; a commit lost behind session
pooling settled by the server's own name of the session.

Skipped when PgBouncer or PostgreSQL's server programs are missing; under CI (``CI=true``)
they fail instead.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from typing import Any

import _pg
import anyio
import psycopg
import pytest

from itemjournal import Claim, ConflictError, Identity, Journal, StorageFailed, definition_digest
from itemjournal._stores.postgres.store import PostgresStore

DEFINITION = definition_digest("pgbouncer-v1")
INPUTS = {"n": 1}


def ident(*labels: str) -> Identity:
    return Identity("bouncer", "test", *labels)


def store_of(journal: Journal) -> PostgresStore:
    store = journal.store
    assert isinstance(store, PostgresStore)
    return store


SYNCHRONOUS_COMMIT = ("off", "local", "remote_write", "on", "remote_apply")


def sync_role(configured: str) -> str:
    """The role whose sessions have ``synchronous_commit`` set to ``configured``."""
    return f"ij_sync_{configured}"


@pytest.fixture(scope="module")
def server() -> Iterator[_pg.Cluster]:
    with _pg.cluster(max_connections=150) as made:
        for configured in SYNCHRONOUS_COMMIT:
            role = sync_role(configured)
            made.execute(f"CREATE ROLE {role} LOGIN")
            made.execute(f"GRANT CREATE, CONNECT ON DATABASE test TO {role}")
            made.execute(f"ALTER ROLE {role} SET synchronous_commit = {configured}")
        yield made


ROLES = tuple(sync_role(configured) for configured in SYNCHRONOUS_COMMIT)


@pytest.fixture(scope="module")
def transaction_pooler(server: _pg.Cluster) -> Iterator[str]:
    # Few server sessions, so that every client's transactions share them.
    with _pg.pgbouncer(server.url, "transaction", pool_size=4, users=ROLES) as url:
        yield url


@pytest.fixture(scope="module")
def session_pooler(server: _pg.Cluster) -> Iterator[str]:
    with _pg.pgbouncer(server.url, "session", pool_size=100, users=ROLES) as url:
        yield url


def schema_query() -> str:
    return f"schema=ijb_{secrets.token_hex(4)}"


def with_owner(pooled: str, direct: str, query: str) -> str:
    """A location through ``pooled`` whose owner-lock session connects to ``direct``."""
    return f"{pooled}?{query}&owner_url={urllib.parse.quote(direct, safe='')}"


def advisory_locks(server: _pg.Cluster, *, besides: set[int] = frozenset()) -> int:  # type: ignore[assignment]
    """Advisory locks held on the server by any session but ``besides``."""
    with psycopg.connect(server.admin_url(), autocommit=True) as connection:
        row = connection.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND NOT (pid = ANY(%s))",
            (list(besides),),
        ).fetchone()
    assert row is not None
    return int(row[0])


def backend_gone(server: _pg.Cluster, pid: int, timeout: float = 10.0) -> None:
    """Wait until no server backend has ``pid`` any more."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(server.admin_url(), autocommit=True) as connection:
        while time.monotonic() < deadline:
            row = connection.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            if row is not None and row[0] == 0:
                return
            time.sleep(0.01)
    raise AssertionError(f"the backend {pid} did not end within {timeout} s")


# ---------------------------------------------------------------------- transaction pooling


@pytest.mark.anyio
@pytest.mark.slow
async def test_transaction_pooling_is_refused_at_open_and_leaves_no_lock(
    server: _pg.Cluster, transaction_pooler: str
) -> None:
    before = advisory_locks(server)
    outcomes: Counter[str] = Counter()
    messages: set[str] = set()
    for n in range(25):
        try:
            journal = await Journal.open(f"{transaction_pooler}?{schema_query()}")
        except StorageFailed as error:
            outcomes["refused"] += 1
            messages.add(str(error).split(": ", 1)[1].split(" is reached", 1)[1])
            continue
        outcomes["opened"] += 1
        try:  # what the store did on a transaction pooler before it refused one
            for m in range(4):
                identity = ident("refused", f"{n}-{m}")
                try:
                    await journal.begin(identity, INPUTS, DEFINITION)
                    await journal.begin(identity, INPUTS, DEFINITION)
                except (ConflictError, StorageFailed) as error:
                    outcomes[getattr(error, "code", "error")] += 1
        finally:
            await journal.aclose()
    after = advisory_locks(server)
    print(f"\ntransaction pooling, 25 opens: {dict(outcomes)}; advisory locks {before} -> {after}")
    assert after == before
    assert outcomes == {"refused": 25}
    (message,) = messages
    assert "transaction (or statement) pooling" in message and "owner_url" in message


@pytest.mark.anyio
async def test_statement_pooling_is_refused_at_open(server: _pg.Cluster) -> None:
    with (
        _pg.pgbouncer(server.url, "statement", pool_size=4) as pooler,
        pytest.raises(StorageFailed) as refused,
    ):
        await Journal.open(f"{pooler}?{schema_query()}")
    assert "statement) pooling" in str(refused.value)


@pytest.mark.anyio
async def test_an_owner_url_through_the_transaction_pooler_is_refused(
    server: _pg.Cluster, transaction_pooler: str
) -> None:
    with pytest.raises(StorageFailed) as refused:
        await Journal.open(with_owner(transaction_pooler, transaction_pooler, schema_query()))
    assert "owner_url" in str(refused.value) and "direct connection" in str(refused.value)
    other = f"postgresql://postgres@127.0.0.1:{server.port}/postgres"
    with pytest.raises(StorageFailed) as refused:
        await Journal.open(with_owner(transaction_pooler, other, schema_query()))
    assert "another server or database" in str(refused.value)


@pytest.mark.anyio
@pytest.mark.slow
async def test_no_advisory_lock_is_left_after_many_begins_behind_transaction_pooling(
    server: _pg.Cluster, transaction_pooler: str, anyio_backend: str
) -> None:
    before = advisory_locks(server)
    location = with_owner(transaction_pooler, server.url, schema_query())
    outcomes: Counter[str] = Counter()
    async with await Journal.open(location) as journal:
        store = store_of(journal)
        assert store.pooling == "transaction"
        session = store._session
        assert session is not None

        async def worker(first: int) -> None:
            for n in range(first, 300, 6):
                identity = ident("locks", f"i{n}")
                claim = await journal.begin(identity, INPUTS, DEFINITION)
                assert isinstance(claim, Claim)
                outcomes["granted"] += 1
                with pytest.raises(ConflictError) as refused:  # a failed begin
                    await journal.begin(identity, INPUTS, DEFINITION)
                outcomes[refused.value.code] += 1
                if n % 2:
                    await journal.complete(claim, f"r{n}")
                    outcomes["completed"] += 1

        async with anyio.create_task_group() as group:
            for first in range(6):
                group.start_soon(worker, first)
        during = advisory_locks(server, besides={session.pid})
    # The owner session's backend ends on the server shortly after its client closed it;
    # its lock goes with it. Counted once it is gone.
    await anyio.to_thread.run_sync(backend_gone, server, session.pid)
    after = advisory_locks(server)
    print(
        f"\n{anyio_backend}: transaction pooling with owner_url: {dict(outcomes)}; advisory "
        f"locks before {before}, beside the owner session during {during}, after {after}"
    )
    assert outcomes["granted"] + outcomes["IN_PROGRESS"] >= 500
    assert during == before == after


HOLDER = """
import sys
import anyio
from itemjournal import Claim, Journal, definition_digest

DEFINITION = definition_digest("pgbouncer-v1")

async def main(location, cycles):
    journal = await Journal.open(location)
    claim = await journal.begin(("bouncer", "test", "alive", "held"), {"n": 1}, DEFINITION)
    assert isinstance(claim, Claim)
    print("held", flush=True)
    done = 0

    async def load(first):
        nonlocal done
        for n in range(first, cycles, 4):
            ident = ("bouncer", "test", "load", f"i{n}")
            other = await journal.begin(ident, {"n": 1}, DEFINITION)
            await journal.complete(other, f"r{n}")
            done += 1

    async with anyio.create_task_group() as group:
        for first in range(4):
            group.start_soon(load, first)
    print(f"loaded {done}", flush=True)
    await anyio.to_thread.run_sync(sys.stdin.readline)

anyio.run(main, sys.argv[1], int(sys.argv[2]), backend=sys.argv[3])
"""


@pytest.mark.anyio
@pytest.mark.slow
async def test_liveness_is_exact_behind_transaction_pooling_with_a_direct_owner_session(
    server: _pg.Cluster, transaction_pooler: str, anyio_backend: str
) -> None:
    location = with_owner(transaction_pooler, server.url, schema_query())
    held = ident("alive", "held")
    async with await Journal.open(location) as judge:  # makes the schema first
        host = subprocess.Popen(
            [sys.executable, "-c", HOLDER, location, "600", anyio_backend],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert host.stdout is not None
        probes: Counter[object] = Counter()  # inspections' owner_alive, begins' codes
        inspections = 0
        refusals = 0  # opens without owner_url while the load runs
        try:
            with anyio.fail_after(60):
                line = await anyio.to_thread.run_sync(host.stdout.readline)
            assert line.strip() == "held"
            finished: list[str] = []

            def wait_for_load() -> None:
                assert host.stdout is not None
                finished.append(host.stdout.readline().strip())

            waiter = threading.Thread(target=wait_for_load)
            waiter.start()
            with anyio.fail_after(120):
                while not finished or inspections < 200:
                    view = await judge.inspect(held)
                    inspections += 1
                    probes[view.owner_alive] += 1
                    if inspections % 4 == 0:
                        with pytest.raises(ConflictError) as refused:
                            await judge.begin(held, INPUTS, DEFINITION)
                        probes[refused.value.code] += 1
                    if not finished and refusals < 10:
                        # The pooler is busy with the load: detection still sees it.
                        with pytest.raises(StorageFailed, match="transaction \\(or statement"):
                            await Journal.open(f"{transaction_pooler}?{schema_query()}")
                        refusals += 1
            waiter.join()
            assert finished == ["loaded 600"], finished
            host.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            await anyio.to_thread.run_sync(host.wait)
            with anyio.fail_after(20):
                while (await judge.inspect(held)).owner_alive is not False:  # noqa: ASYNC110 - the server decides
                    await anyio.sleep(0.02)
            seen = time.monotonic() - killed
        finally:
            if host.poll() is None:
                host.kill()
                host.wait()
            host.stdout.close()
            if host.stdin is not None:
                host.stdin.close()
        with pytest.raises(ConflictError) as refused:
            await judge.begin(held, INPUTS, DEFINITION)
        assert refused.value.code == "REVIEW_REQUIRED"
    print(
        f"\n{anyio_backend}: transaction pooling, direct owner session, 600 cycles of load: "
        f"probes {dict(probes)}; {refusals} opens without owner_url during the load, all "
        f"refused; the SIGKILLed owner seen gone after {seen:.3f} s"
    )
    assert refusals >= 5
    assert set(probes) <= {True, "IN_PROGRESS"}, probes
    # Every one of the (at least 200) inspections saw the owner alive, every fourth
    # was followed by a begin refused IN_PROGRESS.
    assert probes[True] == inspections >= 200, (probes, inspections)
    assert probes["IN_PROGRESS"] == inspections // 4, (probes, inspections)


# ---------------------------------------------------------------------- session pooling


@pytest.mark.anyio
async def test_session_pooling_is_detected_and_works(
    server: _pg.Cluster, session_pooler: str
) -> None:
    async with (
        await Journal.open(f"{session_pooler}?{schema_query()}") as journal,
        await Journal.open(f"{server.url}?{schema_query()}") as direct,
    ):
        assert store_of(journal).pooling == "session"
        assert store_of(direct).pooling == "direct"
        claim = await journal.begin(ident("session", "x"), INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        assert (await journal.complete(claim, "r")).status == "succeeded"


def _cut_after(connection: psycopg.Connection[Any], delay: float) -> threading.Thread:
    """Cut the client's own connection (to the pooler) ``delay`` seconds from now."""
    fd = os.dup(connection.pgconn.socket)

    def cut() -> None:
        time.sleep(delay)
        with socket.socket(fileno=fd) as link:
            link.shutdown(socket.SHUT_RDWR)

    thread = threading.Thread(target=cut)
    thread.start()
    return thread


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_commit_lost_behind_session_pooling_is_settled_as_a_fresh_reader_sees_it(
    server: _pg.Cluster, session_pooler: str, anyio_backend: str
) -> None:
    query = schema_query()
    schema = query.split("=", 1)[1]
    answers: Counter[str] = Counter()
    async with (
        await Journal.open(f"{session_pooler}?{query}") as journal,
        await Journal.open(f"{server.url}?{query}") as reader,
    ):
        store = store_of(journal)
        # The commit of a chosen record takes a second on the server (a deferred
        # trigger), and the client's link to the pooler is cut meanwhile: the server
        # session goes on and may commit after the client has been told the link died.
        server.execute(
            f"CREATE TABLE {schema}.slow (digest text PRIMARY KEY); "
            f"CREATE FUNCTION {schema}.slow() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"IF EXISTS (SELECT 1 FROM {schema}.slow WHERE digest = NEW.digest) THEN "
            "PERFORM pg_sleep(1); END IF; RETURN NULL; END $$; "
            f"CREATE CONSTRAINT TRIGGER slow AFTER INSERT OR UPDATE ON {schema}.records "
            f"DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {schema}.slow()"
        )
        real_commit = store._commit
        cutters: list[threading.Thread] = []

        def commit(connection: psycopg.Connection[Any], *args: Any) -> Any:
            cutters.append(_cut_after(connection, 0.3))
            return real_commit(connection, *args)

        for n in range(4):
            identity = ident("lost", f"i{n}")
            key = (await reader.inspect(identity)).key
            server.execute(f"INSERT INTO {schema}.slow VALUES ('{key}')")
            store._commit = commit  # type: ignore[method-assign]
            try:
                answer: Any = await journal.begin(identity, INPUTS, DEFINITION)
            except StorageFailed as error:
                answer = error
            finally:
                store._commit = real_commit  # type: ignore[method-assign]
            for cutter in cutters:
                cutter.join()
            await anyio.sleep(1.5)  # whatever the server session was doing is over now
            seen = await reader.inspect(identity)
            if isinstance(answer, Claim):
                answers["saved"] += 1
                assert seen.status == "started", seen
            else:
                text = str(answer)
                assert "lost during the commit" in text, text
                if "unknown" in text:
                    answers["unknown"] += 1
                else:
                    answers["not saved"] += 1
                    assert seen.status == "absent", (text, seen)
    print(f"\n{anyio_backend}: 4 commits cut behind session pooling: {dict(answers)}")
    assert sum(answers.values()) == 4


# ---------------------------------------------------------------------- what every write gets


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["direct", "session", "transaction"])
@pytest.mark.parametrize(
    ("configured", "expected"),
    [
        ("off", "on"),
        ("local", "on"),
        ("remote_write", "on"),
        ("on", "on"),
        ("remote_apply", "remote_apply"),
    ],
)
async def test_every_write_commits_synchronously_whatever_the_server_says(
    server: _pg.Cluster,
    session_pooler: str,
    transaction_pooler: str,
    path: str,
    configured: str,
    expected: str,
) -> None:
    role = sync_role(configured)
    query = schema_query()
    try:
        base = {"direct": server.url, "session": session_pooler, "transaction": transaction_pooler}
        url = base[path].replace("postgres@", f"{role}@")
        direct = server.url.replace("postgres@", f"{role}@")
        location = with_owner(url, direct, query) if path == "transaction" else (f"{url}?{query}")
        async with await Journal.open(location, lock_timeout=7.5) as journal:
            store = store_of(journal)
            assert store.pooling == path
            seen: list[tuple[str, str]] = []
            real_write = store._write

            def write(connection: psycopg.Connection[Any], *args: Any, **options: Any) -> Any:
                row = connection.execute(
                    "SELECT current_setting('synchronous_commit'), current_setting('lock_timeout')"
                ).fetchone()
                assert row is not None
                seen.append((str(row[0]), str(row[1])))
                return real_write(connection, *args, **options)

            store._write = write  # type: ignore[method-assign]
            for n in range(6):
                claim = await journal.begin(ident("sync", f"{configured}-{n}"), INPUTS, DEFINITION)
                assert isinstance(claim, Claim)
                await journal.complete(claim, "r")
        assert seen == [(expected, "7500ms")] * 12, seen
    finally:
        server.execute(f"DROP SCHEMA IF EXISTS {query.split('=', 1)[1]} CASCADE")
