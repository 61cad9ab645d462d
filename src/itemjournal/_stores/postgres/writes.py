"""The pieces of one write transaction: lock the row, decide whether an owner session
vouches for the claim, write, and say on every failure that nothing was written.

A transition reads the row ``FOR UPDATE``, runs the journal's step and writes in the same
transaction, so two hosts never lose each other's update; a new record is an
``INSERT … ON CONFLICT DO NOTHING``, and losing that race (``Lost``) re-runs the step on
the row the winner wrote. A claim made in this store's owner session is written only while
that session holds its owner lock: checked by the write statement itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import psycopg

from ..._model.errors import StorageFailed
from ..._model.records import Record
from ..seam import Step
from .connections import Connections, roll_back
from .failures import failure
from .session import OwnerSession
from .statements import Statements

__all__ = ["RETRIES", "Lost", "lock_row", "nothing_written", "vouch_for", "write_row"]

RETRIES: Final = 8  # lost insert races (or a lost owner session) before giving up


class Lost(Exception):
    """The row changed under a step (a lost insert race, or a lost owner session): run the
    step again on what is there now."""


def lock_row(
    connection: psycopg.Connection[Any],
    digest: str,
    statements: Statements,
    connections: Connections,
    where: str,
) -> Any:
    """Begin the write transaction and read the row ``FOR UPDATE`` (None: no row yet).
    ``Lost`` when the connection was one the server ended while it sat idle: nothing was
    sent, so the write may run on another."""
    try:
        connections.start_write(connection)
        return connection.execute(statements.lock, (digest,)).fetchone()
    except psycopg.Error as error:
        roll_back(connection)
        if connection.broken:  # an idle connection the server ended: nothing was sent
            raise Lost from error
        raise failure(
            f"cannot read the record {digest} in {where}, so nothing was written", error
        ) from error


def vouch_for(
    write: Record | None,
    current: Record | None,
    session: OwnerSession | None,
    digest: str,
    where: str,
) -> OwnerSession | None:
    """The owner session whose lock must still be held when ``write`` is written: ours,
    for a claim made in it; None for any other write. A new claim that no live session of
    ours vouches for is never written."""
    if write is None or write.status != "started" or write.owner is None:
        return None
    if session is not None and write.owner.session == session.name:
        return session
    if current is None or current.claim_id != write.claim_id:
        raise StorageFailed(
            f"the claim of the record {digest} in {where} names no live "
            "owner session of this store, so nothing was written"
        )
    return None


def write_row(
    connection: psycopg.Connection[Any],
    statements: Statements,
    digest: str,
    decision: Step[Any],
    data: bytes | None,
    *,
    exists: bool,
    vouch: OwnerSession | None,
) -> bool:
    """Write what the step decided; False when nothing was written because the row was
    created by another session first, or (with ``vouch``) that session's owner lock is
    no longer held."""
    if decision.delete:
        if exists:
            connection.execute(statements.delete, (digest,))
        return True
    assert decision.write is not None
    assert data is not None
    values: tuple[object, ...] = (decision.write.status, decision.write.claim_id, data, digest)
    if vouch is not None:
        values = (*values, vouch.token)
    cursor = connection.execute(statements.write[exists, vouch is not None], values)
    return cursor.rowcount == 1


@contextmanager
def nothing_written(connection: psycopg.Connection[Any], digest: str, where: str) -> Iterator[None]:
    """Around the write statement: any failure rolls the transaction back and says that
    nothing was written; ``Lost`` passes through, to run the step again."""
    try:
        yield
    except Lost:
        raise
    except psycopg.Error as error:
        roll_back(connection)
        raise failure(
            f"cannot write the record {digest} in {where}, so nothing was written", error
        ) from error
    except StorageFailed as error:  # the owner lock could not be checked or taken again
        roll_back(connection)
        failed = StorageFailed(f"{error.message}, so nothing was written", errno=error.errno)
        raise failed from error.__cause__
    except BaseException:
        roll_back(connection)
        raise
