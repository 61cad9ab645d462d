"""The store's reads: one record (``peek``), a page of a scan, the tally, the ages.

Each runs in one worker trip on one pooled connection and is idempotent, so a connection
the server dropped while it sat idle is simply replaced (``Connections.idempotent``).
Every row is read strictly: its document decoded, and its status column checked against
it, so that a row damaged or changed behind the journal's back is reported, never trusted.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import psycopg

from ..._model.codec import decode_row
from ..._model.errors import RecordInvalid, StorageFailed
from ..._model.identity import Identity, identity_digest
from ..._model.records import STATUSES, Record
from .connections import Connections, StepConnection
from .failures import failure
from .statements import Statements, column_bytes

__all__ = ["Reads", "row_record"]

T = TypeVar("T")


def _decode(digest: object, status: object, document: object, where: str) -> Record:
    """The row's record, strictly read; its status column must agree."""
    return decode_row(document, str(digest), status, location=f"{where}#{digest}")


def row_record(digest: str, row: Any, where: str) -> Record | None:
    """The record of a ``(status, document)`` row, or None where there is no row."""
    return None if row is None else _decode(digest, row[0], column_bytes(row[1]), where)


class Reads:
    """The reading operations of one store (each called in a worker thread)."""

    def __init__(
        self,
        connections: Connections,
        statements: Statements,
        step_connection: StepConnection,
        where: str,
    ) -> None:
        self._connections = connections
        self._statements = statements
        self._step_connection = step_connection
        self._where = where

    def peek(self, identity: Identity, view: Callable[[Record | None], T]) -> T:
        digest = identity_digest(identity)
        query = self._statements.row

        def read(connection: psycopg.Connection[Any]) -> T:
            row = connection.execute(query, (digest,)).fetchone()
            record = row_record(digest, row, self._where)
            with self._step_connection.lent(connection):
                return view(record)

        try:
            return self._connections.idempotent(read)
        except psycopg.Error as error:
            raise failure(f"cannot read {self._where}", error) from error

    def page(
        self, after: str, size: int, status: str | None
    ) -> tuple[list[Record | RecordInvalid | StorageFailed], str | None]:
        """Up to ``size`` rows after ``after`` (of ``status``, if given), and where the next
        page starts (None: this was the last)."""
        query = self._statements.page[status]

        def read(connection: psycopg.Connection[Any]) -> list[Any]:
            found = connection.execute(query, (after, size)).fetchall()
            connection.rollback()
            return found

        try:
            rows = self._connections.idempotent(read)
        except psycopg.Error as error:
            raise failure(f"cannot read {self._where}", error) from error
        page: list[Record | RecordInvalid | StorageFailed] = []
        for digest, column, document in rows:
            try:
                record = _decode(digest, column, column_bytes(document), self._where)
            except RecordInvalid as error:
                page.append(error)
                continue
            if status is None or record.status == status:
                page.append(record)
        return page, (rows[-1][0] if len(rows) == size else None)

    def tally(self) -> dict[str, int]:
        """The rows per status column, the suspects among them each read strictly."""

        def read(connection: psycopg.Connection[Any]) -> list[Any]:
            found = connection.execute(self._statements.tally).fetchall()
            connection.rollback()
            return found

        try:
            rows = self._connections.idempotent(read)
        except psycopg.Error as error:
            raise failure(f"cannot count the records in {self._where}", error) from error
        counted = dict.fromkeys((*STATUSES, "invalid"), 0)
        for column, number, digest, document in rows:
            if number is not None:
                counted[column] = counted.get(column, 0) + number
                continue
            counted[column] -= 1
            try:
                counted[_decode(digest, column, column_bytes(document), self._where).status] += 1
            except RecordInvalid:
                counted["invalid"] += 1
        return counted

    def ages(self, digests: list[str]) -> list[timedelta | None]:
        """How long ago each digest's row was written, by the server's clock (None: no row)."""
        if not digests:
            return []
        query = self._statements.ages

        def read(connection: psycopg.Connection[Any]) -> dict[str, timedelta]:
            found = {str(digest): age for digest, age in connection.execute(query, (digests,))}
            connection.rollback()
            return found

        try:
            ages = self._connections.idempotent(read)
        except psycopg.Error as error:
            raise failure(f"cannot read the ages of records in {self._where}", error) from error
        return [ages.get(digest) for digest in digests]
