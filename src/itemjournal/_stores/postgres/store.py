"""The PostgreSQL store: one journal shared by many hosts.

``PostgresStore`` is the seam (``Store``) over the rooms of this folder, each one topic:

- ``location``: the ``postgresql://`` URL and the store's own parameters in it;
- ``probe``: what open learns of the server and of any pooler in front of it;
- ``schema``: the tables, their creation and migration, the journal's settings;
- ``session``: the owner session, whose advisory lock tells hosts a live owner;
- ``connections``: the pool of data connections (``calls``: a trip's cancellation);
- ``statements``, ``reads`` and ``writes``: what each operation sends and reads back;
- ``settle``: the commit, and the settling of a commit whose outcome was lost.

Every operation is one worker-thread trip holding one pooled connection (on the blocking
face, ``blocking``: the same work in the caller's thread). A write is one transaction (lock
the row, run the journal's step, write, commit), re-run on what is there when it lost a
race, and never retried blindly once its commit has begun. In a child made by ``fork`` the
store starts over with connections and an owner session of its own (``forks``).

**Durability.** Every write commits with at least ``synchronous_commit = on``, whatever the
server, database or role says (``remote_apply`` is kept).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import anyio.to_thread
import psycopg
import psycopg_pool

from ..._model.codec import encode_record
from ..._model.errors import InvalidArgument, RecordInvalid, StorageFailed
from ..._model.identity import Identity, identity_digest
from ..._model.records import STATUSES, Owner, Record
from ..owners import current_owner, gone_reason, owner_alive
from ..seam import Step, StepFunction, Tally
from ..threads import Trips
from .blocking import BlockingFace
from .calls import Call
from .connections import Connections, StepConnection, roll_back
from .forks import ChildConnections, is_pending, watch
from .location import parse_location
from .probe import check_owner_pooling, check_owner_reach, data_pooling
from .reads import Reads, row_record
from .schema import Tables, check_journal, prepare, record_setting
from .session import OwnerLock, OwnerSession, held_anywhere, is_held, token_of
from .settle import Commits
from .statements import Statements, column_bytes
from .writes import RETRIES, Lost, lock_row, nothing_written, vouch_for, write_row

__all__ = ["PostgresStore", "missing_journal"]

T = TypeVar("T")


class PostgresStore(BlockingFace):
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
        where = parse_location(url)
        self._where = where
        self.owner_url_given = where.owner_url_given
        self.location = where.shown
        self.schema = where.schema
        self.pool_size = where.pool_size
        self.lock_timeout = lock_timeout
        self.trust_shared_root = trust_shared_root  # a database is shared by design
        tables = Tables.of(where.schema)
        self._tables = tables
        self._statements = Statements(tables)
        self._trips = self._new_trips()
        self._take_parts(Connections(where, lock_timeout, self._trips, repr(self)))
        watch(self)

    def _new_trips(self) -> Trips:
        # As many trips at once as there are pooled connections: a trip that had to wait
        # for a connection would wait in a worker thread, and threads waiting in the pool
        # cost the process a quarter of its CPU per cycle at 16 tasks (benchmarks/README.md).
        return Trips(self, at_once=self.pool_size, turn_timeout=self.lock_timeout)

    def _take_parts(self, connections: Connections) -> None:
        """The parts that hold connections, locks or threads, over ``connections``: made
        with the store, and made anew in a forked child (``_start_over``)."""
        self._connections = connections
        self._owner_lock = OwnerLock(self._where, self.lock_timeout)
        self._commits = Commits(connections, self._where, self._tables, self.lock_timeout)
        self._step_connection = StepConnection()
        self._reads = Reads(connections, self._statements, self._step_connection, self.location)

    def _start_over(self) -> object:
        """In a forked child, right after the fork: parts of this process's own, none yet
        connected (a store the parent had opened connects at its first use here, and takes
        an owner session of its own before its first claim; one the parent had closed stays
        closed). Answers the inherited parts, which the child must never use nor close."""
        old, closed = self._connections, self._trips.closed
        inherited = (self._trips, old, self._owner_lock, self._commits, self._step_connection)
        self._trips = self._new_trips()
        self._trips.closed = closed
        name = repr(self)
        if not self._trips.closed and (old.pool is not None or is_pending(old)):
            connections: Connections = ChildConnections(
                self._where, self.lock_timeout, self._trips, name, old.pooling
            )
        else:
            connections = Connections(self._where, self.lock_timeout, self._trips, name)
        self._take_parts(connections)
        return inherited

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

    @property
    def pooling(self) -> str:
        """How the data connections reach the server (``Connections.pooling``)."""
        return self._connections.pooling

    @property
    def commits(self) -> int:
        """Committed write transactions, for tests and benchmarks."""
        return self._commits.commits

    @property
    def unknown_settled(self) -> int:
        """Commits whose lost outcome a fresh read settled."""
        return self._commits.unknown_settled

    @property
    def _pool(self) -> psycopg_pool.ConnectionPool[Any] | None:
        """The pool of data connections (None unless open), for tests that hold them busy."""
        return self._connections.pool

    @property
    def _session(self) -> OwnerSession | None:
        """The owner session now (None: none live), for tests that end it."""
        return self._owner_lock.session

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        await self._trips.run(self._open_sync)

    def _open_sync(self) -> None:
        if self._connections.pool is not None:
            return
        current_owner()  # named now: a process short of descriptors later still names itself
        try:
            # The data path first, on connections of its own: a server that cannot be
            # reached, a transaction pooler, a setting the journal cannot live with, each
            # is reported at once and says why, before any lock is taken anywhere.
            self._connections.pooling = data_pooling(self._where, self.lock_timeout)
            if self.owner_url_given:
                check_owner_pooling(self._where, self.lock_timeout)
            self._owner_lock.renew(None)
            self._connections.open()
            with self._connections.connection() as connection:
                prepare(connection, self._tables, self.location, self._connections.start_write)
            if self.owner_url_given:
                session = self._owner_lock.session
                assert session is not None
                check_owner_reach(self._connections, session, self.location)
        except BaseException:
            self._close_sync()
            raise

    async def check(self) -> list[str]:
        return await self._trips.run(self._check_sync)

    def _check_sync(self) -> list[str]:
        return check_journal(self._connections, self._tables, self.location)

    async def aclose(self) -> None:
        await self._trips.close()
        await anyio.to_thread.run_sync(self._close_sync)

    def _close_sync(self) -> None:
        # No trip takes a pooled connection from here on; the owner lock goes at once (other
        # hosts see this store's claims gone), and only then does the pool wait for its
        # connections to come back.
        pool = self._connections.detach()
        self._owner_lock.close()
        if pool is not None:
            pool.close(timeout=self.lock_timeout)

    # ------------------------------------------------------------------ owners

    def owner(self) -> Owner:
        """This process, in the session that holds our owner lock now. A session lost
        earlier (its renewal failed) is renewed here first; if it cannot be, this raises
        ``STORAGE_FAILED``, and no claim is made without a live owner session."""
        session = self._owner_lock.session
        if session is None:
            self._owner_lock.renew(None)
            session = self._owner_lock.session
            assert session is not None
        return dataclasses.replace(current_owner(), session=session.name)

    def gone_reason(self, owner: Owner | None) -> str:
        """The review reason for a started record whose ``owner`` was judged gone: its
        database session ended, or (an owner without one, judged as on one host) its
        process."""
        if owner is not None and token_of(owner.session) is not None:
            return "owner session gone"
        return gone_reason(owner)

    def owner_alive(self, owner: Owner | None) -> bool | None:
        """Whether the session that made ``owner``'s claim still holds its lock, on any host.

        An owner without a session (a record copied from another store) is judged as
        the stores of one host judge it."""
        if owner is None:
            return None
        token = token_of(owner.session)
        if token is None:
            return owner_alive(owner)
        connection = self._step_connection.connection
        if connection is not None:
            return self._held(connection, token)
        return held_anywhere(self._connections, token, self.location)

    def _held(self, connection: psycopg.Connection[Any], token: int) -> bool:
        return is_held(connection, token, self.location)

    # ------------------------------------------------------------------ reading

    async def peek(self, identity: Identity, view: Callable[[Record | None], T]) -> T:
        return await self._trips.run(self._reads.peek, identity, view)

    async def scan(
        self, *, status: str | None = None, after: str | None = None, batch: int = 256
    ) -> AsyncGenerator[Record | RecordInvalid | StorageFailed, None]:
        """Every row in digest order (after ``after``), a page per worker trip; see
        ``Store.scan``.

        A status scan reads the rows whose status column holds that status (the open
        statuses through their index); the column is checked against the document on
        every read, and a table constraint keeps it one of the statuses.
        """
        bound: str | None = self._scan_start(status, after)
        while bound is not None:
            page, bound = await self._trips.run(self._reads.page, bound, batch, status)
            for item in page:
                yield item

    @staticmethod
    def _scan_start(status: str | None, after: str | None) -> str:
        """Where a scan's first page starts, once its ``status`` is known to be one."""
        if status is not None and status not in STATUSES:
            raise InvalidArgument(f"no such status: {status!r}", code="INVALID_ARGUMENT")
        return "" if after is None else after

    async def tally(self) -> Tally:
        """The rows per status column, then the suspect rows (whose document does not name
        their column's status) each read strictly; one statement, one snapshot.

        Not exact (``Tally.exact`` is False): a row whose document names its column's
        status but is damaged elsewhere is counted under that status; only a full scan
        (``Journal.counts``) reads every row strictly.
        """
        return await self._trips.run(self._tally_sync)

    def _tally_sync(self) -> Tally:
        return Tally(self._reads.tally(), exact=False)

    async def ages(self, identities: Sequence[Identity]) -> list[timedelta | None]:
        """For each identity, how long ago its record was last written by the store's own clock
        (here: the server's), in one read; None where the store has no such witness or no record.

        The server stamps ``written_at`` with its own clock on every write; the age is
        its ``now()`` minus that, never below zero (a server clock stepped back makes a
        record young, never old). A row older than the column carries the time of the
        migration that added it (see ``schema``)."""
        return await self._trips.run(self._ages_sync, identities)

    def _ages_sync(self, identities: Sequence[Identity]) -> list[timedelta | None]:
        return self._reads.ages([identity_digest(identity) for identity in identities])

    # ------------------------------------------------------------------ writing

    async def setting(self, name: str, value: str) -> str:
        return await self._trips.run(self._record_setting, name, value)

    def _record_setting(self, name: str, value: str) -> str:
        return record_setting(
            self._connections, self._tables, self.location, f"setting.{name}", value
        )

    async def apply(self, identity: Identity, step: StepFunction[T]) -> T:
        call = Call()
        return await self._trips.run(self._apply_sync, identity, step, call, on_cancel=call.cancel)

    def _apply_sync(
        self, identity: Identity, step: StepFunction[T], call: Call, *, blocking: bool = False
    ) -> T:
        digest = identity_digest(identity)
        # A trip waits for a pooled connection in short slices, to see its caller's cancel;
        # a blocking caller cannot be cancelled, and waits in one piece in the pool's queue,
        # served in the order it came.
        waiting = None if blocking else call
        try:
            # Lost insert races, a lost owner session, or pooled connections the server
            # dropped (each is discarded): decide again, nothing having been written.
            for _ in range(RETRIES + self.pool_size):
                with self._connections.connection(waiting) as connection:
                    try:
                        call.use(connection)
                        return self._attempt(connection, digest, step, call)
                    except Lost:
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
            f"{RETRIES} attempts; nothing was written"
        )

    def _attempt(
        self,
        connection: psycopg.Connection[Any],
        digest: str,
        step: StepFunction[T],
        call: Call,
    ) -> T:
        """One transaction: lock the row, decide, write, commit. ``Lost``: try again."""
        row = lock_row(connection, digest, self._statements, self._connections, self.location)
        before = None if row is None else column_bytes(row[1])
        session = self._owner_lock.session
        try:
            current = row_record(digest, row, self.location)
            with self._step_connection.lent(connection):
                decision: Step[T] = step(current)
            data = None if decision.write is None else encode_record(decision.write)
            if decision.write is None and not decision.delete:
                roll_back(connection)
                return decision.answer
            if session is None:  # a step that found none renewed it (``owner``)
                session = self._owner_lock.session
            vouch = vouch_for(decision.write, current, session, digest, self.location)
        except BaseException:
            roll_back(connection)
            raise
        with nothing_written(connection, digest, self.location):
            if not self._write(connection, digest, row is not None, decision, data, vouch=vouch):
                held = vouch is None or self._held(connection, vouch.token)
                roll_back(connection)
                if not held:
                    self._owner_lock.renew(vouch)
                raise Lost  # another session created the row first, or ours lost its lock
        if not call.may_commit():
            roll_back(connection)
            raise StorageFailed("the call was cancelled before its commit, so nothing was written")
        self._commit(connection, digest, before, data)
        return decision.answer

    # The write's own steps stay methods of the store, each the point where the fault
    # tests end a session on its way (tests/test_pgstore.py): ``_write``, ``_held``,
    # ``_commit``, and ``_attempt`` itself.

    def _write(
        self,
        connection: psycopg.Connection[Any],
        digest: str,
        exists: bool,
        decision: Step[Any],
        data: bytes | None,
        *,
        vouch: OwnerSession | None,
    ) -> bool:
        """``write_row``: False when the row was created first by another session, or
        ``vouch``'s owner lock is no longer held."""
        return write_row(
            connection, self._statements, digest, decision, data, exists=exists, vouch=vouch
        )

    def _commit(
        self, connection: psycopg.Connection[Any], digest: str, before: object, data: bytes | None
    ) -> None:
        self._commits.commit(connection, digest, before, data)


def missing_journal(url: str, *, timeout: float = 10.0) -> str | None:
    """Why the PostgreSQL location ``url`` holds no journal (the server answers, and the
    location's schema has no journal tables), or None: there is one, or the server could
    not be asked (``Journal.open`` then says why). For the command line and the viewer,
    which read journals and never create one. Blocks: call it from a worker thread."""
    where = parse_location(url)  # the location's own checks (schema name, owner_url)
    try:
        with psycopg.connect(
            where.conninfo,
            autocommit=True,
            prepare_threshold=None,
            connect_timeout=max(1, round(timeout)),
        ) as connection:
            row = connection.execute(
                "SELECT to_regnamespace(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL",
                (where.schema, f"{where.schema}.meta"),
            ).fetchone()
    except psycopg.Error:
        return None
    assert row is not None
    schema, meta = row
    if not schema:
        return f"no journal in {where.shown}: there is no schema {where.schema}"
    if not meta:
        return f"no journal in {where.shown}: schema {where.schema} holds no journal tables"
    return None
