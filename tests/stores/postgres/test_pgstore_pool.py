"""The PostgreSQL store's pool: idle connections the server dropped are replaced, never
reported as failures of the call that happened to draw them."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import anyio
import psycopg
import pytest
from conftest import postgres_schema

from itemjournal import Claim, Journal, definition_digest

pytestmark = pytest.mark.anyio

DEFINITION = definition_digest("pool-v1")
INPUTS = {"n": 1}


@pytest.fixture
def named_location() -> Iterator[tuple[str, str]]:
    """A location whose connections carry an application name of their own."""
    name = f"ijpool-{secrets.token_hex(4)}"
    with postgres_schema() as url:
        yield f"{url}&application_name={name}&pool_size=2", name


def end_idle_pool_connections(location: str, name: str, keep: int) -> int:
    """End every session of the journal except ``keep`` (its owner lock); how many ended."""
    url = location.split("?", 1)[0]
    with psycopg.connect(url, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
            "WHERE application_name = %s AND pid <> %s",
            (name, keep),
        ).fetchall()
    return len(rows)


@pytest.mark.parametrize(
    "call", ["inspect", "records", "counts", "begin", "reopen", "verify", "liveness"]
)
async def test_a_dropped_idle_connection_is_replaced(
    named_location: tuple[str, str], call: str
) -> None:
    location, name = named_location
    async with await Journal.open(location) as journal:
        first = await journal.begin(("pool", "idle", "dropped", "a"), INPUTS, DEFINITION)
        assert isinstance(first, Claim)
        await journal.complete(first, "r-a")
        session = journal.store._session  # type: ignore[attr-defined]
        ended = await anyio.to_thread.run_sync(
            end_idle_pool_connections, location, name, session.pid
        )
        assert ended >= 1
        if call == "inspect":
            assert (await journal.inspect(first.identity)).receipt == "r-a"
        elif call == "records":
            assert [view.receipt async for view in journal.records()] == ["r-a"]
        elif call == "counts":
            assert (await journal.counts())["succeeded"] == 1
        elif call == "begin":
            second = await journal.begin(("pool", "idle", "dropped", "b"), INPUTS, DEFINITION)
            assert isinstance(second, Claim)
        elif call == "verify":
            assert await journal.verify() == ()
        elif call == "liveness":  # asked outside any step: a connection of its own
            claim = await journal.begin(("pool", "idle", "dropped", "c"), INPUTS, DEFINITION)
            assert isinstance(claim, Claim)
            await anyio.to_thread.run_sync(end_idle_pool_connections, location, name, session.pid)
            assert (await journal.inspect(claim.identity)).owner_alive is True
            views = [view async for view in journal.records("started")]
            assert [view.owner_alive for view in views] == [True]
        else:  # the setting read when a journal opens goes through the same pool
            await journal.store.setting("input_kind", journal.input_kind)
