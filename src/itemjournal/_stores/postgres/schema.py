"""The journal's tables in PostgreSQL: their layout, their creation, their migration, and
the check that a schema is the journal's and of a version this code reads.

A schema (``itemjournal`` unless the location says ``?schema=name``) holds two tables:
``records`` (one row per identity: its digest, status, claim id, the record document's
exact bytes as ``bytea`` so that the strict reader sees what was written, and the server's
time of its last write) and ``meta`` (the schema version and the journal's settings). A
partial index on the open statuses serves the sweeps and review queues; another, empty
while all is well, finds the rows whose document disagrees with their status column.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Final

import psycopg
import psycopg.errors
from psycopg import sql

from ..._model.errors import StorageFailed
from ..._model.records import STATUSES
from .connections import Connections, roll_back
from .failures import describe, failure
from .settle import commit_level, heard_cut, standbys_have

__all__ = [
    "OPEN_STATUSES",
    "SCHEMA_VERSION",
    "Tables",
    "check_journal",
    "prepare",
    "record_setting",
]

SCHEMA_VERSION: Final = "2"
# Versions an open brings up to this one (under the schema lock, in one transaction).
_MIGRATES: Final = ("1",)
_KIND: Final = "itemjournal"
OPEN_STATUSES: Final = ("started", "needs_review")
# A constant first key for the lock that serialises creating the schema (any 32-bit
# value; this one spells "ijnl").
_CREATE_LOCK: Final = 0x696A6E6C

StartWrite = Callable[[psycopg.Connection[Any]], None]


@dataclasses.dataclass(frozen=True, slots=True)
class Tables:
    """The names of one schema's tables, its status function, and the condition that
    picks out the suspect rows."""

    schema: str
    records: sql.Identifier
    meta: sql.Identifier
    doc_status: sql.Identifier
    suspect: sql.Composed

    @classmethod
    def of(cls, schema: str) -> Tables:
        doc_status = sql.Identifier(schema, "doc_status")
        return cls(
            schema=schema,
            records=sql.Identifier(schema, "records"),
            meta=sql.Identifier(schema, "meta"),
            doc_status=doc_status,
            suspect=sql.SQL("{}(document) IS DISTINCT FROM status").format(doc_status),
        )


def prepare(
    connection: psycopg.Connection[Any], tables: Tables, where: str, start_write: StartWrite
) -> None:
    """Create the schema and tables, or check the ones there, in one transaction that
    holds a lock, so that first openers on many hosts never trip over each other."""
    schema = tables.schema
    try:
        start_write(connection)
        connection.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_CREATE_LOCK, schema))
        exists = connection.execute(
            "SELECT to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL",
            (f"{schema}.records", f"{schema}.meta"),
        ).fetchone()
        assert exists is not None
        if exists == (False, False):
            _create(connection, tables)
        elif not all(exists):
            raise StorageFailed(
                f"{where} (schema {schema}) holds tables that itemjournal "
                "did not make; choose another schema with ?schema=name"
            )
        if _check_meta(connection, tables, where, migrate=True) in _MIGRATES:
            _migrate(connection, tables)
        connection.commit()
    except psycopg.Error as error:
        roll_back(connection)
        raise failure(f"cannot prepare the journal in {where}", error) from error
    except BaseException:
        roll_back(connection)
        raise


def _create(connection: psycopg.Connection[Any], tables: Tables) -> None:
    statuses = sql.SQL(", ").join(sql.Literal(status) for status in STATUSES)
    open_statuses = sql.SQL(", ").join(sql.Literal(status) for status in OPEN_STATUSES)
    for statement in (
        sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(tables.schema)),
        sql.SQL(
            'CREATE TABLE {} (digest text COLLATE "C" PRIMARY KEY '
            "CHECK (digest ~ '^[0-9a-f]{{64}}$'), "
            "status text NOT NULL CHECK (status IN ({})), "
            "claim_id text NOT NULL, document bytea NOT NULL, "
            "written_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        ).format(tables.records, statuses),
        sql.SQL("CREATE INDEX {} ON {} (status, digest) WHERE status IN ({})").format(
            sql.Identifier("records_open"), tables.records, open_statuses
        ),
        # The status a document names, or NULL when it is not JSON naming one: rows
        # whose document disagrees with their status column are suspects, found by
        # every status scan through an index that is empty while all is well.
        sql.SQL(
            "CREATE FUNCTION {}(document bytea) RETURNS text LANGUAGE plpgsql "
            "IMMUTABLE PARALLEL SAFE AS $$ BEGIN "
            "RETURN convert_from(document, 'UTF8')::jsonb ->> 'status'; "
            "EXCEPTION WHEN others THEN RETURN NULL; END $$"
        ).format(tables.doc_status),
        sql.SQL("CREATE INDEX {} ON {} (digest) WHERE {}").format(
            sql.Identifier("records_suspect"), tables.records, tables.suspect
        ),
        sql.SQL("CREATE TABLE {} (key text PRIMARY KEY, value text NOT NULL)").format(tables.meta),
        sql.SQL("INSERT INTO {} (key, value) VALUES ('kind', {}), ('schema_version', {})").format(
            tables.meta, sql.Literal(_KIND), sql.Literal(SCHEMA_VERSION)
        ),
    ):
        connection.execute(statement)


def _migrate(connection: psycopg.Connection[Any], tables: Tables) -> None:
    """Version 1 to 2: the server-stamped ``written_at``, by which ``ages`` (and so
    ``prune``) judges a record's age on the server's clock.

    Rows written before the column existed cannot say when they were written: they
    are given the migration's own time (the server's ``now()``, fixed once for them
    all), the latest time they can have been written. Their age is then never
    overstated: a prune waits its full period from the migration before it removes
    one, rather than removing too early a record that a stale client clock would
    call old. Later writes stamp the column themselves; the default (the server's
    clock) covers a writer that names no value."""
    for statement in (
        sql.SQL("ALTER TABLE {} ADD COLUMN written_at timestamptz NOT NULL DEFAULT now()").format(
            tables.records
        ),
        sql.SQL("ALTER TABLE {} ALTER COLUMN written_at SET DEFAULT clock_timestamp()").format(
            tables.records
        ),
        sql.SQL("UPDATE {} SET value = {} WHERE key = 'schema_version'").format(
            tables.meta, sql.Literal(SCHEMA_VERSION)
        ),
    ):
        connection.execute(statement)


def _check_meta(
    connection: psycopg.Connection[Any], tables: Tables, where: str, *, migrate: bool = False
) -> str:
    """The schema's version; refuses a schema not ours, or a version this code does
    not read (with ``migrate``, one it can bring up to date is let through)."""
    try:
        rows = dict(
            connection.execute(
                sql.SQL(
                    "SELECT key::text, value::text FROM {} "
                    "WHERE key::text IN ('kind', 'schema_version')"
                ).format(tables.meta)
            ).fetchall()
        )
    except psycopg.errors.UndefinedColumn:
        rows = {}  # a meta table without our columns: someone else's
    if rows.get("kind") != _KIND:
        raise StorageFailed(f"{where} (schema {tables.schema}) was not made by itemjournal")
    version = rows.get("schema_version")
    if version != SCHEMA_VERSION and not (migrate and version in _MIGRATES):
        raise StorageFailed(
            f"{where} (schema {tables.schema}) has journal schema version "
            f"{version!r}; this itemjournal reads version {SCHEMA_VERSION}"
        )
    return str(version)


def check_journal(connections: Connections, tables: Tables, where: str) -> list[str]:
    """What is wrong with the journal's schema (``Store.check``): nothing, or why it is
    not one this code reads, or why it cannot be read."""

    def check(connection: psycopg.Connection[Any]) -> None:
        _check_meta(connection, tables, where)
        connection.rollback()

    try:
        connections.idempotent(check)
    except StorageFailed as error:
        return [str(error)]
    except psycopg.Error as error:
        return [str(failure(f"cannot check {where}", error))]
    return []


def record_setting(
    connections: Connections, tables: Tables, where: str, key: str, value: str
) -> str:
    """The journal's setting ``key`` in ``meta``: its first value, written now if none was.

    Written twice is safe (the first value stays), so a try whose connection was lost is
    run again; but once a commit's answer was lost, or its wait for the synchronous
    standbys was cut short (``heard_cut``), the value read is acknowledged only with the
    proof a record's lost commit needs: the standbys have it (``standbys_have``). The
    value read after a lost commit may be that commit's, on the primary alone; a lost
    commit still waiting for the standbys holds the key, and the next try waits for it
    at most ``lock_timeout``. Otherwise the outcome is unknown."""
    lost: list[str] = []  # why an earlier try's outcome is unknown
    unknown: list[StorageFailed] = []  # the answer that already says so

    def record(connection: psycopg.Connection[Any]) -> str:
        connections.start_write(connection)
        connection.execute(
            sql.SQL(
                "INSERT INTO {} (key, value) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING"
            ).format(tables.meta),
            (key, value),
        )
        row = connection.execute(
            sql.SQL("SELECT value FROM {} WHERE key = %s").format(tables.meta), (key,)
        ).fetchone()
        assert row is not None
        level = commit_level(connections.server_of(connection))
        try:
            with heard_cut(connection) as cut:
                connection.commit()
        except psycopg.OperationalError:
            if connection.broken:
                lost.append("the connection was lost during its commit")
            raise
        if cut:
            lost.append(f"its commit stopped waiting for the synchronous standbys ({cut[0]})")
        if lost:
            proof = standbys_have(connection, level)
            if proof is not True:
                unknown.append(
                    StorageFailed(
                        f"cannot record the setting {key!r} in {where}: {lost[0]}, so its "
                        f"outcome is unknown: {proof}"
                    )
                )
                raise unknown[0]
        return str(row[0])

    try:
        return connections.idempotent(record)
    except (psycopg.Error, StorageFailed) as error:
        if lost and error not in unknown:
            # A later try failed, or waited out lock_timeout behind the lost commit: the
            # earlier one may still have written (no errno: this is no mere timeout).
            why = error.message if isinstance(error, StorageFailed) else describe(error)
            raise StorageFailed(
                f"cannot record the setting {key!r} in {where}: {lost[0]}, so its outcome "
                f"is unknown ({why})"
            ) from error
        if isinstance(error, StorageFailed):
            raise
        raise failure(f"cannot record the setting {key!r} in {where}", error) from error
