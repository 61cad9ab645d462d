"""A commit whose answer was lost while it waited for a synchronous standby is never
acknowledged unless the standby has it: a failover to that standby then loses nothing
that was acknowledged, and grants no fresh claim for work whose claim was acknowledged.

A primary and a streaming synchronous standby of the test's own; the journal's data
connections go through a TCP proxy of the test's own (the owner session connects
directly). The standby is stopped, so every commit waits; the proxy drops the client
connections during those commits; the primary is stopped with ``-m immediate`` and the
standby started and promoted.
"""

from __future__ import annotations

import secrets
import urllib.parse

import _pg
import anyio
import pytest

from itemjournal import Claim, ConflictError, Identity, Journal, JournalError, definition_digest

pytestmark = pytest.mark.slow

DEFINITION = definition_digest("pg-sync-standby-v1")


def ident(name: str) -> Identity:
    return Identity("syncstandby", "test", "x", name)


@pytest.mark.anyio
async def test_a_lost_commit_waiting_for_a_synchronous_standby_is_never_acknowledged() -> None:
    with _pg.cluster() as primary, primary.standby() as standby:
        primary.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        primary.execute("SELECT pg_reload_conf()")
        _pg.wait_for(
            "EXISTS (SELECT 1 FROM pg_stat_replication WHERE sync_state = 'sync')",
            primary.admin_url(),
        )
        schema = f"ij_{secrets.token_hex(4)}"
        direct = urllib.parse.quote(primary.url, safe="")
        with _pg.proxy(primary.port) as cut:
            location = (
                f"postgresql://postgres@127.0.0.1:{cut.port}/test?schema={schema}"
                f"&owner_url={direct}&pool_size=4"
            )
            acknowledged: dict[Identity, str] = {}
            outcomes: dict[str, str] = {}
            async with await Journal.open(location, lock_timeout=10) as journal:
                claims = {}
                for name in ("a", "b"):
                    claim = await journal.begin(ident(name), {}, DEFINITION)
                    assert isinstance(claim, Claim)
                    claims[name] = claim
                    acknowledged[ident(name)] = "started"
                await anyio.to_thread.run_sync(standby.stop)  # every commit waits now

                async def complete(name: str) -> None:
                    try:
                        await journal.complete(claims[name], "done")
                    except JournalError as error:
                        outcomes[f"complete {name}"] = f"{error.code}: {error}"
                    else:
                        outcomes[f"complete {name}"] = "acknowledged"
                        acknowledged[ident(name)] = "succeeded"

                async def begin(name: str) -> None:
                    try:
                        claim = await journal.begin(ident(name), {}, DEFINITION)
                    except JournalError as error:
                        outcomes[f"begin {name}"] = f"{error.code}: {error}"
                    else:
                        assert isinstance(claim, Claim)
                        outcomes[f"begin {name}"] = "acknowledged"
                        acknowledged[ident(name)] = "started"

                async with anyio.create_task_group() as group:
                    group.start_soon(complete, "a")
                    group.start_soon(complete, "b")
                    group.start_soon(begin, "c")
                    await anyio.sleep(1.5)  # each commit waits for the standby
                    cut.drop()
            print("\nwhile the standby was away:", *sorted(outcomes.items()), sep="\n  ")
        await anyio.to_thread.run_sync(primary.stop, "immediate")
        await anyio.to_thread.run_sync(standby.start)
        standby._run("pg_ctl", "-D", str(standby.data), "-w", "promote")
        _pg.wait_for("NOT pg_is_in_recovery()", standby.admin_url())
        lost: list[str] = []
        fresh: list[str] = []
        async with await Journal.open(f"{standby.url}?schema={schema}") as after:
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
        print(f"after the failover: lost {lost}, fresh claims {fresh}")
        assert lost == []
        assert fresh == []
        for name, outcome in outcomes.items():
            if outcome != "acknowledged":  # the answer says the outcome is unknown
                assert outcome.startswith("STORAGE_FAILED"), (name, outcome)
                assert "unknown" in outcome, (name, outcome)


@pytest.mark.anyio
async def test_a_commit_whose_standby_wait_was_cut_short_elsewhere_is_not_acknowledged() -> None:
    """Someone else ends the session while its commit waits for the standby (it is then
    committed on the primary alone): our bytes are there, but not proven on the standby."""
    with _pg.cluster() as primary, primary.standby() as standby:
        primary.execute("ALTER SYSTEM SET synchronous_standby_names = 'FIRST 1 (*)'")
        primary.execute("SELECT pg_reload_conf()")
        _pg.wait_for(
            "EXISTS (SELECT 1 FROM pg_stat_replication WHERE sync_state = 'sync')",
            primary.admin_url(),
        )
        location = f"{primary.url}?schema=ij_{secrets.token_hex(4)}&pool_size=2"
        async with await Journal.open(location, lock_timeout=10) as journal:
            claim = await journal.begin(ident("cut"), {}, DEFINITION)
            assert isinstance(claim, Claim)
            await anyio.to_thread.run_sync(standby.stop)

            def end_the_waiting_session() -> None:
                _pg.wait_for(
                    "EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event = 'SyncRep')",
                    primary.admin_url(),
                )
                primary.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE wait_event = 'SyncRep'"
                )

            async with anyio.create_task_group() as group:
                group.start_soon(anyio.to_thread.run_sync, end_the_waiting_session)
                with pytest.raises(JournalError) as refused:
                    await journal.complete(claim, "done")
            assert refused.value.code == "STORAGE_FAILED"
            assert "unknown" in str(refused.value), refused.value
            assert "synchronous standby" in str(refused.value), refused.value
            # On the primary alone, the commit did land.
            assert (await journal.inspect(claim.identity)).status == "succeeded"
