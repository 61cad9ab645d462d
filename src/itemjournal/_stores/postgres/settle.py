"""The commit of a write, and the settling of one whose outcome was lost.

A connection lost while ``COMMIT`` was under way is neither success nor failure. The lost
session is then *fenced*: ended, if it still runs, and waited for, so that its transaction
is settled one way or the other. The row is read afresh on a connection of its own and
compared with what was written: the bytes from before, it did not happen; anything else
but our bytes, or no answer, is ``STORAGE_FAILED`` saying that the outcome is unknown. A
write is never retried blindly.

Our bytes on the primary are not enough: a commit is acknowledged only with the
durability its first try would have had. With synchronous standbys, a commit is written
locally first and then waits for them; ending its session cancels that wait and leaves
it committed on the primary alone, which a failover loses. So a session whose commit
waits for a standby (``wait_event`` ``SyncRep``) is never ended, and our bytes count only
once the standbys the server waits for (``synchronous_standby_names``: the first
``num_sync`` in priority, or any ``num_sync``) report a flush (or, under
``remote_apply``, a replay) position at or past the server's WAL position read after
the session ended, which is past the commit's own record. Positions that cannot be read
(a role without ``pg_read_all_stats``) or that do not get there in time leave the
outcome unknown.

A commit that did answer may have been cut short too: a cancel that reaches a session
while its commit waits for the standbys (``pg_cancel_backend``, a pooler's query
timeout, a blocking caller's interrupt; never ``statement_timeout``, which the server
disarms before it commits) ends the wait, and ``COMMIT`` succeeds with only a warning
(SQLSTATE ``01000``: "canceling wait for synchronous replication", "already committed
locally"). Every commit listens for such a warning (``heard_cut``); one that carried it
counts only once the standbys' positions prove it (``replicated``), else it is
``STORAGE_FAILED`` saying the outcome is unknown. Any warning of that class counts,
whatever its words, since the server may translate them.

The session is named as the server names it (``pg_backend_pid()`` and its
``backend_start``, and behind a transaction pooler the start of the transaction too),
never by libpq's backend pid, which a pooler invents.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from typing import Any, Final, Protocol

import psycopg
from psycopg import sql

from ..._model.errors import StorageFailed
from .connections import Connections, ServerSession, connect, roll_back
from .failures import describe, failure
from .location import Location

__all__ = ["PROOF_WAIT", "Commits", "commit_level", "heard_cut", "replicated", "standbys_have"]


class Tables(Protocol):
    """Of ``schema.Tables``, what a commit reads again: the records table (named so, not
    imported, since ``schema`` proves its own commits here)."""

    @property
    def records(self) -> sql.Identifier: ...


_FENCE_WAIT_MS: Final = 5000
PROOF_WAIT: Final = 5.0
"""Seconds the standbys' positions are awaited before a commit's outcome is unknown."""
# The class of the warning that says a commit's wait for the standbys was cut short.
_WARNING: Final = "01000"
# ``[FIRST | ANY] num_sync ( names )``; a plain list (or ``*``) waits for one standby.
_NUM_SYNC: Final = re.compile(r"\s*(?:(?:first|any)\s+)?(\d+)\s*\(", re.IGNORECASE)
_WAITS_FOR_STANDBY: Final = "the commit is waiting for a synchronous standby"


class Commits:
    """The commits of one store's writes, and how many there were (``commits``), with
    the lost ones a fresh read settled (``unknown_settled``)."""

    def __init__(
        self, connections: Connections, location: Location, tables: Tables, lock_timeout: float
    ) -> None:
        self._connections = connections
        self._location = location
        self._records = tables.records
        self._lock_timeout = lock_timeout
        self.commits = 0  # committed write transactions, for tests and benchmarks
        self.unknown_settled = 0  # commits whose lost outcome a re-read settled

    def commit(
        self,
        connection: psycopg.Connection[Any],
        digest: str,
        before: object,
        data: bytes | None,
    ) -> None:
        """``COMMIT`` the write of ``data`` over ``before``; its outcome settled if the
        answer is lost, and ``STORAGE_FAILED`` unless it was saved."""
        where = self._location.shown
        # Read when the connection or transaction began: after a lost commit, the
        # connection can no longer say which server session it had.
        server = self._connections.server_of(connection)
        try:
            with heard_cut(connection) as cut:
                connection.commit()
        except psycopg.Error as error:
            if not connection.broken and not isinstance(error, psycopg.OperationalError):
                # The server answered: the transaction was rolled back.
                roll_back(connection)
                raise failure(
                    f"the commit of the record {digest} in {where} was refused, so "
                    f"nothing was written",
                    error,
                ) from error
            outcome = self._settle(server, digest, before, data)
            if outcome is True:
                self.commits += 1
                self.unknown_settled += 1
                return
            if outcome is False:
                self.unknown_settled += 1
                raise failure(
                    f"the connection to {where} was lost during the commit of the "
                    f"record {digest}; a fresh read shows it was not saved, so nothing was "
                    f"written",
                    error,
                ) from error
            raise failure(
                f"the connection to {where} was lost during the commit of the "
                f"record {digest}, and whether it was saved is unknown ({outcome})",
                error,
            ) from error
        if cut:
            proof = standbys_have(connection, commit_level(server))
            if proof is not True:
                raise StorageFailed(
                    f"the commit of the record {digest} in {where} stopped waiting for the "
                    f"synchronous standbys ({cut[0]}), so its outcome is unknown: {proof}"
                )
        self.commits += 1

    def _settle(
        self,
        server: ServerSession | None,
        digest: str,
        before: object,
        data: bytes | None,
    ) -> bool | str:
        """After a lost commit: end the server session that ran it (if it still runs),
        then read the row afresh. True: our write is there; False: the row is as it was
        before; otherwise why it cannot be told.

        Behind a transaction pooler the start of our transaction names it too: a pooled
        server session that has gone on to another client's transaction is left alone,
        since ours is over."""
        if server is None:
            return "the session that ran it is not known"
        pid, started, transaction, _ = server
        try:
            # Through owner_url, when given, the fence and the re-read skip the pooler.
            with connect(
                self._location.owner_conninfo, self._location.shown, self._lock_timeout
            ) as fresh:
                deadline = time.monotonic() + _FENCE_WAIT_MS / 1000
                while True:
                    # backend_start tells that session from a later one given the same pid.
                    # One whose commit waits for a standby is left to wait: ending it would
                    # cut that wait short and leave the commit on the primary alone.
                    row = fresh.execute(
                        "SELECT wait_event IS NOT DISTINCT FROM 'SyncRep', CASE WHEN "
                        "wait_event IS DISTINCT FROM 'SyncRep' THEN pg_terminate_backend(pid, %s) "
                        "END FROM pg_stat_activity WHERE pid = %s "
                        "AND (%s::timestamptz IS NULL OR backend_start = %s) "
                        "AND (%s::timestamptz IS NULL OR xact_start = %s)",
                        (_FENCE_WAIT_MS, pid, started, started, transaction, transaction),
                    ).fetchone()
                    if row is None:
                        break  # that session is over: its transaction committed or never will
                    if time.monotonic() > deadline:
                        if row[0]:
                            return _WAITS_FOR_STANDBY
                        return "the session that ran it could not be ended"
                    time.sleep(0.05)
                found = fresh.execute(
                    sql.SQL("SELECT document FROM {} WHERE digest = %s").format(self._records),
                    (digest,),
                ).fetchone()
                # bytes(): psycopg may hand out a memoryview of a bytea.
                now = None if found is None else bytes(found[0])
                if now == data:
                    return replicated(fresh, commit_level(server), time.monotonic() + PROOF_WAIT)
                if now == before:
                    return False
                return "the record has changed since"
        except (psycopg.Error, StorageFailed) as error:
            return f"cannot read it again: {describe(error)}"


def commit_level(server: ServerSession | None) -> str:
    """The ``synchronous_commit`` a commit of ``server``'s session waited for; when the
    session was not read, the strongest, so that no proof is weaker than it needed."""
    return "remote_apply" if server is None else server[3]


@contextlib.contextmanager
def heard_cut(connection: psycopg.Connection[Any]) -> Iterator[list[str]]:
    """Around ``COMMIT``: the warnings (SQLSTATE ``01000``) the server sent meanwhile,
    such as the one that says its wait for the synchronous standbys was cut short and
    the transaction committed on the primary alone."""
    heard: list[str] = []

    def listen(diagnostic: psycopg.errors.Diagnostic) -> None:
        if diagnostic.sqlstate == _WARNING:
            heard.append(diagnostic.message_primary or "a warning")

    connection.add_notice_handler(listen)
    try:
        yield heard
    finally:
        connection.remove_notice_handler(listen)


def standbys_have(connection: psycopg.Connection[Any], level: str) -> bool | str:
    """``replicated`` asked on ``connection``, whose commit just answered (then rolled back)."""
    try:
        return replicated(connection, level, time.monotonic() + PROOF_WAIT)
    except psycopg.Error as error:
        return f"the standbys' positions cannot be read: {describe(error)}"
    finally:
        roll_back(connection)


def replicated(fresh: psycopg.Connection[Any], level: str, deadline: float) -> bool | str:
    """True once the synchronous standbys the server waits for have everything written
    before now (flushed, or under ``remote_apply`` replayed); otherwise why not."""
    row = fresh.execute(
        "SELECT current_setting('synchronous_standby_names'), pg_current_wal_insert_lsn()"
    ).fetchone()
    assert row is not None
    names, target = str(row[0]).strip(), row[1]
    if not names or level in ("off", "local"):
        return True  # the commit waited for no standby: the primary's flush was all
    wanted = _NUM_SYNC.match(names)
    needed = int(wanted.group(1)) if wanted else 1
    position = "replay_lsn" if level == "remote_apply" else "flush_lsn"
    while True:
        # The standbys the server waits for are ``sync`` (first in priority) or
        # ``quorum`` (any of them); a position hidden from this role reads as NULL.
        have = fresh.execute(
            f"SELECT count(*) FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum') "
            f"AND {position} >= %s::pg_lsn",
            (target,),
        ).fetchone()
        if have is not None and int(have[0]) >= needed:
            return True
        if time.monotonic() > deadline:
            return (
                "it is on the primary, but no synchronous standby the server waits for "
                "has confirmed it (their positions need pg_read_all_stats to be read)"
            )
        time.sleep(0.05)
