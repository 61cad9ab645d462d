"""The PostgreSQL store's pool: idle connections the server dropped are replaced, never
reported as failures of the call that happened to draw them; calls beyond the pool wait
their turn on the event loop."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator

import anyio
import anyio.lowlevel
import psycopg
import pytest
from conftest import postgres_schema

from itemjournal import Claim, Identity, Journal, definition_digest
from itemjournal._model.records import Record
from itemjournal._stores import workers
from itemjournal._stores.postgres.store import PostgresStore
from itemjournal._stores.seam import Step

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


async def test_calls_beyond_the_pool_wait_their_turn_on_the_event_loop(
    named_location: tuple[str, str],
) -> None:
    """Two pooled connections: two calls at a time in worker threads, the others waiting
    on the event loop (not in threads, for a connection)."""
    location, _ = named_location
    release = threading.Event()
    lock = threading.Lock()
    inside = [0, 0]  # now, most

    def step(current: Record | None) -> Step[None]:
        with lock:
            inside[0] += 1
            inside[1] = max(inside)
        try:
            assert release.wait(10), "the test never released the steps"
        finally:
            with lock:
                inside[0] -= 1
        return Step(None, None)

    async with await Journal.open(location) as journal:
        store = journal.store
        assert isinstance(store, PostgresStore)
        before, workers._POOL = workers._POOL, workers._Pool()  # threads of its own, counted
        try:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    for n in range(5):
                        tg.start_soon(store.apply, Identity("pool", "turns", "job", f"i{n}"), step)
                    while inside[0] < 2:  # noqa: ASYNC110 - worker threads set no event
                        await anyio.sleep(0.001)
                    for _ in range(50):
                        await anyio.lowlevel.checkpoint()
                    assert store._trips._in_flight == 5
                    assert workers._POOL.threads == 2 and not workers._POOL.queue
                    release.set()
        finally:
            release.set()
            workers._POOL = before
    assert inside == [0, 2]
