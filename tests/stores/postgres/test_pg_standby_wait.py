"""A commit is acknowledged only with the durability its first try needed, whatever cut its
wait for a synchronous standby short, and a retried write needs the same proof.

A primary and a streaming synchronous standby of the test's own (``_pg.synchronous_pair``),
the standby stopped so that every commit waits for it. The waits are cut short the ways a
deployment cuts them: a ``statement_timeout`` set for the role, a cancel from someone else
(an operator's ``pg_cancel_backend``, a pooler's query timeout), a connection lost during
``COMMIT`` (a TCP proxy of the test's own), a caller cancelled while its commit waits.
Whatever was acknowledged must still be there after the primary is stopped with
``-m immediate`` and the standby promoted; anything else is ``STORAGE_FAILED`` saying the
outcome is unknown.
"""

from __future__ import annotations

import secrets
import time
import urllib.parse
from collections.abc import Awaitable

import _pg
import anyio
import psycopg
import pytest

from itemjournal import Claim, ConflictError, Identity, Journal, JournalError, definition_digest
from itemjournal._stores.postgres.store import PostgresStore

pytestmark = pytest.mark.slow

DEFINITION = definition_digest("pg-standby-wait-v1")
ROLE_TIMEOUT = "ALTER ROLE postgres SET statement_timeout = '1s'"  # the least open allows
CUT = "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"


def ident(name: str) -> Identity:
    return Identity("standbywait", "test", "x", name)


def schema() -> str:
    return f"ij_{secrets.token_hex(4)}"


def setting_on(server: _pg.Cluster, where: str, key: str) -> str | None:
    with psycopg.connect(server.admin_url(), autocommit=True) as connection:
        row = connection.execute(
            f"SELECT value FROM {where}.meta WHERE key = %s", (f"setting.{key}",)
        ).fetchone()
    return None if row is None else str(row[0])


def sync_rep_waits(server: _pg.Cluster) -> int:
    with psycopg.connect(server.admin_url(), autocommit=True) as connection:
        row = connection.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
        ).fetchone()
    assert row is not None
    return int(row[0])


def unknown(outcome: str) -> bool:
    return outcome.startswith("STORAGE_FAILED") and "unknown" in outcome


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_a_setting_whose_commit_was_lost_needs_the_standby_to_be_acknowledged() -> None:
    """The setting's commit waits for the standby; its answer is lost (the proxy drops the
    connection) and the store tries again; someone else then cancels the lost session's
    wait, so the value is on the primary alone when the second try reads it."""
    with _pg.synchronous_pair() as (primary, standby):
        where = schema()
        direct = urllib.parse.quote(primary.url, safe="")
        with _pg.proxy(primary.port) as cut:
            location = (
                f"postgresql://postgres@127.0.0.1:{cut.port}/test?schema={where}"
                f"&owner_url={direct}&pool_size=2"
            )
            store = PostgresStore(location, lock_timeout=10)
            await store.open()
            try:
                await anyio.to_thread.run_sync(standby.stop)  # every commit waits now

                def lose_the_answer_then_cut_the_wait() -> None:
                    _pg.wait_for_sync_rep(primary)
                    cut.drop()
                    time.sleep(1)  # the store tries again, behind the lost commit's row
                    primary.execute(CUT)

                async with anyio.create_task_group() as group:
                    group.start_soon(anyio.to_thread.run_sync, lose_the_answer_then_cut_the_wait)
                    try:
                        outcome = await store.setting("mode", "first")
                    except JournalError as error:
                        outcome = f"{error.code}: {error}"
            finally:
                await store.aclose()
        print(f"\nthe setting while the standby was away: {outcome}")
        assert setting_on(primary, where, "mode") == "first"  # on the primary alone
        await anyio.to_thread.run_sync(primary.stop, "immediate")
        await anyio.to_thread.run_sync(_pg.promote, standby)
        after = setting_on(standby, where, "mode")
        print(f"after the failover: {after!r}")
        if outcome == "first":
            assert after == "first", "an acknowledged setting was lost in the failover"
        else:
            assert unknown(outcome), outcome


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_a_commit_whose_standby_wait_was_cancelled_is_not_acknowledged() -> None:
    """Someone else cancels the statement while its commit waits for the standby: COMMIT
    succeeds with only a warning, and the commit is on the primary alone."""
    with _pg.synchronous_pair("FIRST 1 (*)") as (primary, standby):
        location = f"{primary.url}?schema={schema()}&pool_size=2"
        async with await Journal.open(location, lock_timeout=10) as journal:
            claim = await journal.begin(ident("cancelled"), {}, DEFINITION)
            assert isinstance(claim, Claim)
            await anyio.to_thread.run_sync(standby.stop)

            def cancel_the_wait() -> None:
                _pg.wait_for_sync_rep(primary)
                primary.execute(CUT)

            async with anyio.create_task_group() as group:
                group.start_soon(anyio.to_thread.run_sync, cancel_the_wait)
                with pytest.raises(JournalError) as refused:
                    await journal.complete(claim, "done")
            print(f"\n{refused.value}")
            assert refused.value.code == "STORAGE_FAILED"
            assert "unknown" in str(refused.value), refused.value
            assert "synchronous standby" in str(refused.value), refused.value
            assert "nothing was written" not in str(refused.value), refused.value
            # On the primary alone, the commit did land.
            assert (await journal.inspect(claim.identity)).status == "succeeded"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_a_statement_timeout_of_the_role_never_makes_a_commit_acknowledged_early() -> None:
    """With the role's statement_timeout at 1 s, commits that wait for a stopped standby
    are never acknowledged: not a record's, not a setting's (the server disarms the
    timeout before it commits). The primary then dies and the standby is promoted:
    nothing acknowledged is lost, no fresh claim is granted, and what was not
    acknowledged is said to be unknown."""
    with _pg.synchronous_pair() as (primary, standby):
        primary.execute(ROLE_TIMEOUT)
        where = schema()
        location = f"{primary.url}?schema={where}&pool_size=4"
        acknowledged: dict[Identity, str] = {}
        outcomes: dict[str, str] = {}
        early: dict[str, str] = {}
        async with await Journal.open(location, lock_timeout=10) as journal:
            store = journal.store
            assert isinstance(store, PostgresStore)
            claim = await journal.begin(ident("a"), {}, DEFINITION)
            assert isinstance(claim, Claim)
            acknowledged[ident("a")] = "started"
            await anyio.to_thread.run_sync(standby.stop)  # every commit waits now

            async def answer(name: str, status: str | None, call: Awaitable[object]) -> None:
                try:
                    outcome = await call
                except JournalError as error:
                    outcomes[name] = f"{error.code}: {error}"
                    return
                outcomes[name] = f"acknowledged {outcome!r}"
                if status is not None:
                    acknowledged[ident(name.rsplit(maxsplit=1)[-1])] = status

            async with anyio.create_task_group() as group:
                group.start_soon(answer, "complete a", "succeeded", journal.complete(claim, "ok"))
                group.start_soon(
                    answer, "begin c", "started", journal.begin(ident("c"), {}, DEFINITION)
                )
                group.start_soon(answer, "setting mode", None, store.setting("mode", "first"))
                await anyio.sleep(4)  # the role's statement_timeout, four times over
                early = dict(outcomes)
                await anyio.to_thread.run_sync(primary.stop, "immediate")
        print("\nwhile the standby was away:", *sorted(outcomes.items()), sep="\n  ")
        await anyio.to_thread.run_sync(_pg.promote, standby)
        lost: list[str] = []
        fresh: list[str] = []
        async with await Journal.open(f"{standby.url}?schema={where}") as after:
            for identity, status in acknowledged.items():
                view = await after.inspect(identity)
                if view.status != status:
                    lost.append(f"{identity[-1]}: acknowledged {status}, now {view.status}")
                try:
                    again = await after.begin(identity, {}, DEFINITION)
                except ConflictError:
                    continue
                if isinstance(again, Claim):
                    fresh.append(identity[-1])
        setting = setting_on(standby, where, "mode")
        print(f"after the failover: lost {lost}, fresh claims {fresh}, setting {setting!r}")
        assert early == {}, f"acknowledged while the standby was away: {early}"
        assert lost == []
        assert fresh == []
        if outcomes["setting mode"].startswith("acknowledged"):
            assert setting == "first"
        for name, outcome in outcomes.items():
            if not outcome.startswith("acknowledged"):
                assert unknown(outcome), (name, outcome)


@pytest.mark.anyio
async def test_a_cancelled_call_never_cuts_its_commit_s_wait_for_the_standby() -> None:
    """A caller cancelled while its commit waits for the standby (the role's
    statement_timeout at 1 s as well): the commit keeps waiting until the standby has it,
    and only then does the cancelled call end; the promoted standby then holds the write."""
    with _pg.synchronous_pair() as (primary, standby):
        primary.execute(ROLE_TIMEOUT)
        where = schema()
        location = f"{primary.url}?schema={where}&pool_size=2"
        async with await Journal.open(location, lock_timeout=10) as journal:
            claim = await journal.begin(ident("cancelled"), {}, DEFINITION)
            assert isinstance(claim, Claim)
            await anyio.to_thread.run_sync(standby.stop)
            scope = anyio.CancelScope()
            ended = anyio.Event()

            async def complete() -> None:
                with scope:
                    await journal.complete(claim, "done")
                ended.set()

            async with anyio.create_task_group() as group:
                group.start_soon(complete)
                await anyio.to_thread.run_sync(_pg.wait_for_sync_rep, primary)
                scope.cancel()
                await anyio.sleep(4)  # the role's statement_timeout, four times over
                waiting = await anyio.to_thread.run_sync(sync_rep_waits, primary)
                assert not ended.is_set(), "the cancelled call ended while the standby was away"
                assert waiting == 1, "the commit stopped waiting for the standby"
                await anyio.to_thread.run_sync(standby.start)
                with anyio.fail_after(60):
                    await ended.wait()
            assert scope.cancelled_caught
        await anyio.to_thread.run_sync(primary.stop, "immediate")
        await anyio.to_thread.run_sync(lambda: _pg.promote(standby, start=False))
        async with await Journal.open(f"{standby.url}?schema={where}") as after:
            assert (await after.inspect(claim.identity)).status == "succeeded"
