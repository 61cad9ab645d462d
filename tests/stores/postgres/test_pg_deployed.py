"""The PostgreSQL store as it is deployed: server settings made by people who never heard of
the journal (``synchronous_commit=off``, ``idle_session_timeout``, a short
``statement_timeout``, a read-only role), an owner session lost while connections are
refused, URL parameters and secrets, the command line on a schema that holds no journal,
and ages judged by the server's clock.

The settings are made on clusters of the tests' own (``initdb`` into a temporary
directory, a free port), never on the shared server: those tests skip when PostgreSQL's
server programs are missing, and fail instead under CI (``CI=true``).
"""

from __future__ import annotations

import secrets
import time
import urllib.parse
from collections.abc import Iterator
from datetime import timedelta

import _pg
import anyio
import psycopg
import pytest
from click.testing import CliRunner
from conftest import postgres_url

from itemjournal import Claim, ConflictError, Identity, Journal, StorageFailed, definition_digest
from itemjournal._model.records import Owner
from itemjournal._operator.cli.app import cli
from itemjournal._stores.postgres.store import PostgresStore
from itemjournal._stores.registry import redact

DEFINITION = definition_digest("pg-deployed-v1")
INPUTS = {"n": 1}


@pytest.fixture
def store_kind() -> str:
    """Only the PostgreSQL store here (``location`` follows it)."""
    postgres_url()
    return "postgres"


def ident(*labels: str) -> Identity:
    return Identity("deployed", "test", *labels)


def store_of(journal: Journal) -> PostgresStore:
    store = journal.store
    assert isinstance(store, PostgresStore)
    return store


def schema_url(url: str) -> str:
    return f"{url}?schema=ij_{secrets.token_hex(4)}"


@pytest.fixture(scope="module")
def shared_cluster() -> Iterator[_pg.Cluster]:
    """One cluster for the tests that only change database and role settings (each
    changes them back); a test that stops its server makes a cluster of its own."""
    with _pg.cluster() as made:
        yield made


# ---------------------------------------------------------------------- locations


@pytest.mark.parametrize(
    ("location", "shown"),
    [
        (
            "postgresql://app@db/jobs?sslpassword=k3y-pw&sslmode=require",
            "postgresql://app@db/jobs?sslpassword=***&sslmode=require",
        ),
        (
            "postgresql://app@db/jobs?application_name=my%20app&password=s3cret",
            "postgresql://app@db/jobs?application_name=my%20app&password=***",
        ),
        (
            "postgresql://app@db/jobs?oauth_client_secret=s3cret&scram_client_key=s3cret",
            "postgresql://app@db/jobs?oauth_client_secret=***&scram_client_key=***",
        ),
        (
            "postgresql://app@pooler/jobs?owner_url="
            + urllib.parse.quote("postgresql://app:s3cret@db:5432/jobs?sslpassword=s3cret", safe="")
            + "&schema=x",
            "postgresql://app@pooler/jobs?owner_url="
            + urllib.parse.quote("postgresql://app:***@db:5432/jobs?sslpassword=***", safe=":/@")
            + "&schema=x",
        ),
        (
            "postgresql://app@db/jobs?options=-c%20statement_timeout%3D1000",
            "postgresql://app@db/jobs?options=-c%20statement_timeout%3D1000",
        ),
    ],
)
def test_every_secret_in_a_url_is_redacted_and_nothing_else(location: str, shown: str) -> None:
    assert redact(location) == shown
    assert "s3cret" not in repr(PostgresStore(location))
    assert "k3y-pw" not in PostgresStore(location).location


@pytest.mark.anyio
async def test_url_parameters_reach_libpq_exactly_as_given(location: str) -> None:
    name = f"my app {secrets.token_hex(3)}"
    given = (
        f"{location}&application_name={urllib.parse.quote(name)}"
        "&options=-c%20statement_timeout%3D1000"
    )
    async with await Journal.open(given) as journal:
        store = store_of(journal)
        assert store.location == given  # nothing to hide: shown exactly as given
        claim = await journal.begin(ident("params", "x"), INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        pool = store._pool
        assert pool is not None

        def settings() -> tuple[str, str]:
            with pool.connection() as connection:
                row = connection.execute(
                    "SELECT current_setting('application_name'), "
                    "current_setting('statement_timeout')"
                ).fetchone()
                assert row is not None
                return str(row[0]), str(row[1])

        assert await anyio.to_thread.run_sync(settings) == (name, "1s")


# ---------------------------------------------------------------------- the command line


def test_the_command_line_never_creates_a_postgres_journal(location: str) -> None:
    url, schema = _pg.split(location)
    typo = f"{url}{'&' if '?' in url else '?'}schema={schema}_typo"
    result = CliRunner().invoke(cli, ["-L", typo, "list"], env={"ITEMJOURNAL_LOCATION": None})
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stderr.startswith("error: NO_JOURNAL: "), result.stderr
    assert f"{schema}_typo" in result.stderr
    with psycopg.connect(url) as connection:
        row = connection.execute("SELECT to_regnamespace(%s)", (f"{schema}_typo",)).fetchone()
    assert row == (None,)  # nothing was made
    from itemjournal._stores.postgres.store import missing_journal

    assert "there is no schema" in str(missing_journal(typo))
    connection, _ = _pg.connect(location)
    with connection:  # a schema of someone else's, without the journal's tables
        connection.execute(f"CREATE SCHEMA {schema}_other")
    try:
        other = f"{url}{'&' if '?' in url else '?'}schema={schema}_other"
        assert "holds no journal tables" in str(missing_journal(other))
        result = CliRunner().invoke(
            cli, ["-L", other, "counts"], env={"ITEMJOURNAL_LOCATION": None}
        )
        assert result.exit_code == 2 and "NO_JOURNAL" in result.stderr, result.stderr
    finally:
        connection, _ = _pg.connect(location)
        with connection:
            connection.execute(f"DROP SCHEMA {schema}_other CASCADE")
    assert missing_journal("postgresql://nobody@127.0.0.1:1/none") is None  # open says why

    async def make() -> None:
        async with await Journal.open(location):
            pass

    anyio.run(make)
    assert missing_journal(location) is None
    result = CliRunner().invoke(cli, ["-L", location, "list"], env={"ITEMJOURNAL_LOCATION": None})
    assert result.exit_code == 0, result.stderr
    from itemjournal._operator.viewer.app import _require_journal

    with pytest.raises(ValueError, match="never creates"):
        _require_journal(typo)
    _require_journal(location)


# ---------------------------------------------------------------------- ages, owners


@pytest.mark.anyio
async def test_ages_are_judged_by_the_server_clock(location: str) -> None:
    async with await Journal.open(location) as journal:
        store = store_of(journal)
        old, new, absent = ident("age", "old"), ident("age", "new"), ident("age", "absent")
        for identity in (old, new):
            claim = await journal.begin(identity, INPUTS, DEFINITION)
            assert isinstance(claim, Claim)
            await journal.complete(claim, "r")
        connection, schema = _pg.connect(location)
        with connection:  # as if written three days ago by the server's clock
            connection.execute(
                f"UPDATE {schema}.records SET written_at = now() - interval '3 days' "
                "WHERE digest = %s",
                ((await journal.inspect(old)).key,),
            )
        ages = await store.ages([old, new, absent])
        assert ages[2] is None
        assert ages[0] is not None and timedelta(days=3) <= ages[0] < timedelta(days=3, minutes=1)
        assert ages[1] is not None and timedelta(0) <= ages[1] < timedelta(minutes=1)
        assert await store.ages([]) == []
        # Every write stamps the server's time again.
        later = ident("age", "later")
        claim = await journal.begin(later, INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        connection, schema = _pg.connect(location)
        with connection:
            connection.execute(
                f"UPDATE {schema}.records SET written_at = now() - interval '3 days' "
                "WHERE digest = %s",
                (claim.key,),
            )
        assert (await store.ages([later]))[0] >= timedelta(days=3)  # type: ignore[operator]
        await journal.complete(claim, "r")
        (age,) = await store.ages([later])
        assert age is not None and age < timedelta(minutes=1)
        assert store.gone_reason(None) == "owner process gone"
        assert store.gone_reason(Owner("h", 1, "")) == "owner process gone"
        assert store.gone_reason(store.owner()) == "owner session gone"


@pytest.mark.anyio
async def test_a_version_1_journal_is_migrated_conservatively(location: str) -> None:
    identity = ident("migrate", "x")
    async with await Journal.open(location) as journal:
        claim = await journal.begin(identity, INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
    connection, schema = _pg.connect(location)
    with connection:  # back to what version 1 made
        connection.execute(f"ALTER TABLE {schema}.records DROP COLUMN written_at")
        connection.execute(f"UPDATE {schema}.meta SET value = '1' WHERE key = 'schema_version'")
        connection.execute("SELECT pg_sleep(0.2)")
    async with await Journal.open(location) as journal:
        store = store_of(journal)
        (age,) = await store.ages([identity])
        # The row predates the column: it is as old as the migration, never older.
        assert age is not None and timedelta(0) <= age < timedelta(seconds=5)
        assert await store.check() == []
        assert (await journal.complete(claim, "r")).status == "succeeded"
    connection, schema = _pg.connect(location)
    with connection:
        row = connection.execute(
            f"SELECT value FROM {schema}.meta WHERE key = 'schema_version'"
        ).fetchone()
    assert row == ("2",)
    # A version this code neither reads nor can migrate is refused, and check says so.
    async with await Journal.open(location) as journal:
        connection, schema = _pg.connect(location)
        with connection:
            connection.execute(
                f"UPDATE {schema}.meta SET value = '99' WHERE key = 'schema_version'"
            )
        (problem,) = await journal.store.check()
        assert "schema version '99'" in problem, problem
    with pytest.raises(StorageFailed, match="schema version '99'"):
        await Journal.open(location)


# ---------------------------------------------------------------------- server settings


@pytest.mark.anyio
@pytest.mark.slow
async def test_acknowledged_writes_survive_an_immediate_stop_under_synchronous_commit_off(
    anyio_backend: str,
) -> None:
    with _pg.cluster() as server:
        with (server.data / "postgresql.conf").open("a") as conf:
            conf.write("wal_writer_delay = '10s'\n")
        server.stop()
        server.start()
        server.execute("ALTER DATABASE test SET synchronous_commit = off")
        location = schema_url(server.url)
        acknowledged: dict[Identity, str] = {}
        async with await Journal.open(location) as journal:
            for n in range(20):
                identity = ident("durable", f"i{n}")
                claim = await journal.begin(identity, INPUTS, DEFINITION)
                assert isinstance(claim, Claim)
                acknowledged[identity] = "started"
                if n % 2 == 0:
                    await journal.complete(claim, f"r{n}")
                    acknowledged[identity] = "succeeded"
        await anyio.to_thread.run_sync(server.stop, "immediate")
        await anyio.to_thread.run_sync(server.start)
        lost = 0
        fresh_claims = 0
        async with await Journal.open(location) as journal:
            for identity, status in acknowledged.items():
                view = await journal.inspect(identity)
                lost += view.status != status
                if status == "succeeded":
                    try:
                        again = await journal.begin(identity, INPUTS, DEFINITION)
                    except ConflictError:
                        continue
                    fresh_claims += isinstance(again, Claim)
        print(
            f"\n{anyio_backend}: synchronous_commit=off, wal_writer_delay=10s: 20 acknowledged "
            f"claims (10 completed), immediate stop: {lost} lost, {fresh_claims} fresh claims"
        )
        assert lost == 0
        assert fresh_claims == 0


@pytest.mark.anyio
@pytest.mark.slow
async def test_an_idle_owner_outlives_idle_session_timeout(shared_cluster: _pg.Cluster) -> None:
    shared_cluster.execute("ALTER DATABASE test SET idle_session_timeout = '2s'")
    try:
        location = schema_url(shared_cluster.url)
        async with await Journal.open(location) as owner, await Journal.open(location) as other:
            claim = await owner.begin(ident("idle", "x"), INPUTS, DEFINITION)
            assert isinstance(claim, Claim)
            await anyio.sleep(6)
            view = await other.inspect(claim.identity)
            assert view.owner_alive is True
            with pytest.raises(ConflictError) as refused:
                await other.begin(claim.identity, INPUTS, DEFINITION)
            assert refused.value.code == "IN_PROGRESS"
            assert (await owner.complete(claim, "done")).status == "succeeded"
    finally:
        shared_cluster.execute("ALTER DATABASE test RESET idle_session_timeout")


@pytest.fixture
def role(shared_cluster: _pg.Cluster) -> Iterator[str]:
    """A login role of its own on the test cluster, that may make schemas there."""
    name = f"ij_role_{secrets.token_hex(4)}"
    shared_cluster.execute(f"CREATE ROLE {name} LOGIN")
    shared_cluster.execute(f"GRANT CREATE, CONNECT ON DATABASE test TO {name}")
    try:
        yield name
    finally:
        with psycopg.connect(shared_cluster.admin_url(), autocommit=True) as connection:
            connection.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (name,),
            )
            connection.execute(f"DROP OWNED BY {name} CASCADE")
            connection.execute(f"DROP ROLE {name}")


def role_url(cluster: _pg.Cluster, role: str) -> str:
    return schema_url(f"postgresql://{role}@127.0.0.1:{cluster.port}/test")


@pytest.mark.anyio
@pytest.mark.parametrize(
    "setting",
    ["statement_timeout = 1", "statement_timeout = 500", "default_transaction_read_only = on"],
)
async def test_open_under_a_setting_it_cannot_work_with_fails_fast(
    shared_cluster: _pg.Cluster, role: str, setting: str
) -> None:
    shared_cluster.execute(f"ALTER ROLE {role} SET {setting}")
    started = time.monotonic()
    with pytest.raises(StorageFailed) as refused:
        with anyio.fail_after(40):
            await Journal.open(role_url(shared_cluster, role))
    waited = time.monotonic() - started
    text = str(refused.value)
    assert waited < 2, (waited, text)
    name = setting.split(" = ", maxsplit=1)[0]
    assert ("statement_timeout" if name == "statement_timeout" else "read-only") in text, text
    assert "pool initialization" not in text
    print(f"\nopen under {setting} on the role: STORAGE_FAILED after {waited:.2f} s: {text}")


@pytest.mark.anyio
async def test_a_lost_owner_session_is_never_replaced_by_none(
    shared_cluster: _pg.Cluster, role: str
) -> None:
    location = role_url(shared_cluster, role)
    async with await Journal.open(location) as mine, await Journal.open(location) as other:
        store = store_of(mine)
        first = await mine.begin(ident("renew", "a"), INPUTS, DEFINITION)
        assert isinstance(first, Claim)
        session = store._session
        assert session is not None
        # New connections of the role are refused for a moment; its owner session ends.
        shared_cluster.execute(f"ALTER ROLE {role} CONNECTION LIMIT 0")
        with psycopg.connect(shared_cluster.admin_url(), autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s, 5000)", (session.pid,))
        answers: list[str] = []
        for n in range(3):  # while refused: every claim is refused, none is written
            identity = ident("renew", f"refused{n}")
            try:
                answer = await mine.begin(identity, INPUTS, DEFINITION)
            except StorageFailed as error:
                refusal = str(error)
                assert "nothing was written" in str(error) or "no claim" in str(error), error
                answers.append("refused")
                assert (await other.inspect(identity)).status == "absent"
                continue
            assert isinstance(answer, Claim)
            view = await other.inspect(identity)
            answers.append(f"session={view.owner.session if view.owner else None!r}")
        shared_cluster.execute(f"ALTER ROLE {role} CONNECTION LIMIT -1")
        assert answers == ["refused"] * 3, answers
        assert "owner session" in refusal and "cannot be renewed" in refusal, refusal
        second = await mine.begin(ident("renew", "b"), INPUTS, DEFINITION)
        assert isinstance(second, Claim)
        view = await other.inspect(second.identity)
        assert view.owner is not None and view.owner.session.startswith("pg:")
        assert view.owner.session != session.name
        assert view.owner_alive is True
        assert (await mine.complete(second, "done")).status == "succeeded"


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_standby_is_refused_at_open(shared_cluster: _pg.Cluster) -> None:
    with shared_cluster.standby() as standby:
        started = time.monotonic()
        with pytest.raises(StorageFailed) as refused:
            await Journal.open(schema_url(standby.url))
        assert time.monotonic() - started < 2
    assert "standby" in str(refused.value) and "primary" in str(refused.value)
