"""The SQLite journal's schema: its tables and indexes, whose database it is, and how an
earlier version's journal is brought up to this one.

Everything that knows the shape of the tables lives here: the DDL, the condition that
tells which rows SQL cannot vouch for (the suspect rows every status scan and the tally
read), the statement that reads one row, and the checks ``open`` and ``check`` make of
the meta table. The functions take a connection and run in a worker thread.
"""

from __future__ import annotations

import contextlib
import sqlite3
from typing import Final

from ..._model.errors import StorageFailed
from ..._model.records import STATUSES as _STATUSES
from ..kernelclock import kernel_time
from .connection import _Undecodable

__all__ = [
    "APPLICATION",
    "SCHEMA_VERSION",
    "_OPEN",
    "_OPEN_CONDITION",
    "_ROW",
    "_SETTING_PREFIX",
    "_SUSPECT_CONDITION",
    "check_schema",
    "meta_problems",
    "migrate",
    "setting_text",
]

SCHEMA_VERSION: Final = 3
APPLICATION: Final = "itemjournal"
_SETTING_PREFIX: Final = "setting."  # settings share the meta table with the keys above

_OPEN: Final = ("started", "needs_review")  # the statuses in the partial index
_OPEN_CONDITION: Final = "status IN ('started', 'needs_review')"
# A row whose status SQL cannot vouch for: its key is not a digest, its status column
# is not a known status, or its document is not a blob or does not say, as the journal
# writes it, that status: ``"status": "<column>", "updated_at": `` (the keys are
# sorted). Such a row belongs in every status scan (its true status is unknown); its own
# partial index, empty while the journal is healthy, finds it without reading every
# document. The test is a byte search, not a JSON parse (which cost about as much as the
# rest of a write). A document that the strict reader accepts and that holds that text
# has that status: inside the text a quote ends a string and a colon follows, so the
# text is a key ``status``, its value and the next key; no object of a record takes
# free keys, only the top one has ``updated_at``, and keys are unique. A document
# written some other way (spacing, key order) is suspect, which costs its scans nothing
# but a look at it. So a record whose status is open always has its own status column
# or is suspect; the reader still checks every row's column against its document.
_STATUS_MARK: Final = 'CAST(\'"status": "\' || status || \'", "updated_at": \' AS BLOB)'
_SUSPECT_CONDITION: Final = (
    "typeof(digest) != 'text' OR length(CAST(digest AS BLOB)) != 64 "
    "OR digest GLOB '*[^0-9a-f]*' "
    "OR typeof(status) != 'text' "
    # a CASE, not ``NOT IN (...)``: evaluated for every written row, the list cost more
    f"OR CASE status {' '.join(f'WHEN {s!r} THEN 0' for s in _STATUSES)} ELSE 1 END "
    "OR typeof(document) != 'blob' "
    f"OR instr(document, {_STATUS_MARK}) = 0"
)
# Rows live in a rowid table in the order they were claimed: a new record is appended to
# the table's last page and its transitions soon after land on the same few pages, so a
# commit of many operations writes few pages (a digest-keyed table put every record on a
# random page, one page written per operation, each page ~4 KiB in the write-ahead log).
# The digest is found through its own unique index, whose entries are small.
_RECORDS_DDL: Final = """
CREATE TABLE IF NOT EXISTS itemjournal_records (
    id INTEGER PRIMARY KEY,
    digest TEXT NOT NULL,
    status TEXT NOT NULL,
    document BLOB NOT NULL,
    written_at REAL
);
"""
_SCHEMA: Final = (
    """
CREATE TABLE IF NOT EXISTS itemjournal_meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;
"""
    + _RECORDS_DDL
    + """
CREATE UNIQUE INDEX IF NOT EXISTS itemjournal_records_digest ON itemjournal_records (digest);
CREATE INDEX IF NOT EXISTS itemjournal_records_open ON itemjournal_records (status, digest)
    WHERE status IN ('started', 'needs_review');
CREATE INDEX IF NOT EXISTS itemjournal_records_released ON itemjournal_records (digest)
    WHERE status = 'released';
"""
    + "CREATE INDEX IF NOT EXISTS itemjournal_records_suspect ON itemjournal_records (digest)\n"
    + f"    WHERE {_SUSPECT_CONDITION};\n"
)
_TABLES: Final = frozenset({"itemjournal_meta", "itemjournal_records"})
_INDEXES: Final = frozenset(
    {
        "itemjournal_records_digest",
        "itemjournal_records_open",
        "itemjournal_records_released",
        "itemjournal_records_suspect",
    }
)
# Versions this one migrates from (see ``migrate``): 1 kept the rows in a table keyed
# by their digest (WITHOUT ROWID); 2 had no ``written_at``, the kernel's time of each
# row's last write (``ages``).
_MIGRATES_FROM: Final = frozenset({"1", "2"})
_ROW: Final = "SELECT status, document FROM itemjournal_records WHERE digest = ?"


def check_schema(connection: sqlite3.Connection, path: str) -> bool:
    """Whose database this is, read only: True when it is a complete journal, False
    when it is empty or a journal missing part of its schema; refused otherwise."""
    entries = connection.execute("SELECT type, name FROM sqlite_master").fetchall()
    names = {str(name) for _, name in entries if not str(name).startswith("sqlite_")}
    tables = {str(name) for kind, name in entries if kind == "table"}
    if not names:
        return False
    if "itemjournal_meta" not in tables:
        shown = ", ".join(sorted(tables - _TABLES)) or ", ".join(sorted(names))
        raise StorageFailed(
            f"{path} is a SQLite database of something else (tables: {shown}); refusing to use it"
        )
    meta = dict(connection.execute("SELECT key, value FROM itemjournal_meta").fetchall())
    if not meta and not tables - _TABLES:
        return False  # our tables, never filled in: finish creating them
    if meta.get("application") != APPLICATION:
        raise StorageFailed(f"{path} was not made by itemjournal")
    version = meta.get("schema_version")
    if version in _MIGRATES_FROM:
        return False  # an earlier version's journal: ``migrate`` brings it up to date
    if version != str(SCHEMA_VERSION):
        raise StorageFailed(
            f"{path} has schema version {version!r}; "
            f"this itemjournal reads version {SCHEMA_VERSION}"
        )
    return tables >= _TABLES and names >= _INDEXES


def migrate(connection: sqlite3.Connection, path: str) -> None:
    """Create what is missing of the schema; idempotent, safe across processes."""
    connection.execute("BEGIN IMMEDIATE")
    try:
        check_schema(connection, path)  # again, now that no one else can write
        version = None
        if connection.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'itemjournal_meta'"
        ).fetchone():
            version = connection.execute(
                "SELECT value FROM itemjournal_meta WHERE key = 'schema_version'"
            ).fetchone()
        if version is not None and version[0] in _MIGRATES_FROM:
            _upgrade(connection, version[0])
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                connection.execute(statement)
        if not connection.execute("SELECT 1 FROM itemjournal_meta LIMIT 1").fetchone():
            connection.executemany(
                "INSERT INTO itemjournal_meta (key, value) VALUES (?, ?)",
                [("application", APPLICATION), ("schema_version", str(SCHEMA_VERSION))],
            )
        connection.execute("COMMIT")
    except BaseException:
        if connection.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                connection.execute("ROLLBACK")
        raise


def _upgrade(connection: sqlite3.Connection, version: str) -> None:
    """Bring an earlier version's records table up to this version, every row kept as
    it was (digest, status column and document bytes, readable or not), inside
    ``migrate``'s transaction: another process sees the old schema or the new one.

    Rows written before ``written_at`` existed get the migration's own time: their
    age counts from now, so ``prune`` cannot remove one sooner than it could before
    (a clock that was wrong when it was written cannot make it look older)."""
    old = connection.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'itemjournal_records'"
    ).fetchone()
    if old is not None and version == "2":
        connection.execute("ALTER TABLE itemjournal_records ADD COLUMN written_at REAL")
    elif old is not None:
        connection.execute("DROP TABLE IF EXISTS itemjournal_records_upgrade")
        connection.execute(
            _RECORDS_DDL.replace("IF NOT EXISTS itemjournal_records", "itemjournal_records_upgrade")
        )
        connection.execute(
            "INSERT INTO itemjournal_records_upgrade (digest, status, document) "
            "SELECT digest, status, document FROM itemjournal_records"
        )
        connection.execute("DROP TABLE itemjournal_records")  # and its indexes
        connection.execute("ALTER TABLE itemjournal_records_upgrade RENAME TO itemjournal_records")
    if old is not None:
        connection.execute(
            "UPDATE itemjournal_records SET written_at = ? WHERE written_at IS NULL",
            (kernel_time(),),
        )
    connection.execute(
        "UPDATE itemjournal_meta SET value = ? WHERE key = 'schema_version'",
        (str(SCHEMA_VERSION),),
    )


def meta_problems(meta: dict[object, object], location: str) -> list[str]:
    """What ``check`` says of the meta table's keys: whose journal, which version."""
    problems: list[str] = []
    if meta.get("application") != APPLICATION:
        problems.append(f"STORAGE_FAILED: {location} does not say it is an itemjournal")
    if meta.get("schema_version") != str(SCHEMA_VERSION):
        problems.append(
            f"STORAGE_FAILED: {location} has schema version "
            f"{meta.get('schema_version')!r}, not {SCHEMA_VERSION}"
        )
    return problems


def setting_text(key: str, value: object, location: str) -> str:
    """A setting's value as read from the meta table: text, or ``STORAGE_FAILED``."""
    if not isinstance(value, str) or isinstance(value, _Undecodable):
        raise StorageFailed(f"the setting {key!r} in {location} is not readable text")
    return value
