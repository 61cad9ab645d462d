"""The operator's library calls: ``records`` (filtered, keyset-paginated, never stopped by a
bad record), ``counts``, ``prune`` and ``verify``, on every store."""

from __future__ import annotations

import contextlib
import sqlite3
from datetime import timedelta
from pathlib import Path
from typing import Any

import _pg
import anyio
import pytest

from itemjournal import (
    Claim,
    Identity,
    InvalidArgument,
    Journal,
    PruneReport,
    RecordInvalid,
    RecordView,
    StorageFailed,
    definition_digest,
)
from itemjournal._model.identity import identity_digest

pytestmark = pytest.mark.anyio
# The contract holds on both faces of the journal (tests/_faces.py).
FACES = ("async", "sync")

DEFINITION = definition_digest("listing-v1")
INPUTS = {"n": 1}


async def fill(journal: Journal) -> dict[str, set[Identity]]:
    """Two jobs, every status: 6 succeeded, 4 started, 3 needs_review, 2 released."""
    by_status: dict[str, set[Identity]] = {s: set() for s in ("started", "succeeded")}
    by_status.update(needs_review=set(), released=set())
    for n in range(15):
        identity = Identity("shop", "billing", "charge" if n % 2 else "refund", f"i{n:02}")
        claim = await journal.begin(identity, INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        if n < 6:
            await journal.complete(claim, f"r{n}")
            by_status["succeeded"].add(identity)
        elif n < 10:
            by_status["started"].add(identity)
        else:
            await journal.mark_review(identity, "timeout")
            if n < 12:
                await journal.resolve(identity, retry=True, note="no charge upstream")
                by_status["released"].add(identity)
            else:
                by_status["needs_review"].add(identity)
    return by_status


async def listed(journal: Journal, *args: Any, **kwargs: Any) -> list[Any]:
    found: list[Any] = []
    async with contextlib.aclosing(journal.records(*args, **kwargs)) as items:
        async for item in items:
            found.append(item)
    return found


async def test_records_lists_every_record_once_in_key_order(journal: Journal) -> None:
    by_status = await fill(journal)
    views = await listed(journal)
    assert all(isinstance(view, RecordView) for view in views)
    assert [view.key for view in views] == sorted(view.key for view in views)
    assert {view.identity for view in views} == set().union(*by_status.values())
    for view in views:
        assert view.key == identity_digest(view.identity)
        if view.status == "started":
            assert view.owner_alive is True  # liveness is filled in, as by inspect


async def test_records_filters_by_status_and_labels(journal: Journal) -> None:
    by_status = await fill(journal)
    for status, expected in by_status.items():
        assert {view.identity for view in await listed(journal, status)} == expected
    charges = await listed(journal, job="charge")
    assert charges and all(view.identity.job == "charge" for view in charges)
    assert len(charges) == 7
    none = await listed(journal, "succeeded", scope="shop", program="other")
    assert none == []


async def test_keyset_pages_cover_everything_once(journal: Journal) -> None:
    await fill(journal)
    everything = [view.key for view in await listed(journal)]
    seen: list[str] = []
    after = None
    while True:
        page: list[str] = []
        async with contextlib.aclosing(journal.records(after=after)) as items:
            async for item in items:
                page.append(item.key)
                if len(page) == 4:
                    break
        seen += page
        if len(page) < 4:
            break
        after = page[-1]
    assert seen == everything


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"status": "absent"}, "INVALID_ARGUMENT"),
        ({"status": "done"}, "INVALID_ARGUMENT"),
        ({"scope": "bad label"}, "INVALID_LABEL"),
        ({"after": "xyz"}, "INVALID_ARGUMENT"),
    ],
)
async def test_bad_listing_arguments_are_refused(
    journal: Journal, kwargs: dict[str, Any], code: str
) -> None:
    with pytest.raises(InvalidArgument) as raised:
        await listed(journal, **kwargs)
    assert raised.value.code == code


async def test_counts(journal: Journal) -> None:
    await fill(journal)
    assert await journal.counts() == {
        "started": 4,
        "succeeded": 6,
        "needs_review": 3,
        "released": 2,
        "invalid": 0,
    }


def spoil(location: str, journal: Journal, identity: Identity) -> None:
    digest = identity_digest(identity)
    if _pg.is_postgres(location):
        _pg.put_document(location, digest, b"{broken")
        return
    if location.startswith("sqlite://"):
        with contextlib.closing(sqlite3.connect(location[len("sqlite://") :])) as connection:
            connection.execute(
                "UPDATE itemjournal_records SET document = ? WHERE digest = ?",
                (b"{broken", digest),
            )
            connection.commit()
    else:
        path = journal.store.path_for(identity)  # type: ignore[attr-defined]
        Path(path).write_bytes(b"{broken")


async def test_a_bad_record_is_reported_and_the_listing_goes_on(
    location: str, journal: Journal
) -> None:
    by_status = await fill(journal)
    bad = sorted(by_status["succeeded"])[0]
    await anyio.to_thread.run_sync(spoil, location, journal, bad)
    items = await listed(journal, problems=True)
    problems = [item for item in items if isinstance(item, (RecordInvalid, StorageFailed))]
    assert len(problems) == 1
    assert len(items) == 15
    assert (await journal.counts())["invalid"] == 1
    # A status listing includes it too (its status cannot be trusted)...
    assert any(
        isinstance(item, RecordInvalid) for item in await listed(journal, "started", problems=True)
    )
    # ...and a page that starts after it does not repeat it.
    assert not any(
        isinstance(item, RecordInvalid)
        for item in await listed(journal, after=identity_digest(bad), problems=True)
    )
    lines = await journal.verify()
    assert len(lines) == 1
    assert lines[0].startswith("RECORD_INVALID")


async def test_verify_is_quiet_on_a_healthy_journal(journal: Journal) -> None:
    await fill(journal)
    assert await journal.verify() == ()


async def test_verify_names_an_orphan_temp_file(
    root: Path, make_journal: Any, file_only: None
) -> None:
    journal = await make_journal()
    await fill(journal)
    fanout = next(path for path in root.iterdir() if path.is_dir())
    # Named by a writer that cannot exist (pid 2**22+1 is above the kernel's pid limit).
    orphan = fanout / f".{2**22 + 1}--{'0' * 32}.tmp"
    await anyio.to_thread.run_sync(orphan.write_bytes, b"half a record")
    stray = fanout / "notes.txt"
    await anyio.to_thread.run_sync(stray.write_bytes, b"left by hand")
    lines = await journal.verify()
    assert any("orphan temp file" in line and str(orphan) in line for line in lines), lines
    assert any("unexpected entry" in line and str(stray) in line for line in lines), lines


async def test_verify_names_records_of_another_input_kind(journal: Journal) -> None:
    claim = await journal.begin(Identity("s", "p", "j", "plain"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    keyed = Journal(journal.store, input_key=b"k" * 32)  # over the store, skipping open's check
    await keyed.begin(Identity("s", "p", "j", "keyed"), INPUTS, DEFINITION)
    lines = await journal.verify()
    assert len(lines) == 1
    assert lines[0].startswith("INPUT_KEY_MISMATCH") and "keyed" in lines[0]


async def test_prune_removes_only_old_resolved_records(journal: Journal) -> None:
    by_status = await fill(journal)
    assert (await journal.prune(timedelta(days=1))).removed == ()  # nothing is old yet
    await anyio.sleep(0.05)
    dry = await journal.prune(timedelta(milliseconds=10), dry_run=True)
    assert isinstance(dry, PruneReport)
    prunable = by_status["succeeded"] | by_status["released"]
    assert {view.identity for view in dry.removed} == prunable
    assert len(await listed(journal)) == 15  # the dry run changed nothing
    done = await journal.prune(timedelta(milliseconds=10))
    assert {view.identity for view in done.removed} == prunable
    assert done.problems == ()
    left = await listed(journal)
    assert {view.identity for view in left} == by_status["started"] | by_status["needs_review"]
    for identity in prunable:
        assert (await journal.inspect(identity)).status == "absent"
    assert await journal.verify() == ()


@pytest.mark.async_only  # its faults are injected through the async journal or store
async def test_prune_keeps_a_record_that_changed_since_the_scan(
    journal: Journal, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Released and old when the scan saw it, claimed again before its removal: kept."""
    identity = Identity("s", "p", "j", "claimed-again")
    claim = await journal.begin(identity, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    await journal.mark_review(identity, "timeout")
    await journal.resolve(identity, retry=True, note="no charge upstream")
    await anyio.sleep(0.05)
    store = journal.store
    other = Journal(store)
    original = store.apply
    claims: list[Any] = []
    entered: list[bool] = []

    async def claim_first(ident: Identity, step: Any) -> Any:
        if not entered:  # only the prune's own call; the claim below goes straight through
            entered.append(True)
            claims.append(await other.begin(identity, INPUTS, DEFINITION))
        return await original(ident, step)

    monkeypatch.setattr(store, "apply", claim_first)
    report = await journal.prune(timedelta(milliseconds=10))
    assert isinstance(claims[0], Claim)
    assert report.removed == ()
    view = await journal.inspect(identity)
    assert (view.status, view.attempt) == ("started", 2)


@pytest.mark.parametrize("bad", [timedelta(0), timedelta(seconds=-1), 30, "30d", None])
async def test_prune_refuses_a_bad_age(journal: Journal, bad: Any) -> None:
    with pytest.raises(InvalidArgument):
        await journal.prune(bad)


async def test_records_yields_only_views_unless_problems_are_asked_for(
    location: str, journal: Journal
) -> None:
    by_status = await fill(journal)
    bad = sorted(by_status["succeeded"])[0]
    await anyio.to_thread.run_sync(spoil, location, journal, bad)
    views = await listed(journal)
    assert len(views) == 14
    assert all(isinstance(view, RecordView) for view in views)
    assert all(isinstance(view, RecordView) for view in await listed(journal, "started"))
    assert await listed(journal, problems=False) == views
    items = await listed(journal, problems=True)
    assert [item for item in items if isinstance(item, RecordView)] == views
    assert [type(item) for item in items if not isinstance(item, RecordView)] == [RecordInvalid]


@pytest.mark.parametrize("bad", [None, 1, "yes"])
async def test_records_refuses_problems_that_is_not_a_bool(journal: Journal, bad: Any) -> None:
    with pytest.raises(InvalidArgument) as raised:
        await listed(journal, problems=bad)
    assert raised.value.code == "INVALID_ARGUMENT"
