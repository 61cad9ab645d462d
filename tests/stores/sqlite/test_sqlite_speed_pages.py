"""The SQLite store's page traffic: what a group commit writes to the write-ahead log.

Counted in pages (frames of the log), which do not depend on the machine's speed or
load; no timing is asserted.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import anyio
import pytest

from itemjournal import Claim, Identity, Journal, SQLiteStore, definition_digest
from itemjournal._model.identity import identity_digest

pytestmark = pytest.mark.anyio

DEFINITION = definition_digest("sqlite-pages-v1")


def item(n: int) -> tuple[str, str, str, str]:
    return ("sq", "pages", "cycle", f"item-{n}")


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "journal.db"


async def open_journal(db: Path) -> tuple[SQLiteStore, Journal]:
    journal = await Journal.open(f"sqlite://{db}")
    store = journal.store
    assert isinstance(store, SQLiteStore)
    return store, journal


def fill(db: Path, count: int) -> None:
    """``count`` more succeeded records, copies of item 0's document under their own
    identities, written in one transaction and checkpointed into the database file."""
    connection = sqlite3.connect(db, isolation_level=None)
    try:
        [document] = connection.execute(
            "SELECT document FROM itemjournal_records WHERE digest = ?",
            (identity_digest(Identity(*item(0))),),
        ).fetchone()
        text = bytes(document).decode()
        assert '"item-0"' in text
        connection.execute("BEGIN IMMEDIATE")
        connection.executemany(
            "INSERT INTO itemjournal_records (digest, status, document) VALUES (?, ?, ?)",
            [
                (
                    identity_digest(Identity(*item(n))),
                    "succeeded",
                    text.replace('"item-0"', f'"item-{n}"').encode(),
                )
                for n in range(1, count + 1)
            ],
        )
        connection.execute("COMMIT")
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        connection.close()


def log_frames(db: Path) -> int:
    """Frames in the write-ahead log (none is checkpointed while a reader holds it)."""
    connection = sqlite3.connect(db, isolation_level=None)
    try:
        busy, frames, _ = connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        assert busy == 0
        return int(frames)
    finally:
        connection.close()


def sizes(db: Path) -> tuple[int, int]:
    """The largest document of the cycles' records, and the database's page size."""
    connection = sqlite3.connect(db, isolation_level=None)
    try:
        (largest,) = connection.execute(
            "SELECT max(length(document)) FROM itemjournal_records"
        ).fetchone()
        (page_size,) = connection.execute("PRAGMA page_size").fetchone()
        return int(largest), int(page_size)
    finally:
        connection.close()


async def cycles(journal: Journal, first: int, count: int) -> None:
    async def cycle(n: int) -> None:
        claim = await journal.begin(item(n), {"n": str(n)}, DEFINITION)
        assert isinstance(claim, Claim)
        await journal.complete(claim, f"receipt-{n}")

    async with anyio.create_task_group() as tg:
        for n in range(first, first + count):
            tg.start_soon(cycle, n)


async def test_a_group_commit_writes_a_few_pages_not_one_per_operation(db: Path) -> None:
    """Among thousands of records, a commit of many begins and completes writes the
    table's newest pages, one page of the digest index per new record, and the open
    index: far fewer pages than operations. (A table keyed by the digest wrote one
    random table page per operation, and its interior pages with it.)"""
    store, journal = await open_journal(db)
    await cycles(journal, 0, 1)
    await journal.aclose()
    await anyio.to_thread.run_sync(fill, db, 3000)
    store, journal = await open_journal(db)
    assert log_frames(db) == 0
    before = store.commits
    await cycles(journal, 5000, 64)
    commits = store.commits - before
    frames = log_frames(db)
    written_bytes, page_size = await anyio.to_thread.run_sync(sizes, db)
    await journal.aclose()
    writes = 128
    data_pages = -(-writes * written_bytes // page_size)
    print(
        f"\n{writes} writes in {commits} commits wrote {frames} pages to the log "
        f"({data_pages} pages of document bytes)"
    )
    assert commits < writes / 2  # they were grouped
    # at most one digest-index page per claim, the table's newest pages that hold the
    # bytes written (a record written in two commits counts twice), and per commit a few
    # pages of the open index and above them; a table keyed by the digest wrote more
    # pages than writes (279 here)
    assert frames <= writes // 2 + data_pages + 8 * commits, (frames, data_pages, commits)


async def test_records_are_kept_in_the_order_they_were_claimed(db: Path) -> None:
    _, journal = await open_journal(db)
    for n in range(5):
        claim = await journal.begin(item(n), {"n": str(n)}, DEFINITION)
        assert isinstance(claim, Claim)
    await journal.aclose()
    with sqlite3.connect(db) as connection:
        digests = [
            r[0]
            for r in connection.execute("SELECT digest FROM itemjournal_records ORDER BY rowid")
        ]
    assert digests == [identity_digest(Identity(*item(n))) for n in range(5)]
