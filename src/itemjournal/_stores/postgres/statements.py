"""The statements of every operation on the records table, composed once per store.

Composing them per call cost more than a third of the store's own time per cycle, so each
is turned into the text sent to the server when the store is made. A write comes in four
forms: an update or an insert, each with or without the check that the owner session
vouching for a claim still holds its lock (made by the write statement itself, so that it
costs no round trip).
"""

from __future__ import annotations

from psycopg import sql

from ..._model.records import STATUSES
from .schema import OPEN_STATUSES, Tables
from .session import HELD

__all__ = ["Statements", "column_bytes"]


def _text(query: sql.SQL, *parts: sql.Composable) -> str:
    """``query`` with ``parts`` in its ``{}``, as the text sent to the server."""
    return query.format(*parts).as_string(None)


def column_bytes(value: object) -> object:
    """A ``bytea`` column's value as bytes (psycopg may hand out a memoryview)."""
    return value.tobytes() if isinstance(value, memoryview) else value


class Statements:
    """The text of each statement the store's operations send, for one schema's tables."""

    __slots__ = ("ages", "delete", "lock", "page", "row", "tally", "write")

    def __init__(self, tables: Tables) -> None:
        records = tables.records
        self.row = _text(sql.SQL("SELECT status, document FROM {} WHERE digest = %s"), records)
        self.lock = _text(
            sql.SQL("SELECT status, document FROM {} WHERE digest = %s FOR UPDATE"), records
        )
        self.delete = _text(sql.SQL("DELETE FROM {} WHERE digest = %s"), records)
        # By (the row exists, an owner session vouches for the claim).
        self.write: dict[tuple[bool, bool], str] = {}
        for vouched in (False, True):
            held = sql.SQL(f" AND {HELD}" if vouched else "")
            self.write[True, vouched] = _text(
                sql.SQL(
                    "UPDATE {} SET status = %s, claim_id = %s, document = %s, "
                    "written_at = clock_timestamp() WHERE digest = %s{}"
                ),
                records,
                held,
            )
            self.write[False, vouched] = _text(
                sql.SQL(
                    "INSERT INTO {} (status, claim_id, document, digest, written_at) "
                    "SELECT %s, %s, %s, %s, clock_timestamp() WHERE TRUE{} "
                    "ON CONFLICT (digest) DO NOTHING"
                ),
                records,
                held,
            )
        self.page = {status: _page(tables, status) for status in (None, *STATUSES)}
        # One statement, so one snapshot: the rows per status column (the table keeps the
        # column one of the statuses), then every suspect row, to be read strictly.
        self.tally = _text(
            sql.SQL(
                "SELECT status, count(*), NULL::text, NULL::bytea FROM {0} GROUP BY status "
                "UNION ALL SELECT status, NULL::bigint, digest, document FROM {0} WHERE {1}"
            ),
            records,
            tables.suspect,
        )
        self.ages = _text(
            sql.SQL(
                "SELECT digest, greatest(now() - written_at, interval '0') FROM {} "
                "WHERE digest = ANY(%s)"
            ),
            records,
        )


def _page(tables: Tables, status: str | None) -> str:
    """A page of rows in digest order: all of them, or those of ``status`` and the
    suspects (whose document may name that status although their column does not)."""
    condition: sql.Composable = sql.SQL("")
    if status is not None:
        wanted: sql.Composable = sql.SQL("status = {}").format(sql.Literal(status))
        if status in OPEN_STATUSES:  # lets the planner see that the partial index holds
            wanted += sql.SQL(" AND status IN ({})").format(
                sql.SQL(", ").join(sql.Literal(s) for s in OPEN_STATUSES)
            )
        condition = sql.SQL(" AND (({}) OR {})").format(wanted, tables.suspect)
    return _text(
        sql.SQL(
            "SELECT digest, status, document FROM {} WHERE digest > %s{} ORDER BY digest LIMIT %s"
        ),
        tables.records,
        condition,
    )
