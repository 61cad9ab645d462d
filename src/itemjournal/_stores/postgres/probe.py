"""What open learns of the server before it takes any lock: how the connections reach it
(directly, or through which kind of pooler) and whether its settings let the journal work.

Transaction and statement pooling hand each transaction to any server session, so they
cannot keep the session-level owner lock: the data connections may go through one only
when ``owner_url`` gives the owner-lock session a direct connection, and that one must see
the same server and database. A standby, a read-only role, or a ``statement_timeout``
that would cancel the journal's own statements is refused at open, saying why, rather
than failing at random later.
"""

from __future__ import annotations

from typing import Any, Final

import psycopg
import psycopg.errors

from ..._model.errors import StorageFailed
from .connections import Connections, connect
from .failures import failure
from .location import Location
from .session import OwnerSession, held_anywhere

__all__ = ["check_owner_pooling", "check_owner_reach", "data_pooling"]

# A statement_timeout below this (in milliseconds) cancels the journal's own statements
# under ordinary load: open refuses it rather than fail at random later.
_SHORTEST_STATEMENT_TIMEOUT_MS: Final = 1000
_POOLING_ROUNDS: Final = 3  # rounds of the multiplexing probe at open
# Behind a pooler, other clients may take the session a round looks for in between: a
# multiplexing pooler under load is proven within a few more rounds.
_POOLED_ROUNDS: Final = 8
# What PgBouncer answers a transaction block in statement pooling mode.
_STATEMENT_POOLING: Final = "statement pooling mode"


def data_pooling(location: Location, lock_timeout: float) -> str:
    """How the data connections reach the server (``Connections.pooling``), the server
    checked on the way; refuses transaction pooling unless ``owner_url`` was given."""
    pooling = _probe(location.conninfo, location.shown, lock_timeout, check=True)
    if pooling == "transaction" and not location.owner_url_given:
        raise StorageFailed(
            f"{location.shown} is reached through a pooler in transaction (or "
            "statement) pooling mode, which hands each transaction to any server "
            "session: it cannot keep the session-level lock by which other hosts "
            "tell a live owner from a dead one. Connect through session pooling or "
            "directly, or give the owner-lock session a direct connection with "
            "?owner_url=<percent-encoded postgresql:// URL of the server itself>"
        )
    return pooling


def check_owner_pooling(location: Location, lock_timeout: float) -> None:
    """Refuse an ``owner_url`` that itself goes through transaction pooling."""
    where = f"owner_url of {location.shown}"
    if _probe(location.owner_conninfo, where, lock_timeout, check=False) == "transaction":
        raise StorageFailed(
            f"the owner_url of {location.shown} is reached through a pooler in "
            "transaction (or statement) pooling mode; the owner-lock session needs "
            "a direct connection (or session pooling)"
        )


def check_owner_reach(connections: Connections, session: OwnerSession, where: str) -> None:
    """The owner lock, taken through ``owner_url``, must be seen from the data
    connections: the same server and database (advisory locks are per database)."""
    if not held_anywhere(connections, session.token, where):
        raise StorageFailed(
            f"the owner_url of {where} reaches another server or database than "
            "the journal's own URL: its owner lock cannot be seen from there"
        )


def _probe(conninfo: str, where: str, lock_timeout: float, *, check: bool) -> str:
    """How ``conninfo`` reaches its server: ``direct``, ``session`` or
    ``transaction`` (see ``Connections.pooling``); with ``check``, also refuse a server on
    which the journal cannot write durably or at all.

    A pooler answers libpq's backend pid with a number of its own, so a pid that
    differs from ``pg_backend_pid()`` shows a pooler. Whether it multiplexes: while
    one client connection stays open, another is opened; a server session seen by
    both (PgBouncer hands out the most recently used one), or a first connection
    whose server session changes between two of its own statements, proves that
    sessions are shared, which session pooling never does. Repeated a few rounds (more
    behind a pooler), so that other clients of the pooler taking that session in
    between cannot hide it."""
    first = connect(conninfo, where, lock_timeout)
    try:
        with first:
            seen = {_server_pid(first)}
            pooled = first.info.backend_pid not in seen
            if check:
                _check_server(first, where)
            for _ in range(_POOLED_ROUNDS if pooled else _POOLING_ROUNDS):
                with connect(conninfo, where, lock_timeout) as second:
                    try:
                        # The second's transaction keeps its server session while the
                        # first asks again: the two cannot be handed the same one between.
                        with second.transaction():
                            other = _server_pid(second)
                            if other in seen:
                                return "transaction"
                            seen.add(_server_pid(first))
                    except psycopg.errors.QueryCanceled:
                        raise
                    except psycopg.Error as error:
                        if _STATEMENT_POOLING in str(error):
                            return "transaction"  # it refuses transaction blocks outright
                        raise
                if len(seen) > 1:
                    return "transaction"
    except StorageFailed:
        raise
    except psycopg.errors.QueryCanceled as error:
        # Any statement of the probe may be the one a very short timeout cancels.
        raise _cancelled(where, error) from error
    except psycopg.Error as error:
        raise failure(f"cannot open the journal in {where}", error) from error
    return "session" if pooled else "direct"


def _cancelled(where: str, error: psycopg.Error) -> StorageFailed:
    return failure(
        f"cannot open the journal in {where}: the server cancelled its statement "
        "(statement_timeout is too short for the journal; set it to 0 or "
        f"at least {_SHORTEST_STATEMENT_TIMEOUT_MS} ms for the journal's role or "
        "database, or pass options=-c%20statement_timeout%3D0 in the URL)",
        error,
    )


def _server_pid(connection: psycopg.Connection[Any]) -> int:
    row = connection.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def _check_server(connection: psycopg.Connection[Any], where: str) -> None:
    """Refuse, with the reason, a server whose settings the journal cannot work
    under: a read-only session (a standby, or a role or database made read-only), or
    a ``statement_timeout`` so short that the journal's statements are cancelled."""
    try:
        row = connection.execute(
            "SELECT current_setting('transaction_read_only'), pg_is_in_recovery(), "
            "current_setting('statement_timeout'), "
            "(SELECT setting::bigint FROM pg_settings WHERE name = 'statement_timeout')"
        ).fetchone()
    except psycopg.errors.QueryCanceled as error:
        raise _cancelled(where, error) from error
    assert row is not None
    read_only, standby, shown, milliseconds = row
    if standby:
        raise StorageFailed(
            f"cannot open the journal in {where}: the server is a standby (in "
            "recovery), which takes no writes; connect to the primary"
        )
    if read_only == "on":
        raise StorageFailed(
            f"cannot open the journal in {where}: its sessions are read-only "
            "(default_transaction_read_only is on for this role or database); the "
            "journal writes every claim, so it needs a role that may write"
        )
    if 0 < int(milliseconds) < _SHORTEST_STATEMENT_TIMEOUT_MS:
        raise StorageFailed(
            f"cannot open the journal in {where}: statement_timeout is {shown} for "
            "this role or database, so short that the journal's statements would be "
            f"cancelled; set it to 0 or at least {_SHORTEST_STATEMENT_TIMEOUT_MS} ms "
            "(ALTER ROLE ... SET statement_timeout, or "
            "options=-c%20statement_timeout%3D0 in the URL)"
        )
