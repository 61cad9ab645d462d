"""The owner session: how hosts tell a live owner from a dead one.

Each open store holds a session-level advisory lock, named by a random 63-bit token, on a
connection of its own; the claims it writes name that token (``Owner.session``). A started
record's owner is alive exactly while its lock is held, whichever host it runs on. When a
host dies, PostgreSQL ends its session (the server's TCP keepalives are set on it) and the
lock goes with it. The session turns off the server's session and statement timeouts for
itself: ending it would make a live owner look dead. A store whose lock connection was
lost takes a new token (``OwnerLock.renew``); if it cannot, no claim is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import threading
from typing import Any, Final

import psycopg
from psycopg import sql

from ..._model.errors import StorageFailed
from .connections import Connections, connect
from .failures import failure
from .location import Location

__all__ = ["HELD", "OwnerLock", "OwnerSession", "held_anywhere", "is_held", "token_of"]

_SESSION_PREFIX: Final = "pg:"
# What the server is asked to do on the session that holds the owner lock, so that a
# vanished host's session (and with it its lock) ends within about 5 + 3 * 2 seconds.
_KEEPALIVE: Final = {
    "tcp_keepalives_idle": 5,
    "tcp_keepalives_interval": 2,
    "tcp_keepalives_count": 3,
    "tcp_user_timeout": 11000,
}
# The owner-lock session ignores the server's timeouts: ending it would make a live owner
# look dead. One statement, naming only the settings this server has (14+ for the first).
_PROTECT: Final = (
    "SELECT set_config(name, '0', false) FROM pg_settings WHERE name IN "
    "('idle_session_timeout', 'idle_in_transaction_session_timeout', 'statement_timeout')"
)
# Whether some session holds the owner lock on a token: asking for a shared, transaction
# level lock on it fails exactly while the owner's exclusive session lock stands. (When it
# does not, the asker holds the shared lock until its transaction ends, which blocks
# nobody: no session ever takes that token's exclusive lock again.) One lock-table probe,
# where reading pg_locks would copy the whole lock table.
HELD: Final = "NOT pg_try_advisory_xact_lock_shared(%s)"


def token_of(session: str) -> int | None:
    """The owner-lock token an ``Owner.session`` names, or None: not one of ours."""
    if not session.startswith(_SESSION_PREFIX):
        return None
    try:
        return int(session[len(_SESSION_PREFIX) :], 16)
    except ValueError:
        return None


def ask_held(connection: psycopg.Connection[Any], token: int) -> bool:
    """Whether the owner lock on ``token`` is held, by whichever session."""
    row = connection.execute(f"SELECT {HELD}", (token,)).fetchone()
    return bool(row and row[0])


def is_held(connection: psycopg.Connection[Any], token: int, where: str) -> bool:
    """``ask_held`` on ``connection``, its failure saying what was asked of ``where``."""
    try:
        return ask_held(connection, token)
    except psycopg.Error as error:
        raise failure(f"cannot ask {where} which owners live", error) from error


def held_anywhere(connections: Connections, token: int, where: str) -> bool:
    """``ask_held`` on a pooled connection of its own, in a transaction of its own."""

    def ask(connection: psycopg.Connection[Any]) -> bool:
        held = ask_held(connection, token)
        connection.rollback()
        return held

    try:
        return connections.idempotent(ask)
    except psycopg.Error as error:
        raise failure(f"cannot ask {where} which owners live", error) from error


@dataclasses.dataclass(slots=True)
class OwnerSession:
    """This store's owner lock: its connection, its token and that backend's pid."""

    connection: psycopg.Connection[Any]
    token: int
    pid: int

    @property
    def name(self) -> str:
        return f"{_SESSION_PREFIX}{self.token:016x}"


class OwnerLock:
    """The owner lock one store holds, on a session of its own (``session``: None before
    open, after close, and after a renewal failed)."""

    def __init__(self, location: Location, lock_timeout: float) -> None:
        self._location = location
        self._lock_timeout = lock_timeout
        self._renewing = threading.Lock()
        self.session: OwnerSession | None = None

    def renew(self, lost: OwnerSession | None) -> None:
        """Hold an owner lock on a connection of our own (a new one if ``lost`` is ours)."""
        shown = self._location.shown
        with self._renewing:
            if self.session is not lost:
                return  # another thread renewed it already
            if lost is not None:
                with contextlib.suppress(Exception):
                    lost.connection.close()
                self.session = None
            where = f"owner_url of {shown}" if self._location.owner_url_given else shown
            try:
                connection = connect(self._location.owner_conninfo, where, self._lock_timeout)
            except StorageFailed as error:
                raise StorageFailed(
                    f"the owner session in {shown} is lost and cannot be renewed, "
                    f"so no claim can be made ({error.message})",
                    errno=error.errno,
                ) from error.__cause__
            try:
                connection.execute(_PROTECT)
                for name, value in _KEEPALIVE.items():
                    connection.execute(
                        sql.SQL("SET {} = {}").format(sql.Identifier(name), sql.Literal(str(value)))
                    )
                while True:
                    token = secrets.randbits(63)
                    row = connection.execute(
                        "SELECT pg_try_advisory_lock(%s), pg_backend_pid()", (token,)
                    ).fetchone()
                    assert row is not None
                    if row[0]:
                        break
            except psycopg.Error as error:
                connection.close()
                raise failure(f"cannot take an owner lock in {where}", error) from error
            self.session = OwnerSession(connection, token, int(row[1]))

    def close(self) -> None:
        """Let the lock go: closing its connection ends the session, and the lock with it."""
        with self._renewing:
            session, self.session = self.session, None
        if session is not None:
            with contextlib.suppress(Exception):
                session.connection.close()
