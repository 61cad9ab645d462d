"""The PostgreSQL store: one journal shared by many hosts.

Layout: a schema (``itemjournal`` unless the location says ``?schema=name``) holding two
tables, ``records`` (one row per identity: its digest, status, claim id and the record
document's exact bytes, as ``bytea``, so that the strict reader sees what was written)
and ``meta`` (the schema version and the journal's settings). A partial index on the open
statuses serves the sweeps and review queues.

Every operation is one worker-thread trip holding one pooled connection
(``psycopg_pool.ConnectionPool``): psycopg's own async connection runs on asyncio only,
and the journal runs on trio too. A transition reads the row ``FOR UPDATE``, runs the
journal's step and writes in the same transaction, so two hosts never lose each other's
update; a new record is an ``INSERT … ON CONFLICT DO NOTHING``, and losing that race re-runs
the step on the row the winner wrote.

**Outcome unknown.** A connection lost while ``COMMIT`` was under way is neither success nor
failure. The store then *fences* the lost session (ends its backend, if it still runs, and
waits for it, so its transaction is settled one way or the other), re-reads the row on a
fresh connection and compares it with what it wrote: the same bytes, the write happened;
the bytes from before, it did not; anything else, or no answer, is ``STORAGE_FAILED``
saying the outcome is unknown. A write is never retried blindly.

**Owners across hosts.** Each open store holds a session-level advisory lock, named by a
random 63-bit token, on a connection of its own; the claims it writes name that token
(``Owner.session``). A started record's owner is alive exactly while its lock is held (a
shared try-lock on the token fails), whichever host it runs on. When a host dies,
PostgreSQL ends its session (the store sets the server's TCP keepalives on it) and the
lock goes with it. A store
whose lock connection was lost takes a new token before its next claim (if it cannot, the
claim is refused: none is written without a live owner session); its earlier claims are
then taken as gone by the others (and marked for review, never run again). The owner
session turns off the server's session and statement timeouts for itself.

**Poolers.** Open finds how the data connections reach the server (``pooling``): directly,
through session pooling (supported), or through transaction or statement pooling, which
hands each transaction to any server session and so cannot keep a session lock: refused,
unless ``owner_url`` names a direct connection for the owner lock alone. Behind such a
pooler, each write transaction sets its own lock wait and synchronous commit and reads the
server's name of its session, and no statement is prepared.

**Durability.** Every write commits with at least ``synchronous_commit = on``, whatever the
server, database or role says (``remote_apply`` is kept).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import re
import secrets
import threading
import time
import urllib.parse
import weakref
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, Final, TypeVar

import anyio
import anyio.to_thread
import psycopg
import psycopg.errors
import psycopg_pool
from psycopg import sql

from ..._model.codec import decode_row, encode_record
from ..._model.errors import InvalidArgument, RecordInvalid, StorageFailed
from ..._model.identity import Identity, identity_digest
from ..._model.records import STATUSES, Owner, Record
from ..owners import current_owner, gone_reason, owner_alive
from ..registry import redact
from ..seam import Step, StepFunction, Tally
from ..threads import Trips

__all__ = ["PostgresStore", "missing_journal"]

T = TypeVar("T")

SCHEMA_VERSION: Final = "2"
# Versions an open brings up to this one (under the schema lock, in one transaction).
_MIGRATES: Final = ("1",)
_KIND: Final = "itemjournal"
_OPEN_STATUSES: Final = ("started", "needs_review")
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")
# A constant first key for the lock that serialises creating the schema (any 32-bit
# value; this one spells "ijnl").
_CREATE_LOCK: Final = 0x696A6E6C
_SESSION_PREFIX: Final = "pg:"
# What the server is asked to do on the session that holds the owner lock, so that a
# vanished host's session (and with it its lock) ends within about 5 + 3 * 2 seconds.
_KEEPALIVE: Final = {
    "tcp_keepalives_idle": 5,
    "tcp_keepalives_interval": 2,
    "tcp_keepalives_count": 3,
    "tcp_user_timeout": 11000,
}
_FENCE_WAIT_MS: Final = 5000
_OUR_PARAMETERS: Final = ("schema", "pool_size", "owner_url")
# The owner-lock session ignores the server's timeouts: ending it would make a live owner
# look dead. One statement, naming only the settings this server has (14+ for the first).
_PROTECT: Final = (
    "SELECT set_config(name, '0', false) FROM pg_settings WHERE name IN "
    "('idle_session_timeout', 'idle_in_transaction_session_timeout', 'statement_timeout')"
)
# Every write commits synchronously: at least ``on`` (the WAL flushed before COMMIT
# returns), keeping ``remote_apply`` where the server or role asks for it. From the
# weakest: off < local < remote_write < on < remote_apply.
_DURABLE: Final = (
    "CASE WHEN current_setting('synchronous_commit') IN ('off', 'local', 'remote_write') "
    "THEN 'on' ELSE current_setting('synchronous_commit') END"
)
# The server's own name for the session running this statement (libpq's backend pid is
# the pooler's invention behind one) and, for a transaction, when it began.
_SERVER_ID: Final = (
    "pg_backend_pid(), (SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()), "
    "now()"
)
# A statement_timeout below this (in milliseconds) cancels the journal's own statements
# under ordinary load: open refuses it rather than fail at random later.
_SHORTEST_STATEMENT_TIMEOUT_MS: Final = 1000
_POOLING_ROUNDS: Final = 3  # rounds of the multiplexing probe at open
_RETRIES: Final = 8  # lost insert races (or a lost owner session) before giving up


def _describe(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _failure(what: str, error: BaseException) -> StorageFailed:
    """``STORAGE_FAILED`` saying ``what``; a wait that ran out of time is ``ETIMEDOUT``."""
    timed_out = isinstance(error, psycopg.errors.LockNotAvailable | psycopg_pool.PoolTimeout)
    failure = StorageFailed(
        f"{what}: {_describe(error)}", errno=errno.ETIMEDOUT if timed_out else None
    )
    failure.__cause__ = error
    return failure


def _split_query(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without the store's own parameters, every other byte of it as given (libpq
    decodes the rest itself), and the store's parameters, percent-decoded."""
    parts = urllib.parse.urlsplit(url)
    kept: list[str] = []
    ours: dict[str, str] = {}
    for piece in parts.query.split("&") if parts.query else ():
        if not piece:
            continue
        raw_name, _, raw_value = piece.partition("=")
        name = urllib.parse.unquote(raw_name)
        if name in _OUR_PARAMETERS:
            ours[name] = urllib.parse.unquote(raw_value)
        else:
            kept.append(piece)
    return urllib.parse.urlunsplit(parts._replace(query="&".join(kept))), ours


def _token_of(session: str) -> int | None:
    if not session.startswith(_SESSION_PREFIX):
        return None
    try:
        return int(session[len(_SESSION_PREFIX) :], 16)
    except ValueError:
        return None


# Whether some session holds the owner lock on a token: asking for a shared, transaction
# level lock on it fails exactly while the owner's exclusive session lock stands. (When it
# does not, the asker holds the shared lock until its transaction ends, which blocks
# nobody: no session ever takes that token's exclusive lock again.) One lock-table probe,
# where reading pg_locks would copy the whole lock table.
_HELD: Final = "NOT pg_try_advisory_xact_lock_shared(%s)"


def _text(query: sql.SQL, *parts: sql.Composable) -> str:
    """``query`` with ``parts`` in its ``{}``, as the text sent to the server."""
    return query.format(*parts).as_string(None)


@dataclasses.dataclass(slots=True)
class _Session:
    """This store's owner lock: its connection, its token and that backend's pid."""

    connection: psycopg.Connection[Any]
    token: int
    pid: int

    @property
    def name(self) -> str:
        return f"{_SESSION_PREFIX}{self.token:016x}"


class _Call:
    """One operation's worker trip, as its caller's cancellation sees it: while the trip
    waits (for a row lock, a connection, the server), a cancel interrupts the statement
    under way; once the commit has begun, nothing interrupts it."""

    __slots__ = ("cancelled", "committing", "connection", "done", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.connection: psycopg.Connection[Any] | None = None
        self.cancelled = False
        self.committing = False
        self.done = threading.Event()

    def cancel(self) -> None:
        """On the event loop: the caller is gone. Interrupt what runs, from a thread of its
        own (asking the server to cancel means connecting to it)."""
        with self.lock:
            if self.cancelled:
                return
            self.cancelled = True
        threading.Thread(target=self._interrupt, daemon=True).start()

    def _interrupt(self) -> None:
        # A cancel request that reaches the server between two statements is lost, so it
        # is repeated until the trip ends or its commit begins.
        while not self.done.is_set():
            with self.lock:
                connection = None if self.committing else self.connection
            if connection is not None:
                with contextlib.suppress(Exception):
                    connection.cancel_safe(timeout=5.0)
            self.done.wait(0.02)

    def use(self, connection: psycopg.Connection[Any] | None) -> None:
        """The trip holds ``connection`` now (None: none); raises if the caller is gone."""
        with self.lock:
            self.connection = connection
            if connection is not None and self.cancelled:
                raise StorageFailed("the call was cancelled before it began; nothing was written")

    def may_commit(self) -> bool:
        """Called just before ``COMMIT``: False when the caller is gone (then roll back)."""
        with self.lock:
            self.committing = not self.cancelled
            return self.committing


class _Lost(Exception):
    """The row changed under a step (a lost insert race, or a lost owner session): run the
    step again on what is there now."""


class PostgresStore:
    """Record documents in a PostgreSQL database, shared by every host that opens it.

    ``location`` is a ``postgresql://`` (or ``postgres://``) URL as libpq takes it, its
    parameters passed on exactly as written; three are the store's own and are not passed
    on: ``schema`` (where the tables live, ``itemjournal`` by default), ``pool_size``
    (connections per open store, 8 by default, plus one that holds the owner lock) and
    ``owner_url`` (a percent-encoded ``postgresql://`` URL for the owner-lock session
    alone, for data connections through a transaction pooler). ``lock_timeout`` bounds, in
    seconds, the wait for a pooled connection, for connecting, and for a row another
    session has locked. No secret of the URL appears in ``location``, ``repr`` or errors.
    """

    def __init__(
        self,
        url: str,
        *,
        lock_timeout: float = 30.0,
        trust_shared_root: bool = False,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("postgresql://", "postgres://")):
            raise InvalidArgument(
                "a PostgreSQL location is a postgresql://user@host/database URL",
                code="ABSOLUTE_ROOT_REQUIRED",
            )
        conninfo, ours = _split_query(url)
        owner_url = ours.get("owner_url")
        if owner_url is not None:
            if not owner_url.startswith(("postgresql://", "postgres://")):
                raise InvalidArgument(
                    "owner_url is a percent-encoded postgresql://user@host/database URL, "
                    f"not {redact(owner_url)!r}",
                    code="INVALID_ARGUMENT",
                )
            owner_conninfo, nested = _split_query(owner_url)
            if nested:
                raise InvalidArgument(
                    f"owner_url names the server of the owner-lock session only; "
                    f"{', '.join(sorted(nested))} belong to the journal's own URL",
                    code="INVALID_ARGUMENT",
                )
        schema = ours.get("schema", "itemjournal")
        if _IDENTIFIER.fullmatch(schema) is None:
            raise InvalidArgument(
                f"schema is a lowercase SQL identifier (letters, digits, _), not {schema!r}",
                code="INVALID_ARGUMENT",
            )
        size_text = ours.get("pool_size", "8")
        if not size_text.isdigit() or not 1 <= int(size_text) <= 100:
            raise InvalidArgument(
                f"pool_size is a whole number from 1 to 100, not {size_text!r}",
                code="INVALID_ARGUMENT",
            )
        self._conninfo = conninfo
        # The owner lock's session: on a connection of its own, direct when owner_url
        # says where (the data connections may then go through a transaction pooler).
        self._owner_conninfo = conninfo if owner_url is None else owner_conninfo
        self.owner_url_given = owner_url is not None
        # How the data connections reach the server, found by open: "direct", "session"
        # (a pooler that keeps one server session per client) or "transaction" (one that
        # hands a client's transactions to any server session: transaction or statement
        # pooling); "" before open.
        self.pooling = ""
        self.location = redact(url)
        self.schema = schema
        self.pool_size = int(size_text)
        self.lock_timeout = lock_timeout
        self.trust_shared_root = trust_shared_root  # a database is shared by design
        self.commits = 0  # committed write transactions, for tests and benchmarks
        self.unknown_settled = 0  # commits whose lost outcome a re-read settled
        self._records = sql.Identifier(schema, "records")
        self._meta = sql.Identifier(schema, "meta")
        self._doc_status = sql.Identifier(schema, "doc_status")
        self._suspect = sql.SQL("{}(document) IS DISTINCT FROM status").format(self._doc_status)
        # The statements of every operation, composed once (composing them per call cost
        # more than a third of the store's own time per cycle).
        records = self._records
        self._q_row = _text(sql.SQL("SELECT status, document FROM {} WHERE digest = %s"), records)
        self._q_lock = _text(
            sql.SQL("SELECT status, document FROM {} WHERE digest = %s FOR UPDATE"), records
        )
        self._q_delete = _text(sql.SQL("DELETE FROM {} WHERE digest = %s"), records)
        self._q_write: dict[tuple[bool, bool], str] = {}
        for vouched in (False, True):
            held = sql.SQL(f" AND {_HELD}" if vouched else "")
            self._q_write[True, vouched] = _text(
                sql.SQL(
                    "UPDATE {} SET status = %s, claim_id = %s, document = %s, "
                    "written_at = clock_timestamp() WHERE digest = %s{}"
                ),
                records,
                held,
            )
            self._q_write[False, vouched] = _text(
                sql.SQL(
                    "INSERT INTO {} (status, claim_id, document, digest, written_at) "
                    "SELECT %s, %s, %s, %s, clock_timestamp() WHERE TRUE{} "
                    "ON CONFLICT (digest) DO NOTHING"
                ),
                records,
                held,
            )
        self._q_page = {status: self._page_query(status) for status in (None, *STATUSES)}
        # One statement, so one snapshot: the rows per status column (the table keeps the
        # column one of the statuses), then every suspect row, to be read strictly.
        self._q_tally = _text(
            sql.SQL(
                "SELECT status, count(*), NULL::text, NULL::bytea FROM {0} GROUP BY status "
                "UNION ALL SELECT status, NULL::bigint, digest, document FROM {0} WHERE {1}"
            ),
            records,
            self._suspect,
        )
        self._pool: psycopg_pool.ConnectionPool[Any] | None = None
        self._session: _Session | None = None
        self._session_lock = threading.Lock()
        self._local = threading.local()  # the connection of the running step, if any
        # The server's own name of the session behind each pooled connection: its pid,
        # when it started, and when the transaction under way began (read through SQL at
        # connect, or at each write's start behind a transaction pooler).
        self._server: weakref.WeakKeyDictionary[
            psycopg.Connection[Any], tuple[int, object, object]
        ] = weakref.WeakKeyDictionary()
        self._trips = Trips(self)

    @classmethod
    def from_location(
        cls, location: str, *, lock_timeout: float, trust_shared_root: bool
    ) -> PostgresStore:
        """The store for ``Journal.open``'s location, a ``postgresql://`` URL."""
        scheme, _, rest = location.partition("://")
        return cls(
            f"{scheme.lower()}://{rest}",
            lock_timeout=lock_timeout,
            trust_shared_root=trust_shared_root,
        )

    def __repr__(self) -> str:
        return f"PostgresStore({self.location!r})"

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        await self._trips.run(self._open_sync)

    def _open_sync(self) -> None:
        if self._pool is not None:
            return
        current_owner()  # named now: a process short of descriptors later still names itself
        try:
            # The data path first, on connections of its own: a server that cannot be
            # reached, a transaction pooler, a setting the journal cannot live with, each
            # is reported at once and says why, before any lock is taken anywhere.
            self.pooling = self._probe(self._conninfo, self.location, check=True)
            if self.pooling == "transaction" and not self.owner_url_given:
                raise StorageFailed(
                    f"{self.location} is reached through a pooler in transaction (or "
                    "statement) pooling mode, which hands each transaction to any server "
                    "session: it cannot keep the session-level lock by which other hosts "
                    "tell a live owner from a dead one. Connect through session pooling or "
                    "directly, or give the owner-lock session a direct connection with "
                    "?owner_url=<percent-encoded postgresql:// URL of the server itself>"
                )
            if (
                self.owner_url_given
                and self._probe(self._owner_conninfo, f"owner_url of {self.location}", check=False)
                == "transaction"
            ):
                raise StorageFailed(
                    f"the owner_url of {self.location} is reached through a pooler in "
                    "transaction (or statement) pooling mode; the owner-lock session needs "
                    "a direct connection (or session pooling)"
                )
            self._renew_session(None)
            self._open_pool()
            if self.owner_url_given:
                self._check_owner_reach()
        except BaseException:
            self._close_sync()
            raise

    def _connect(self, conninfo: str, where: str) -> psycopg.Connection[Any]:
        """A connection of its own (autocommit, no prepared statements), or
        ``STORAGE_FAILED`` saying why there is none."""
        try:
            return psycopg.connect(
                conninfo,
                autocommit=True,
                prepare_threshold=None,
                connect_timeout=max(1, round(self.lock_timeout)),
            )
        except psycopg.Error as error:
            raise _failure(f"cannot connect to {where}", error) from error

    def _probe(self, conninfo: str, where: str, *, check: bool) -> str:
        """How ``conninfo`` reaches its server: ``direct``, ``session`` or
        ``transaction`` (see ``pooling``); with ``check``, also refuse a server on which
        the journal cannot write durably or at all.

        A pooler answers libpq's backend pid with a number of its own, so a pid that
        differs from ``pg_backend_pid()`` shows a pooler. Whether it multiplexes: while
        one client connection stays open, another is opened; a server session seen by
        both (PgBouncer hands out the most recently used one), or a first connection
        whose server session changes between two of its own statements, proves that
        sessions are shared, which session pooling never does. Repeated a few rounds,
        so that other clients of the pooler taking that session in between cannot hide
        it."""
        first = self._connect(conninfo, where)
        try:
            with first:
                seen = {self._server_pid(first)}
                pooled = first.info.backend_pid not in seen
                if check:
                    self._check_server(first, where)
                for _ in range(_POOLING_ROUNDS):
                    with self._connect(conninfo, where) as second:
                        other = self._server_pid(second)
                    mine = self._server_pid(first)
                    seen.add(mine)
                    if other in seen or len(seen) > 1:
                        return "transaction"
        except StorageFailed:
            raise
        except psycopg.Error as error:
            raise _failure(f"cannot open the journal in {where}", error) from error
        return "session" if pooled else "direct"

    @staticmethod
    def _server_pid(connection: psycopg.Connection[Any]) -> int:
        row = connection.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        return int(row[0])

    def _check_server(self, connection: psycopg.Connection[Any], where: str) -> None:
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
            raise _failure(
                f"cannot open the journal in {where}: the server cancelled its first "
                "statement (statement_timeout is too short for the journal; set it to 0 or "
                f"at least {_SHORTEST_STATEMENT_TIMEOUT_MS} ms for the journal's role or "
                "database, or pass options=-c%20statement_timeout%3D0 in the URL)",
                error,
            ) from error
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

    def _check_owner_reach(self) -> None:
        """The owner lock, taken through ``owner_url``, must be seen from the data
        connections: the same server and database (advisory locks are per database)."""
        session = self._session
        assert session is not None

        def ask(connection: psycopg.Connection[Any]) -> bool:
            held = self._ask_held(connection, session.token)
            connection.rollback()
            return held

        try:
            seen = self._idempotent(ask)
        except psycopg.Error as error:
            raise _failure(f"cannot ask {self.location} which owners live", error) from error
        if not seen:
            raise StorageFailed(
                f"the owner_url of {self.location} reaches another server or database than "
                "the journal's own URL: its owner lock cannot be seen from there"
            )

    def _open_pool(self) -> None:
        kwargs: dict[str, Any] = {
            "autocommit": False,
            "connect_timeout": max(1, round(self.lock_timeout)),
        }
        if self.pooling == "transaction":
            kwargs["prepare_threshold"] = None  # a prepared statement lives in one session
        pool: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
            self._conninfo,
            min_size=1,
            max_size=self.pool_size,
            open=False,
            timeout=self.lock_timeout,
            kwargs=kwargs,
            configure=self._configure,
            name=f"itemjournal-{secrets.token_hex(4)}",
        )
        try:
            pool.open(wait=True, timeout=self.lock_timeout)
        except psycopg_pool.PoolTimeout as error:
            pool.close(timeout=0)
            raise _failure(f"cannot connect to {self.location}", error) from error
        self._pool = pool
        with self._connection() as connection:
            self._prepare(connection)

    def _configure(self, connection: psycopg.Connection[Any]) -> None:
        if self.pooling == "transaction":
            # Session settings would land on whichever server session ran the SET: each
            # write transaction makes its own (``_start_write``).
            return
        # Rows another session holds are waited for at most lock_timeout; every commit
        # is synchronous; and the server's own name for this session, for fencing.
        row = connection.execute(
            f"SELECT set_config('lock_timeout', %s, false), "
            f"set_config('synchronous_commit', {_DURABLE}, false), {_SERVER_ID}",
            (self._lock_timeout_ms(),),
        ).fetchone()
        assert row is not None
        self._server[connection] = (int(row[2]), row[3], None)
        connection.commit()

    def _lock_timeout_ms(self) -> str:
        return str(max(1, round(self.lock_timeout * 1000)))

    def _start_write(self, connection: psycopg.Connection[Any]) -> None:
        """Behind a transaction pooler, the first statement of a write transaction: its
        lock wait and synchronous commit (for this transaction only, on whichever server
        session runs it) and that session's name for fencing."""
        if self.pooling != "transaction":
            return
        row = connection.execute(
            f"SELECT set_config('lock_timeout', %s, true), "
            f"set_config('synchronous_commit', {_DURABLE}, true), {_SERVER_ID}",
            (self._lock_timeout_ms(),),
        ).fetchone()
        assert row is not None
        self._server[connection] = (int(row[2]), row[3], row[4])

    def _prepare(self, connection: psycopg.Connection[Any]) -> None:
        """Create the schema and tables, or check the ones there, in one transaction that
        holds a lock, so that first openers on many hosts never trip over each other."""
        schema = sql.Identifier(self.schema)
        try:
            self._start_write(connection)
            connection.execute(
                "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_CREATE_LOCK, self.schema)
            )
            exists = connection.execute(
                "SELECT to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL",
                (f"{self.schema}.records", f"{self.schema}.meta"),
            ).fetchone()
            assert exists is not None
            if exists == (False, False):
                self._create(connection, schema)
            elif not all(exists):
                raise StorageFailed(
                    f"{self.location} (schema {self.schema}) holds tables that itemjournal "
                    "did not make; choose another schema with ?schema=name"
                )
            if self._check_meta(connection, migrate=True) in _MIGRATES:
                self._migrate(connection)
            connection.commit()
        except psycopg.Error as error:
            self._roll_back(connection)
            raise _failure(f"cannot prepare the journal in {self.location}", error) from error
        except BaseException:
            self._roll_back(connection)
            raise

    def _create(self, connection: psycopg.Connection[Any], schema: sql.Identifier) -> None:
        statuses = sql.SQL(", ").join(sql.Literal(status) for status in STATUSES)
        open_statuses = sql.SQL(", ").join(sql.Literal(status) for status in _OPEN_STATUSES)
        for statement in (
            sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(schema),
            sql.SQL(
                'CREATE TABLE {} (digest text COLLATE "C" PRIMARY KEY '
                "CHECK (digest ~ '^[0-9a-f]{{64}}$'), "
                "status text NOT NULL CHECK (status IN ({})), "
                "claim_id text NOT NULL, document bytea NOT NULL, "
                "written_at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(self._records, statuses),
            sql.SQL("CREATE INDEX {} ON {} (status, digest) WHERE status IN ({})").format(
                sql.Identifier("records_open"), self._records, open_statuses
            ),
            # The status a document names, or NULL when it is not JSON naming one: rows
            # whose document disagrees with their status column are suspects, found by
            # every status scan through an index that is empty while all is well.
            sql.SQL(
                "CREATE FUNCTION {}(document bytea) RETURNS text LANGUAGE plpgsql "
                "IMMUTABLE PARALLEL SAFE AS $$ BEGIN "
                "RETURN convert_from(document, 'UTF8')::jsonb ->> 'status'; "
                "EXCEPTION WHEN others THEN RETURN NULL; END $$"
            ).format(self._doc_status),
            sql.SQL("CREATE INDEX {} ON {} (digest) WHERE {}").format(
                sql.Identifier("records_suspect"), self._records, self._suspect
            ),
            sql.SQL("CREATE TABLE {} (key text PRIMARY KEY, value text NOT NULL)").format(
                self._meta
            ),
            sql.SQL(
                "INSERT INTO {} (key, value) VALUES ('kind', {}), ('schema_version', {})"
            ).format(self._meta, sql.Literal(_KIND), sql.Literal(SCHEMA_VERSION)),
        ):
            connection.execute(statement)

    def _migrate(self, connection: psycopg.Connection[Any]) -> None:
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
            sql.SQL(
                "ALTER TABLE {} ADD COLUMN written_at timestamptz NOT NULL DEFAULT now()"
            ).format(self._records),
            sql.SQL("ALTER TABLE {} ALTER COLUMN written_at SET DEFAULT clock_timestamp()").format(
                self._records
            ),
            sql.SQL("UPDATE {} SET value = {} WHERE key = 'schema_version'").format(
                self._meta, sql.Literal(SCHEMA_VERSION)
            ),
        ):
            connection.execute(statement)

    def _check_meta(self, connection: psycopg.Connection[Any], *, migrate: bool = False) -> str:
        """The schema's version; refuses a schema not ours, or a version this code does
        not read (with ``migrate``, one it can bring up to date is let through)."""
        try:
            rows = dict(
                connection.execute(
                    sql.SQL(
                        "SELECT key::text, value::text FROM {} "
                        "WHERE key::text IN ('kind', 'schema_version')"
                    ).format(self._meta)
                ).fetchall()
            )
        except psycopg.errors.UndefinedColumn:
            rows = {}  # a meta table without our columns: someone else's
        if rows.get("kind") != _KIND:
            raise StorageFailed(
                f"{self.location} (schema {self.schema}) was not made by itemjournal"
            )
        version = rows.get("schema_version")
        if version != SCHEMA_VERSION and not (migrate and version in _MIGRATES):
            raise StorageFailed(
                f"{self.location} (schema {self.schema}) has journal schema version "
                f"{version!r}; this itemjournal reads version {SCHEMA_VERSION}"
            )
        return str(version)

    async def check(self) -> list[str]:
        return await self._trips.run(self._check_sync)

    def _check_sync(self) -> list[str]:
        def check(connection: psycopg.Connection[Any]) -> None:
            self._check_meta(connection)
            connection.rollback()

        try:
            self._idempotent(check)
        except StorageFailed as error:
            return [str(error)]
        except psycopg.Error as error:
            return [str(_failure(f"cannot check {self.location}", error))]
        return []

    async def aclose(self) -> None:
        await self._trips.close()
        await anyio.to_thread.run_sync(self._close_sync)

    def _close_sync(self) -> None:
        pool, self._pool = self._pool, None
        with self._session_lock:
            session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(Exception):
                session.connection.close()  # ends the session: its owner lock goes with it
        if pool is not None:
            pool.close(timeout=self.lock_timeout)

    # ------------------------------------------------------------------ owners

    def owner(self) -> Owner:
        """This process, in the session that holds our owner lock now. A session lost
        earlier (its renewal failed) is renewed here first; if it cannot be, this raises
        ``STORAGE_FAILED``, and no claim is made without a live owner session."""
        session = self._session
        if session is None:
            self._renew_session(None)
            session = self._session
            assert session is not None
        return dataclasses.replace(current_owner(), session=session.name)

    def gone_reason(self, owner: Owner | None) -> str:
        """The review reason for a started record whose ``owner`` was judged gone: its
        database session ended, or (an owner without one, judged as on one host) its
        process."""
        if owner is not None and _token_of(owner.session) is not None:
            return "owner session gone"
        return gone_reason(owner)

    def owner_alive(self, owner: Owner | None) -> bool | None:
        """Whether the session that made ``owner``'s claim still holds its lock, on any host.

        An owner without a session (a record copied from another store) is judged as
        the stores of one host judge it."""
        if owner is None:
            return None
        token = _token_of(owner.session)
        if token is None:
            return owner_alive(owner)
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            return self._held(connection, token)

        def ask(borrowed: psycopg.Connection[Any]) -> bool:
            held = self._ask_held(borrowed, token)
            borrowed.rollback()
            return held

        try:
            return self._idempotent(ask)
        except psycopg.Error as error:
            raise _failure(f"cannot ask {self.location} which owners live", error) from error

    def _held(self, connection: psycopg.Connection[Any], token: int) -> bool:
        try:
            return self._ask_held(connection, token)
        except psycopg.Error as error:
            raise _failure(f"cannot ask {self.location} which owners live", error) from error

    @staticmethod
    def _ask_held(connection: psycopg.Connection[Any], token: int) -> bool:
        """Whether the owner lock on ``token`` is held, by whichever session."""
        row = connection.execute(f"SELECT {_HELD}", (token,)).fetchone()
        return bool(row and row[0])

    def _renew_session(self, lost: _Session | None) -> None:
        """Hold an owner lock on a connection of our own (a new one if ``lost`` is ours)."""
        with self._session_lock:
            if self._session is not lost:
                return  # another thread renewed it already
            if lost is not None:
                with contextlib.suppress(Exception):
                    lost.connection.close()
                self._session = None
            where = f"owner_url of {self.location}" if self.owner_url_given else self.location
            try:
                connection = self._connect(self._owner_conninfo, where)
            except StorageFailed as error:
                raise StorageFailed(
                    f"the owner session in {self.location} is lost and cannot be renewed, "
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
                raise _failure(f"cannot take an owner lock in {where}", error) from error
            self._session = _Session(connection, token, int(row[1]))

    # ------------------------------------------------------------------ connections

    @contextlib.contextmanager
    def _connection(self, call: _Call | None = None) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection for this trip, rolled back and given back after it. Waits
        for one at most ``lock_timeout``, and (for a ``call``) until its caller is gone."""
        pool = self._pool
        if pool is None or self._trips.closed:
            raise StorageFailed(f"{self!r} is closed")
        deadline = time.monotonic() + self.lock_timeout
        try:
            while True:
                remaining = deadline - time.monotonic()
                try:
                    connection = pool.getconn(
                        timeout=max(0.001, remaining if call is None else min(remaining, 0.05))
                    )
                    break
                except psycopg_pool.PoolTimeout:
                    if time.monotonic() >= deadline:
                        raise
                    if call is not None and call.cancelled:
                        raise StorageFailed(
                            "the call was cancelled while it waited for a connection"
                        ) from None
        except psycopg_pool.PoolTimeout as error:
            raise _failure(
                f"no connection to {self.location} became free within {self.lock_timeout:g} s "
                f"(pool_size={self.pool_size})",
                error,
            ) from error
        except psycopg_pool.PoolClosed as error:
            raise _failure(f"{self!r} is closed", error) from error
        try:
            yield connection
        finally:
            if connection.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                self._roll_back(connection)
            pool.putconn(connection)

    @staticmethod
    def _roll_back(connection: psycopg.Connection[Any]) -> None:
        with contextlib.suppress(Exception):
            connection.rollback()

    # ------------------------------------------------------------------ reading

    def _decode(self, digest: object, status: object, document: object) -> Record:
        """The row's record, strictly read; its status column must agree."""
        return decode_row(document, str(digest), status, location=f"{self.location}#{digest}")

    def _row_record(self, digest: str, row: Any) -> Record | None:
        return None if row is None else self._decode(digest, row[0], _bytes(row[1]))

    async def peek(self, identity: Identity, view: Callable[[Record | None], T]) -> T:
        return await self._trips.run(self._peek_sync, identity, view)

    def _peek_sync(self, identity: Identity, view: Callable[[Record | None], T]) -> T:
        digest = identity_digest(identity)
        query = self._q_row

        def read(connection: psycopg.Connection[Any]) -> T:
            row = connection.execute(query, (digest,)).fetchone()
            record = self._row_record(digest, row)
            self._local.connection = connection
            try:
                return view(record)
            finally:
                self._local.connection = None

        try:
            return self._idempotent(read)
        except psycopg.Error as error:
            raise _failure(f"cannot read {self.location}", error) from error

    def _idempotent(self, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run ``work`` (which reads, or writes only what may be written twice) on a pooled
        connection. A connection the server dropped while it sat idle in the pool fails
        at its first statement: then ``work`` runs again, on another connection (after a
        server restart every idle connection is such a one, so up to the pool's size)."""
        for attempt in range(self.pool_size + 1):
            with self._connection() as connection:
                try:
                    return work(connection)
                except psycopg.OperationalError:
                    if attempt == self.pool_size or not connection.broken:
                        raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def scan(
        self, *, status: str | None = None, after: str | None = None, batch: int = 256
    ) -> AsyncGenerator[Record | RecordInvalid | StorageFailed, None]:
        """Every row in digest order (after ``after``), a page per worker trip; see
        ``Store.scan``.

        A status scan reads the rows whose status column holds that status (the open
        statuses through their index); the column is checked against the document on
        every read, and a table constraint keeps it one of the statuses.
        """
        if status is not None and status not in STATUSES:
            raise InvalidArgument(f"no such status: {status!r}", code="INVALID_ARGUMENT")
        bound = "" if after is None else after
        while True:
            page, last = await self._trips.run(self._page_sync, bound, batch, status)
            for item in page:
                yield item
            if last is None:
                return
            bound = last

    async def tally(self) -> Tally:
        """The rows per status column, then the suspect rows (whose document does not name
        their column's status) each read strictly; one statement, one snapshot.

        Not exact (``Tally.exact`` is False): a row whose document names its column's
        status but is damaged elsewhere is counted under that status; only a full scan
        (``Journal.counts``) reads every row strictly.
        """
        return Tally(await self._trips.run(self._tally_sync), exact=False)

    def _tally_sync(self) -> dict[str, int]:
        def read(connection: psycopg.Connection[Any]) -> list[Any]:
            found = connection.execute(self._q_tally).fetchall()
            connection.rollback()
            return found

        try:
            rows = self._idempotent(read)
        except psycopg.Error as error:
            raise _failure(f"cannot count the records in {self.location}", error) from error
        counted = dict.fromkeys((*STATUSES, "invalid"), 0)
        for column, number, digest, document in rows:
            if number is not None:
                counted[column] = counted.get(column, 0) + number
                continue
            counted[column] -= 1
            try:
                counted[self._decode(digest, column, _bytes(document)).status] += 1
            except RecordInvalid:
                counted["invalid"] += 1
        return counted

    async def ages(self, identities: Sequence[Identity]) -> list[timedelta | None]:
        """For each identity, how long ago its record was last written by the store's own clock
        (here: the server's), in one read; None where the store has no such witness or no record.

        The server stamps ``written_at`` with its own clock on every write; the age is
        its ``now()`` minus that, never below zero (a server clock stepped back makes a
        record young, never old). A row older than the column carries the time of the
        migration that added it (see ``_migrate``)."""
        digests = [identity_digest(identity) for identity in identities]
        return await self._trips.run(self._ages_sync, digests)

    def _ages_sync(self, digests: list[str]) -> list[timedelta | None]:
        if not digests:
            return []
        query = _text(
            sql.SQL(
                "SELECT digest, greatest(now() - written_at, interval '0') FROM {} "
                "WHERE digest = ANY(%s)"
            ),
            self._records,
        )

        def read(connection: psycopg.Connection[Any]) -> dict[str, timedelta]:
            found = {str(digest): age for digest, age in connection.execute(query, (digests,))}
            connection.rollback()
            return found

        try:
            ages = self._idempotent(read)
        except psycopg.Error as error:
            raise _failure(f"cannot read the ages of records in {self.location}", error) from error
        return [ages.get(digest) for digest in digests]

    def _page_query(self, status: str | None) -> str:
        condition: sql.Composable = sql.SQL("")
        if status is not None:
            wanted: sql.Composable = sql.SQL("status = {}").format(sql.Literal(status))
            if status in _OPEN_STATUSES:  # lets the planner see that the partial index holds
                wanted += sql.SQL(" AND status IN ({})").format(
                    sql.SQL(", ").join(sql.Literal(s) for s in _OPEN_STATUSES)
                )
            condition = sql.SQL(" AND (({}) OR {})").format(wanted, self._suspect)
        return _text(
            sql.SQL(
                "SELECT digest, status, document FROM {} WHERE digest > %s{} "
                "ORDER BY digest LIMIT %s"
            ),
            self._records,
            condition,
        )

    def _page_sync(
        self, after: str, size: int, status: str | None
    ) -> tuple[list[Record | RecordInvalid | StorageFailed], str | None]:
        query = self._q_page[status]

        def read(connection: psycopg.Connection[Any]) -> list[Any]:
            found = connection.execute(query, (after, size)).fetchall()
            connection.rollback()
            return found

        try:
            rows = self._idempotent(read)
        except psycopg.Error as error:
            raise _failure(f"cannot read {self.location}", error) from error
        page: list[Record | RecordInvalid | StorageFailed] = []
        for digest, column, document in rows:
            try:
                record = self._decode(digest, column, _bytes(document))
            except RecordInvalid as error:
                page.append(error)
                continue
            if status is None or record.status == status:
                page.append(record)
        return page, (rows[-1][0] if len(rows) == size else None)

    # ------------------------------------------------------------------ settings

    async def setting(self, name: str, value: str) -> str:
        return await self._trips.run(self._setting_sync, f"setting.{name}", value)

    def _setting_sync(self, key: str, value: str) -> str:
        def record(connection: psycopg.Connection[Any]) -> str:
            self._start_write(connection)
            connection.execute(
                sql.SQL(
                    "INSERT INTO {} (key, value) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING"
                ).format(self._meta),
                (key, value),
            )
            row = connection.execute(
                sql.SQL("SELECT value FROM {} WHERE key = %s").format(self._meta), (key,)
            ).fetchone()
            connection.commit()
            assert row is not None
            return str(row[0])

        try:
            return self._idempotent(record)  # the first value stays: writing it twice is safe
        except psycopg.Error as error:
            raise _failure(
                f"cannot record the setting {key!r} in {self.location}", error
            ) from error

    # ------------------------------------------------------------------ writing

    async def apply(self, identity: Identity, step: StepFunction[T]) -> T:
        call = _Call()
        return await self._trips.run(self._apply_sync, identity, step, call, on_cancel=call.cancel)

    def _apply_sync(self, identity: Identity, step: StepFunction[T], call: _Call) -> T:
        digest = identity_digest(identity)
        try:
            # Lost insert races, a lost owner session, or pooled connections the server
            # dropped (each is discarded): decide again, nothing having been written.
            for _ in range(_RETRIES + self.pool_size):
                with self._connection(call) as connection:
                    try:
                        call.use(connection)
                        return self._attempt(connection, digest, step, call)
                    except _Lost:
                        continue
                    finally:
                        call.use(None)
                        if call.cancelled:
                            # A cancel request may still be on its way to this session:
                            # never hand the connection to another call.
                            connection.close()
        finally:
            call.done.set()
        raise StorageFailed(
            f"the record of {list(identity)} in {self.location} kept changing under "
            f"{_RETRIES} attempts; nothing was written"
        )

    def _attempt(
        self,
        connection: psycopg.Connection[Any],
        digest: str,
        step: StepFunction[T],
        call: _Call,
    ) -> T:
        """One transaction: lock the row, decide, write, commit. ``_Lost``: try again."""
        try:
            self._start_write(connection)
            row = connection.execute(
                self._q_lock,
                (digest,),
            ).fetchone()
        except psycopg.Error as error:
            self._roll_back(connection)
            if connection.broken:  # an idle connection the server ended: nothing was sent
                raise _Lost from error
            raise _failure(
                f"cannot read the record {digest} in {self.location}, so nothing was written",
                error,
            ) from error
        before = None if row is None else _bytes(row[1])
        try:
            current = self._row_record(digest, row)
            session = self._session
            self._local.connection = connection
            try:
                decision: Step[T] = step(current)
            finally:
                self._local.connection = None
            data = None if decision.write is None else encode_record(decision.write)
        except BaseException:
            self._roll_back(connection)
            raise
        if decision.write is None and not decision.delete:
            self._roll_back(connection)
            return decision.answer
        # A claim made in our session is written only while our session holds its owner
        # lock: checked by the write statement itself, so it costs no round trip.
        vouch = None
        write = decision.write
        if write is not None and write.status == "started" and write.owner is not None:
            session = self._session if session is None else session
            if session is not None and write.owner.session == session.name:
                vouch = session
            elif current is None or current.claim_id != write.claim_id:
                # A new claim that no live session of ours vouches for: never written.
                self._roll_back(connection)
                raise StorageFailed(
                    f"the claim of the record {digest} in {self.location} names no live "
                    "owner session of this store, so nothing was written"
                )
        try:
            if not self._write(connection, digest, row is not None, decision, data, vouch=vouch):
                held = vouch is None or self._held(connection, vouch.token)
                self._roll_back(connection)
                if not held:
                    self._renew_session(vouch)
                raise _Lost  # another session created the row first, or ours lost its lock
        except _Lost:
            raise
        except psycopg.Error as error:
            self._roll_back(connection)
            raise _failure(
                f"cannot write the record {digest} in {self.location}, so nothing was written",
                error,
            ) from error
        except StorageFailed as error:  # the owner lock could not be checked or taken again
            self._roll_back(connection)
            failure = StorageFailed(f"{error.message}, so nothing was written", errno=error.errno)
            raise failure from error.__cause__
        except BaseException:
            self._roll_back(connection)
            raise
        if not call.may_commit():
            self._roll_back(connection)
            raise StorageFailed("the call was cancelled before its commit, so nothing was written")
        self._commit(connection, digest, before, data)
        return decision.answer

    def _write(
        self,
        connection: psycopg.Connection[Any],
        digest: str,
        exists: bool,
        decision: Step[Any],
        data: bytes | None,
        *,
        vouch: _Session | None,
    ) -> bool:
        """Write what the step decided; False when nothing was written because the row was
        created by another session first, or (with ``vouch``) that session's owner lock is
        no longer held."""
        if decision.delete:
            if exists:
                connection.execute(self._q_delete, (digest,))
            return True
        assert decision.write is not None
        assert data is not None
        values: tuple[object, ...] = (decision.write.status, decision.write.claim_id, data, digest)
        if vouch is not None:
            values = (*values, vouch.token)
        cursor = connection.execute(self._q_write[exists, vouch is not None], values)
        return cursor.rowcount == 1

    def _commit(
        self,
        connection: psycopg.Connection[Any],
        digest: str,
        before: object,
        data: bytes | None,
    ) -> None:
        # The server's own name of the session (never libpq's backend pid, which a
        # pooler invents), read through SQL when the connection or transaction began.
        server = self._server.get(connection)
        try:
            connection.commit()
        except psycopg.Error as error:
            if not connection.broken and not isinstance(error, psycopg.OperationalError):
                # The server answered: the transaction was rolled back.
                self._roll_back(connection)
                raise _failure(
                    f"the commit of the record {digest} in {self.location} was refused, so "
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
                raise _failure(
                    f"the connection to {self.location} was lost during the commit of the "
                    f"record {digest}; a fresh read shows it was not saved, so nothing was "
                    f"written",
                    error,
                ) from error
            raise _failure(
                f"the connection to {self.location} was lost during the commit of the "
                f"record {digest}, and whether it was saved is unknown ({outcome})",
                error,
            ) from error
        self.commits += 1

    def _settle(
        self,
        server: tuple[int, object, object] | None,
        digest: str,
        before: object,
        data: bytes | None,
    ) -> bool | str:
        """After a lost commit: end the server session that ran it (if it still runs),
        then read the row afresh. True: our write is there; False: the row is as it was
        before; otherwise why it cannot be told.

        The session is named as the server names it: its pid and start, and behind a
        transaction pooler the start of our transaction too (a pooled server session
        that has gone on to another client's transaction is left alone: ours is over)."""
        if server is None:
            return "the session that ran it is not known"
        pid, started, transaction = server
        try:
            # Through owner_url, when given, the fence and the re-read skip the pooler.
            with self._connect(self._owner_conninfo, self.location) as fresh:
                deadline = time.monotonic() + _FENCE_WAIT_MS / 1000
                while True:
                    # backend_start tells that session from a later one given the same pid
                    row = fresh.execute(
                        "SELECT pg_terminate_backend(pid, %s) FROM pg_stat_activity "
                        "WHERE pid = %s AND (%s::timestamptz IS NULL OR backend_start = %s) "
                        "AND (%s::timestamptz IS NULL OR xact_start = %s)",
                        (_FENCE_WAIT_MS, pid, started, started, transaction, transaction),
                    ).fetchone()
                    if row is None:
                        break  # that session is over: its transaction committed or never will
                    if time.monotonic() > deadline:
                        return "the session that ran it could not be ended"
                    time.sleep(0.05)
                found = fresh.execute(
                    sql.SQL("SELECT document FROM {} WHERE digest = %s").format(self._records),
                    (digest,),
                ).fetchone()
        except (psycopg.Error, StorageFailed) as error:
            return f"cannot read it again: {_describe(error)}"
        now = None if found is None else _bytes(found[0])
        if now == data:
            return True
        if now == before:
            return False
        return "the record has changed since"


def missing_journal(url: str, *, timeout: float = 10.0) -> str | None:
    """Why the PostgreSQL location ``url`` holds no journal (the server answers, and the
    location's schema has no journal tables), or None: there is one, or the server could
    not be asked (``Journal.open`` then says why). For the command line and the viewer,
    which read journals and never create one. Blocks: call it from a worker thread."""
    store = PostgresStore(url)  # the location's own checks (schema name, owner_url)
    try:
        with psycopg.connect(
            store._conninfo,
            autocommit=True,
            prepare_threshold=None,
            connect_timeout=max(1, round(timeout)),
        ) as connection:
            row = connection.execute(
                "SELECT to_regnamespace(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL",
                (store.schema, f"{store.schema}.meta"),
            ).fetchone()
    except psycopg.Error:
        return None
    assert row is not None
    schema, meta = row
    if not schema:
        return f"no journal in {store.location}: there is no schema {store.schema}"
    if not meta:
        return f"no journal in {store.location}: schema {store.schema} holds no journal tables"
    return None


def _bytes(value: object) -> object:
    """A ``bytea`` column's value as bytes (psycopg may hand out a memoryview)."""
    return value.tobytes() if isinstance(value, memoryview) else value
