"""What the SQLite store reads outside the writer: pages of a scan, the tally, the ages.

Each read is the statements it runs on a reader connection (raising ``sqlite3.Error``,
which the store maps to ``STORAGE_FAILED``) and what it makes of their rows once the
connection is back in the pool. A scan pages through the rows in SQLite's own digest
order, so its bounds (``_Bound``) compare as SQLite compares: text as UTF-8 bytes, before
blobs. The functions run in a worker thread.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Final, NamedTuple

from ..._model.errors import RecordInvalid, StorageFailed
from ..._model.records import STATUSES as _STATUSES
from ..._model.records import Record
from .connection import _Undecodable
from .schema import _OPEN, _OPEN_CONDITION, _SUSPECT_CONDITION

__all__ = [
    "_FIRST",
    "ReadRow",
    "Rows",
    "Suspect",
    "_Bound",
    "_page_queries",
    "ages_of",
    "count",
    "fetch_page",
    "fetch_tally",
    "fetch_written_at",
    "page_of",
]

# ``tally``: every status counted from an index, no document read. The rows whose status
# column is ``succeeded`` (the bulk of a journal) have no index of their own: they are
# what is left of the total, which SQLite counts on the smallest index (the digests).
# ``released`` has a partial index for this alone (few rows: a record leaves that status
# when it is claimed again). The suspect rows are read and each counted as the strict
# reader tells, moved out of the count its status column put it in.
_TALLY_TOTAL: Final = "SELECT count(*) FROM itemjournal_records"
_TALLY_OPEN: Final = (
    "SELECT status, count(*) FROM itemjournal_records INDEXED BY itemjournal_records_open "
    f"WHERE {_OPEN_CONDITION} GROUP BY status"
)
_TALLY_RELEASED: Final = (
    "SELECT count(*) FROM itemjournal_records INDEXED BY itemjournal_records_released "
    "WHERE status = 'released'"
)
_TALLY_SUSPECT: Final = (
    "SELECT digest, status, document, "
    "CASE WHEN status IN ('started', 'needs_review', 'released') THEN status END "
    f"FROM itemjournal_records INDEXED BY itemjournal_records_suspect WHERE {_SUSPECT_CONDITION}"
)
_AGES_CHUNK: Final = 500  # digests per query, well under SQLite's limit of parameters

Row = tuple[object, object, object]
"""A row as stored: its digest, its status column and its document, each unchecked."""
Rows = dict[tuple[bool, bytes], Row]
"""The rows of one page, by their place in SQLite's digest order (``_sort_key``)."""
ReadRow = Callable[[object, object, object], Record]
"""The store's strict reader of one row: its record, or that row's error."""
Suspect = tuple[object, object, object, str | None]
"""A suspect row for the tally, with the open status its column counted it under."""


class _Bound(NamedTuple):
    """Where the next page of a scan starts: after (or at) a digest, in SQLite's order
    (text, compared as UTF-8 bytes, before blobs)."""

    blob: bool
    raw: bytes
    inclusive: bool


_FIRST: Final = _Bound(blob=False, raw=b"", inclusive=True)  # the smallest text: every row


def _sort_key(digest: object) -> tuple[bool, bytes]:
    if isinstance(digest, bytes):
        return True, digest
    if isinstance(digest, _Undecodable):
        return False, digest.raw
    return False, str(digest).encode("utf-8")


def _page_queries(status: str | None, after: _Bound) -> list[str]:
    """The SQL of one page of a scan (parameters: bound, page size), one or two queries.

    The open statuses (what sweeps and review queues look for) have a partial index
    (status, digest); SQLite uses it when the query repeats the index's condition. Their
    scans also read the suspect rows (through their own partial index): a row whose
    status cannot be vouched for belongs in every status scan. Any other status has no
    index, so its scan reads every row (``page_of`` keeps the wanted status and every
    row that cannot be read).
    """
    columns = "SELECT digest, status, document FROM itemjournal_records"
    bound = f"digest {'>=' if after.inclusive else '>'} {'?' if after.blob else 'CAST(? AS TEXT)'}"
    tail = f"{bound} ORDER BY digest LIMIT ?"
    suspect = (
        f"{columns} INDEXED BY itemjournal_records_suspect WHERE ({_SUSPECT_CONDITION}) AND {tail}"
    )
    if status is None:
        return [f"{columns} WHERE {tail}"]
    if status in _OPEN:
        return [
            f"{columns} INDEXED BY itemjournal_records_open WHERE {_OPEN_CONDITION} "
            f"AND status = '{status}' AND {tail}",
            suspect,
        ]
    return [f"{columns} WHERE {tail}"]


def fetch_page(reader: sqlite3.Connection, after: _Bound, size: int, status: str | None) -> Rows:
    """The rows of one page of a scan, at most ``size`` from each of its queries."""
    rows: Rows = {}
    parameter = after.raw
    for query in _page_queries(status, after):
        for digest, column, document in reader.execute(query, (parameter, size)):
            rows.setdefault(_sort_key(digest), (digest, column, document))
    return rows


def page_of(
    rows: Rows, size: int, status: str | None, read_row: ReadRow
) -> tuple[list[Record | RecordInvalid | StorageFailed], _Bound | None]:
    """One page of a scan from its fetched rows, and where the next starts (None: this
    was the last)."""
    keys = sorted(rows)[:size]  # the first ``size`` of each query's first ``size``
    page: list[Record | RecordInvalid | StorageFailed] = []
    for key in keys:
        try:
            record = read_row(*rows[key])
        except (RecordInvalid, StorageFailed) as error:
            page.append(error)
            continue
        if status is None or record.status == status:
            page.append(record)
    if len(keys) < size:
        return page, None
    blob, raw = keys[-1]
    return page, _Bound(blob=blob, raw=raw, inclusive=False)


def fetch_tally(
    reader: sqlite3.Connection,
) -> tuple[int, dict[str | None, int], list[Suspect]]:
    """The counts from the indexes and the suspect rows, in one read transaction."""
    reader.execute("BEGIN")
    try:
        (total,) = reader.execute(_TALLY_TOTAL).fetchone()
        by_column: dict[str | None, int] = dict(reader.execute(_TALLY_OPEN).fetchall())
        by_column["released"] = reader.execute(_TALLY_RELEASED).fetchone()[0]
        suspects = reader.execute(_TALLY_SUSPECT).fetchall()
    finally:
        reader.execute("ROLLBACK")
    return total, by_column, suspects


def count(
    total: int,
    by_column: dict[str | None, int],
    suspects: list[Suspect],
    read_row: ReadRow,
) -> dict[str, int]:
    """The records per status (and ``invalid``), each suspect row read strictly."""
    counted = dict.fromkeys((*_STATUSES, "invalid"), 0)
    for status in (*_OPEN, "released"):
        counted[status] = by_column.get(status, 0)
    counted["succeeded"] = total - sum(counted.values())  # and rows of no known status
    for digest, column, document, indexed in suspects:
        counted["succeeded" if indexed is None else indexed] -= 1
        try:
            counted[read_row(digest, column, document).status] += 1
        except (RecordInvalid, StorageFailed):
            counted["invalid"] += 1
    return counted


def fetch_written_at(reader: sqlite3.Connection, digests: Sequence[str]) -> dict[object, object]:
    """Each found row's ``written_at``, by its digest."""
    found: dict[object, object] = {}
    for start in range(0, len(digests), _AGES_CHUNK):
        chunk = digests[start : start + _AGES_CHUNK]
        marks = ",".join("?" * len(chunk))
        found.update(
            reader.execute(
                f"SELECT digest, written_at FROM itemjournal_records WHERE digest IN ({marks})",
                chunk,
            ).fetchall()
        )
    return found


def ages_of(
    digests: Sequence[str], found: dict[object, object], now: float | None
) -> list[timedelta | None]:
    """How long ago each row was written, by the kernel's clock ``now``; None where the
    row is absent, its time unreadable, or the kernel's clock unknown."""
    ages: list[timedelta | None] = []
    for digest in digests:
        written = found.get(digest)
        if now is None or isinstance(written, bool) or not isinstance(written, (int, float)):
            ages.append(None)
        else:
            ages.append(timedelta(seconds=now - written))
    return ages
