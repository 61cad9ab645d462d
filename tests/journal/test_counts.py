"""Counting records on every store: ``Journal.counts`` (every record read strictly), the
stores' ``tally`` (what each can count without reading every record), ``scan(after=)``,
and what the viewer's first page shows of the counts."""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import _pg
import anyio
import httpx
import pytest

from itemjournal import (
    Claim,
    Identity,
    Journal,
    StorageFailed,
    definition_digest,
)
from itemjournal._model.codec import encode_record
from itemjournal._model.identity import identity_digest
from itemjournal._model.records import Record
from itemjournal._operator.viewer import pages as viewer_module
from itemjournal._operator.viewer.app import create_app
from itemjournal._stores.files.store import FileStore
from itemjournal._stores.memory import MemoryStore

pytestmark = pytest.mark.anyio
# The contract holds on both faces of the journal (tests/_faces.py).
FACES = ("async", "sync")

DEFINITION = definition_digest("counts-v1")


async def fill(journal: Journal, count: int = 20) -> dict[str, list[Identity]]:
    """``count`` records, every status among them; the identities by status."""
    by_status: dict[str, list[Identity]] = {
        "started": [],
        "succeeded": [],
        "needs_review": [],
        "released": [],
    }
    for n in range(count):
        identity = Identity("shop", "billing", "charge", f"i{n:03}")
        claim = await journal.begin(identity, {"n": n}, DEFINITION)
        assert isinstance(claim, Claim)
        kind = n % 4
        if kind == 0:
            await journal.complete(claim, f"r{n}")
            by_status["succeeded"].append(identity)
        elif kind == 1:
            by_status["started"].append(identity)
        else:
            await journal.mark_review(identity, "timeout")
            if kind == 2:
                await journal.resolve(identity, retry=True, note="nothing happened upstream")
                by_status["released"].append(identity)
            else:
                by_status["needs_review"].append(identity)
    return by_status


def expected(by_status: dict[str, list[Identity]]) -> dict[str, int]:
    counted = {status: len(identities) for status, identities in by_status.items()}
    counted["invalid"] = 0
    return counted


async def document(journal: Journal, identity: Identity) -> bytes:
    record = await journal.store.peek(identity, lambda found: found)
    assert isinstance(record, Record)
    return encode_record(record)


def _plant(location: str | None, journal: Journal, identity: Identity, data: bytes) -> None:
    """Replace a record's stored bytes behind the journal's back (status column kept)."""
    digest = identity_digest(identity)
    store = journal.store
    if isinstance(store, MemoryStore):
        store.put_document(identity, data)
    elif location is not None and _pg.is_postgres(location):
        _pg.put_document(location, digest, data)
    elif location is not None and location.startswith("sqlite://"):
        path = location[len("sqlite://") :]
        with contextlib.closing(sqlite3.connect(path)) as database, database:
            database.execute(
                "UPDATE itemjournal_records SET document = ? WHERE digest = ?", (data, digest)
            )
    else:
        Path(store.path_for(identity)).write_bytes(data)  # type: ignore[attr-defined]


def _set_status_column(location: str, identity: Identity, status: str) -> None:
    digest = identity_digest(identity)
    if _pg.is_postgres(location):
        connection, schema = _pg.connect(location)
        with connection:
            connection.execute(
                f"UPDATE {schema}.records SET status = %s WHERE digest = %s", (status, digest)
            )
        return
    path = location[len("sqlite://") :]
    with contextlib.closing(sqlite3.connect(path)) as database, database:
        database.execute(
            "UPDATE itemjournal_records SET status = ? WHERE digest = ?", (status, digest)
        )


@pytest.fixture
def place(request: pytest.FixtureRequest, store_kind: str) -> str | None:
    """The journal's location (None for the memory store)."""
    return None if store_kind == "memory" else str(request.getfixturevalue("location"))


async def test_tally_of_a_healthy_journal_is_its_counts(journal: Journal, store_kind: str) -> None:
    empty = await journal.store.tally()
    by_status = await fill(journal)
    counts = await journal.counts()
    assert counts == expected(by_status)
    tally = await journal.store.tally()
    if store_kind == "file":
        assert empty is None
        assert tally is None  # no index: counting is a full scan
        return
    assert empty is not None
    assert empty.counts == dict.fromkeys(counts, 0)
    assert tally is not None
    assert tally.counts == counts
    assert tally.exact is (store_kind == "memory")


async def test_counts_read_every_record_and_tally_what_the_store_can_see(
    journal: Journal, store_kind: str, place: str | None
) -> None:
    by_status = await fill(journal)
    counts = expected(by_status)
    broken, elsewhere = by_status["succeeded"][:2]
    # Not a record at all: every way of counting finds it invalid.
    await anyio.to_thread.run_sync(_plant, place, journal, broken, b"{broken")
    # Names its status as the store writes it, but its claim id is no claim id: only a
    # strict reading of the whole document finds it invalid.
    good = await document(journal, elsewhere)
    damaged = re.sub(rb'"claim_id": "[0-9a-f]{32}"', b'"claim_id": "not hex"', good)
    assert damaged != good
    await anyio.to_thread.run_sync(_plant, place, journal, elsewhere, damaged)
    counts["succeeded"] -= 2
    counts["invalid"] += 2
    if store_kind in ("sqlite", "postgres"):
        assert place is not None
        # A status column that disagrees with the document (a released column on a
        # needs_review record): counted as invalid, out of the released count.
        wrong = by_status["needs_review"][0]
        await anyio.to_thread.run_sync(_set_status_column, place, wrong, "released")
        counts["needs_review"] -= 1
        counts["invalid"] += 1
    if store_kind == "sqlite":
        assert place is not None
        nonsense = by_status["started"][0]  # a status column of no status at all
        await anyio.to_thread.run_sync(_set_status_column, place, nonsense, "finished")
        counts["started"] -= 1
        counts["invalid"] += 1

    assert await journal.counts() == counts
    tally = await journal.store.tally()
    if store_kind == "file":
        assert tally is None
    elif store_kind == "memory":
        assert tally is not None
        assert tally.exact
        assert tally.counts == counts
    else:
        assert tally is not None
        assert not tally.exact
        told = dict(counts)
        told["succeeded"] += 1  # the record damaged past its status
        told["invalid"] -= 1
        assert tally.counts == told


async def test_a_suspect_row_that_reads_well_is_counted_under_its_status(
    journal: Journal, place: str | None
) -> None:
    """A document the strict reader accepts but laid out otherwise than the store writes
    it (a space more) is suspect to the SQLite store: read, and counted as what it is."""
    by_status = await fill(journal, 8)
    identity = by_status["needs_review"][0]
    good = await document(journal, identity)
    respaced = good.replace(b'"status": "needs_review"', b'"status":  "needs_review"')
    assert respaced != good
    await anyio.to_thread.run_sync(_plant, place, journal, identity, respaced)
    counts = await journal.counts()
    assert counts == expected(by_status)
    tally = await journal.store.tally()
    if tally is not None:
        assert tally.counts == counts


async def test_the_memory_store_reads_a_replaced_document_again() -> None:
    store = MemoryStore()
    journal = Journal(store)
    by_status = await fill(journal, 8)
    first = await store.tally()
    assert first.counts == expected(by_status)
    identity = by_status["succeeded"][0]
    store.put_document(identity, b"[]")
    second = await store.tally()
    assert second.counts["invalid"] == 1
    assert second.counts["succeeded"] == first.counts["succeeded"] - 1
    store.put_document(identity, None)
    third = await store.tally()
    assert third.counts["invalid"] == 0
    assert sum(third.counts.values()) == 7


async def _keys(journal: Journal, **kwargs: Any) -> list[str | None]:
    keys: list[str | None] = []
    async with contextlib.aclosing(journal.store.scan(**kwargs)) as items:
        async for item in items:
            if isinstance(item, Record):
                keys.append(identity_digest(item.identity))
            else:
                found = re.findall(r"[0-9a-f]{64}", str(getattr(item, "location", "")))
                keys.append(found[-1] if found else None)
    return keys


async def test_a_scan_starts_after_a_key(journal: Journal) -> None:
    by_status = await fill(journal, 24)
    everything = await _keys(journal)
    assert everything == sorted(key for key in everything if key is not None)
    assert len(everything) == 24
    middle = everything[11]
    assert middle is not None
    for after in (everything[0], middle, everything[-1], "0" * 64, "f" * 64):
        assert after is not None
        wanted = [key for key in everything if key is not None and key > after]
        assert await _keys(journal, after=after) == wanted
        started = {identity_digest(identity) for identity in by_status["started"]}
        assert await _keys(journal, status="started", after=after) == [
            key for key in wanted if key in started
        ]
    # Just before a key, that key is the first one found.
    before = f"{int(middle, 16) - 1:064x}"
    assert (await _keys(journal, after=before))[0] == middle


async def test_a_scan_after_a_key_leaves_out_the_bad_records_before_it(
    journal: Journal, place: str | None
) -> None:
    by_status = await fill(journal, 12)
    keys = sorted(identity_digest(i) for identities in by_status.values() for i in identities)
    bad = next(
        identity
        for identities in by_status.values()
        for identity in identities
        if identity_digest(identity) == keys[5]
    )
    await anyio.to_thread.run_sync(_plant, place, journal, bad, b"{broken")
    assert await _keys(journal, after=keys[4]) == keys[5:]
    assert await _keys(journal, after=keys[5]) == keys[6:]


async def test_the_file_store_lists_a_fan_out_only_when_the_scan_gets_there(
    journal: Journal, location: str, file_only: None
) -> None:
    """A fan-out that cannot be listed is reported where its records would come, and a
    scan stopped before it never meets it: a first page does not list the whole store."""
    await fill(journal, 24)
    keys = [key for key in await _keys(journal) if key is not None]
    used = {key[:2] for key in keys}
    lowest = min(used)
    stray = next(f"{n:02x}" for n in range(int(lowest, 16) + 1, 256) if f"{n:02x}" not in used)
    await anyio.to_thread.run_sync(Path(location, stray).write_bytes, b"not a directory")
    store = journal.store
    assert isinstance(store, FileStore)
    async with contextlib.aclosing(store.scan(batch=1)) as scan:
        first = await anext(scan)
    assert isinstance(first, Record)
    items = [item async for item in store.scan(batch=5)]
    problems = [n for n, item in enumerate(items) if isinstance(item, StorageFailed)]
    assert len(problems) == 1
    place = problems[0]
    assert stray in str(items[place])
    before = [item for item in items[:place] if isinstance(item, Record)]
    after = [item for item in items[place + 1 :] if isinstance(item, Record)]
    assert all(identity_digest(item.identity)[:2] < stray for item in before)
    assert all(identity_digest(item.identity)[:2] > stray for item in after)
    assert len(before) + len(after) == 24
    # Past the broken fan-out, a listing does not meet it again.
    past = max(key for key in keys if key[:2] > stray)
    assert await _keys(journal, after=past) == []


def _indexes(path: str) -> set[str]:
    with contextlib.closing(sqlite3.connect(path)) as connection:
        rows = connection.execute("SELECT name FROM sqlite_master WHERE type = 'index'")
        return {str(name) for (name,) in rows}


async def test_sqlite_makes_its_released_index_when_a_database_lacks_it(
    location: str, store_kind: str
) -> None:
    if store_kind != "sqlite":
        pytest.skip("about the SQLite store's indexes")
    path = location[len("sqlite://") :]
    async with await Journal.open(location) as journal:
        by_status = await fill(journal, 8)

    def drop() -> None:
        with contextlib.closing(sqlite3.connect(path)) as connection, connection:
            connection.execute("DROP INDEX itemjournal_records_released")

    await anyio.to_thread.run_sync(drop)
    assert "itemjournal_records_released" not in await anyio.to_thread.run_sync(_indexes, path)
    async with await Journal.open(location) as journal:
        assert "itemjournal_records_released" in await anyio.to_thread.run_sync(_indexes, path)
        tally = await journal.store.tally()
        assert tally is not None
        assert tally.counts == expected(by_status)
        assert await journal.verify() == ()


# --------------------------------------------------------------------------- the viewer


@contextlib.asynccontextmanager
async def client_of(journal: Journal) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(journal))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        yield client


def shown_counts(page: str) -> dict[str, int]:
    found = re.findall(r'data-count="([a-z_]+)">\s*<span class="n">(\d+)</span>', page)
    return {status: int(number) for status, number in found}


@pytest.mark.async_only  # its faults are injected through the async journal or store
async def test_the_first_page_shows_counts_at_a_bounded_cost(
    journal: Journal, store_kind: str, place: str | None
) -> None:
    by_status = await fill(journal, 12)
    bad = by_status["succeeded"][0]
    await anyio.to_thread.run_sync(_plant, place, journal, bad, b"{broken")
    counts = await journal.counts()
    assert counts["invalid"] == 1
    async with client_of(journal) as client:
        page = await client.get("/")
        assert page.status_code == 200
        assert shown_counts(page.text) == counts
        total = sum(counts.values())
        assert f'<span class="n">{total}</span> <span class="label">all</span>' in page.text
        note = 'id="counts-note"' in page.text
        # Only the database stores count from their indexes, and say so.
        assert note is (store_kind in ("sqlite", "postgres"))
        if note:
            assert 'href="/counts">Count every record</a>' in page.text
        full = await client.get("/counts")
        assert full.status_code == 200
        assert shown_counts(full.text) == counts
        assert "Every record was read to count these." in full.text
        assert 'href="/api/counts"' in full.text


@pytest.mark.async_only  # its faults are injected through the async journal or store
async def test_a_file_store_beyond_the_count_limit_links_to_the_full_count(
    journal: Journal, file_only: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    by_status = await fill(journal, 12)
    monkeypatch.setattr(viewer_module, "COUNT_LIMIT", 11)
    async with client_of(journal) as client:
        page = await client.get("/")
        assert page.status_code == 200
        assert shown_counts(page.text) == {}
        text = " ".join(page.text.split())
        assert "More than 11 records: counting them reads every one." in text
        assert 'href="/counts">Count them</a>' in page.text
        assert len(re.findall(r'<tr class="record', page.text)) == 12  # the page itself
        monkeypatch.setattr(viewer_module, "COUNT_LIMIT", 12)
        page = await client.get("/")
        assert shown_counts(page.text) == expected(by_status)
        assert 'id="counts-note"' not in page.text


@pytest.mark.async_only  # its faults are injected through the async journal or store
async def test_a_store_that_cannot_be_read_fails_the_first_page(
    journal: Journal, store_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await fill(journal, 4)

    async def unreadable() -> None:
        raise StorageFailed("cannot read the store", errno=5)

    monkeypatch.setattr(journal.store, "tally", unreadable)
    async with client_of(journal) as client:
        page = await client.get("/")
        assert page.status_code == 503
        assert "cannot read the store" in page.text
        assert (await client.get("/counts")).status_code == 200


@pytest.mark.async_only  # its faults are injected through the async journal or store
async def test_a_tally_that_cannot_be_read_is_a_storage_failure(
    journal: Journal, store_kind: str, place: str | None
) -> None:
    """A database whose table was taken away behind the journal's back: ``tally`` says
    STORAGE_FAILED (and the viewer's first page a 503), it never guesses."""
    if store_kind not in ("sqlite", "postgres"):
        pytest.skip("about the database stores")
    assert place is not None
    await fill(journal, 4)

    def take_away() -> None:
        if _pg.is_postgres(place):
            connection, schema = _pg.connect(place)
            with connection:
                connection.execute(f"ALTER TABLE {schema}.records RENAME TO gone")
            return
        path = place[len("sqlite://") :]
        with contextlib.closing(sqlite3.connect(path)) as database, database:
            database.execute("DROP INDEX itemjournal_records_released")

    await anyio.to_thread.run_sync(take_away)
    with pytest.raises(StorageFailed) as raised:
        await journal.store.tally()
    assert raised.value.code == "STORAGE_FAILED"
    assert "cannot count the records" in raised.value.message
    async with client_of(journal) as client:
        assert (await client.get("/")).status_code == 503
