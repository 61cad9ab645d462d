"""The limits each store is measured against: what its storage does with no journal logic.

``file``
    Every system call the file store makes for a ``begin`` and a ``complete`` while its
    saves overlap (``bench_filestore.StoreSaves``: the record lock, the read of the
    current document, the durable save), one worker-thread trip per save, as the store
    makes them; ``file_calls_same`` compares the two in a child process. ``file saves``
    is the durable saves alone (``BareSaves``), for reference.
``sqlite``
    The SQLite store's own SQL (the row read and the upsert of each operation, inside
    ``BEGIN IMMEDIATE`` … ``COMMIT``) in the same batch sizes as the store's commits in
    the run just before, on raw ``sqlite3`` in one thread, in a database made with the
    store's own schema (copied from a database the store created).
``postgres``
    The same SQL on a pool of the same size (``bench_postgres.Bare``).

Each ``… ceiling`` is its limit with the journal's own work added to every cycle: a
``begin`` and a ``complete`` over ``MemoryStore`` (no I/O), then the limit's cycle (for
SQLite, whose limit runs in one thread with no event loop, the limit's thread and as
many journal cycles on the event loop, at the same time). It estimates what a store would
make if its only cost beyond the limit's were the journal's work, with nothing spent
handing that work between the event loop and the threads: its rate over the limit's says
how much of a goal the journal's own work leaves. It is an estimate, not a bound: a store
whose journal work falls differently between the storage's waits can come out above it
(the PostgreSQL store, whose step runs in the worker thread holding the connection, did).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio.to_thread
from _common import (
    CycleFunction,
    Env,
    Sample,
    drive_cycles,
    journal_cycle,
    measure,
    run_directory,
)
from _stores import PG_POOL_SIZE
from bench_filestore import BareSaves, StoreSaves, save_cycle
from bench_postgres import Bare, _create_bare_table, _drop, bare_cycle
from bench_postgres import Settings as PostgresSettings

from itemjournal import Claim, Identity, Journal, definition_digest, identity_digest
from itemjournal.testing import MemoryStore, stored_record

PAYLOAD = 1024  # bytes per bare file save; a journal record is about 750-900 B

# ---------------------------------------------------------------------- ceilings


@asynccontextmanager
async def journal_beside(ceiling: bool) -> AsyncIterator[CycleFunction | None]:
    """For a ceiling, a ``begin`` + ``complete`` cycle of a journal over ``MemoryStore``;
    None for the limit alone."""
    if not ceiling:
        yield None
        return
    async with Journal(MemoryStore()) as journal:
        yield journal_cycle(journal, "ceiling", definition_digest("bench-ceiling-v1"))


def with_journal(limit: CycleFunction, journal_part: CycleFunction | None) -> CycleFunction:
    """``limit``'s cycle after ``journal_part``'s (if any): the journal's own work and the
    limit's, with nothing between them."""
    if journal_part is None:
        return limit
    part = journal_part

    async def cycle(index: int) -> None:
        await part(index)
        await limit(index)

    return cycle


# ---------------------------------------------------------------------- file


async def _file_limit(env: Env, cycles: int, concurrency: int, *, ceiling: bool) -> Sample:
    async with run_directory(env.base, "limit-") as root:
        saves = StoreSaves(root, PAYLOAD)
        try:
            async with journal_beside(ceiling) as journal_part:
                cycle = with_journal(save_cycle(saves), journal_part)
                return await measure(cycle, cycles, concurrency)
        finally:
            saves.close()


async def run_file_limit(env: Env, cycles: int, concurrency: int) -> Sample:
    return await _file_limit(env, cycles, concurrency, ceiling=False)


async def run_file_ceiling(env: Env, cycles: int, concurrency: int) -> Sample:
    return await _file_limit(env, cycles, concurrency, ceiling=True)


async def run_file_saves(env: Env, cycles: int, concurrency: int) -> Sample:
    async with run_directory(env.base, "bare-") as root:
        return await measure(save_cycle(BareSaves(root, PAYLOAD)), cycles, concurrency)


def file_calls_same(base: str) -> bool | None:
    """Whether one store cycle and one of the limit's make the same audited calls, traced
    in a child process (an audit hook cannot be removed); None when it could not run."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_filestore.py")
    try:
        done = subprocess.run(
            [sys.executable, script, "--traced-calls", "--dir", base],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return bool(json.loads(done.stdout)["same"])
    except (OSError, subprocess.SubprocessError, ValueError, KeyError):
        return None


# ---------------------------------------------------------------------- SQLite

# The statements of one operation in the SQLite store's batch (``sqlite/batch.py``, ``_run_one``).
SQLITE_READ = "SELECT status, document FROM itemjournal_records WHERE digest = ?"
SQLITE_WRITE = (
    "INSERT INTO itemjournal_records (digest, status, document, written_at) "
    "VALUES (?, ?, ?, ?) ON CONFLICT (digest) DO UPDATE SET "
    "status = excluded.status, document = excluded.document, "
    "written_at = excluded.written_at"
)
_LITERAL = re.compile(r"[xX]'[0-9a-fA-F]*'|'(?:[^']|'')*'|\b\d+(?:\.\d+)?\b")


def statement_shape(sql: str) -> str:
    """A traced statement with its values taken out, to compare statements by shape."""
    return " ".join(_LITERAL.sub("?", sql).split())


@dataclass(frozen=True)
class SqliteTemplate:
    """What the SQLite limit copies from the store: schema, documents and statements."""

    schema: tuple[str, ...]
    started: bytes  # a started record's document, as the store encodes it
    succeeded: bytes
    store_shapes: frozenset[str]  # the store writer's statements in a traced batch


def _schema_of(path: str) -> tuple[str, ...]:
    connection = sqlite3.connect(path)
    try:
        rows = connection.execute(
            "SELECT sql FROM sqlite_master WHERE sql IS NOT NULL AND name LIKE 'itemjournal%' "
            "ORDER BY type = 'index', rowid"
        ).fetchall()
    finally:
        connection.close()
    return tuple(str(row[0]) for row in rows)


async def sqlite_template(base: str) -> SqliteTemplate:
    """Open a store, trace one begin + complete, keep its schema and statements; the
    documents are records as the store encodes them (``itemjournal.testing.stored_record``)."""
    async with run_directory(base, "sqlite-template-") as root:
        path = os.path.join(root, "t.db")
        traced: list[str] = []
        identity = Identity("bench", "sqlite", "cycle", "i0")
        async with await Journal.open(f"sqlite://{path}") as journal:
            writer = getattr(journal.store, "_writer", None)
            if isinstance(writer, sqlite3.Connection):
                writer.set_trace_callback(traced.append)
            definition = definition_digest("bench-sqlite-v1")
            claim = await journal.begin(identity, {"n": "0"}, definition)
            assert isinstance(claim, Claim)
            await journal.complete(claim, "receipt-0")
            if isinstance(writer, sqlite3.Connection):
                writer.set_trace_callback(None)
        schema = await anyio.to_thread.run_sync(_schema_of, path)
    shapes = frozenset(statement_shape(sql) for sql in traced if not sql.startswith("PRAGMA"))
    return SqliteTemplate(
        schema,
        stored_record(identity, "started").document,
        stored_record(identity, "succeeded").document,
        store_shapes=shapes,
    )


class SqliteLimit:
    """The store's statements in the store's batch sizes, raw ``sqlite3``, one thread."""

    def __init__(self, path: str, template: SqliteTemplate) -> None:
        self.template = template
        self.connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.connection.execute("PRAGMA journal_mode = WAL")
        self.connection.execute("PRAGMA synchronous = FULL")
        for statement in template.schema:
            self.connection.execute(statement)

    def close(self) -> None:
        self.connection.close()

    def shapes(self) -> frozenset[str]:
        """The statements one traced batch of this limit runs, by shape."""
        traced: list[str] = []
        self.connection.set_trace_callback(traced.append)
        try:
            self._commit([("trace", True), ("trace", False)])
        finally:
            self.connection.set_trace_callback(None)
        return frozenset(statement_shape(sql) for sql in traced)

    def _commit(self, operations: list[tuple[str, bool]]) -> None:
        execute = self.connection.execute
        execute("BEGIN IMMEDIATE")
        stamp = time.time()  # the store takes one time per transaction too
        for key, begin in operations:
            execute(SQLITE_READ, (key,)).fetchone()
            if begin:
                execute(SQLITE_WRITE, (key, "started", self.template.started, stamp))
            else:
                execute(SQLITE_WRITE, (key, "succeeded", self.template.succeeded, stamp))
        execute("COMMIT")

    def run(self, cycles: int, batch: float) -> float:
        """``cycles`` begins and completes, ``batch`` operations a commit on average (a
        complete in the commit after its begin); the seconds taken."""
        keys = [
            identity_digest(Identity("bench", "limit", "cycle", f"i{n}")) for n in range(cycles)
        ]
        pending: list[str] = []  # begun, to complete
        next_key = 0
        done_ops = 0
        commits = 0
        started = time.perf_counter()
        while done_ops < 2 * cycles:
            commits += 1
            size = max(1, round(commits * batch) - round((commits - 1) * batch))
            operations = [(key, False) for key in pending[:size]]
            pending = pending[len(operations) :]
            while len(operations) < size and next_key < cycles:
                operations.append((keys[next_key], True))
                next_key += 1
            if not operations:  # only completes were left and the batch took none
                operations = [(key, False) for key in pending[:1]]
                pending = pending[1:]
            self._commit(operations)
            pending.extend(key for key, begin in operations if begin)
            done_ops += len(operations)
        return time.perf_counter() - started


async def run_sqlite_limit(env: Env, cycles: int, concurrency: int) -> Sample:
    return await _sqlite_limit(env, cycles, concurrency, ceiling=False)


async def run_sqlite_ceiling(env: Env, cycles: int, concurrency: int) -> Sample:
    """The SQLite limit in its thread while the event loop runs as many cycles of the
    journal over ``MemoryStore`` at ``concurrency``: both kinds of work done in one
    process, with no hand-off between them; the time until both are done."""
    return await _sqlite_limit(env, cycles, concurrency, ceiling=True)


async def _sqlite_limit(env: Env, cycles: int, concurrency: int, *, ceiling: bool) -> Sample:
    batch = env.notes.get(f"sqlite-batch-{concurrency}")
    if not isinstance(batch, float):
        raise TypeError("the SQLite limit runs after the SQLite store at the same concurrency")
    template = env.notes.get("sqlite-template")
    if not isinstance(template, SqliteTemplate):
        template = await sqlite_template(env.base)
        env.notes["sqlite-template"] = template
    async with run_directory(env.base, "sqlite-limit-") as root:
        limit = await anyio.to_thread.run_sync(SqliteLimit, os.path.join(root, "l.db"), template)
        try:
            if "sqlite-limit-shapes" not in env.notes:
                env.notes["sqlite-limit-shapes"] = await anyio.to_thread.run_sync(limit.shapes)
            cpu = time.process_time()
            if ceiling:
                seconds = await _beside_journal(limit, cycles, batch, concurrency)
            else:
                seconds = await anyio.to_thread.run_sync(limit.run, cycles, batch)
            cpu = time.process_time() - cpu
        finally:
            await anyio.to_thread.run_sync(limit.close)
    commits = round(2 * cycles / batch)
    return Sample(cycles, seconds, commits=commits, cpu_seconds=cpu)


async def _beside_journal(limit: SqliteLimit, cycles: int, batch: float, concurrency: int) -> float:
    """The seconds until both the limit (in its thread) and ``cycles`` journal cycles over
    ``MemoryStore`` (on the event loop) are done, run at the same time."""
    started = time.perf_counter()
    async with journal_beside(True) as journal_part, anyio.create_task_group() as group:
        assert journal_part is not None
        group.start_soon(anyio.to_thread.run_sync, limit.run, cycles, batch)
        await drive_cycles(journal_part, cycles, concurrency)
    return time.perf_counter() - started


def same_statements(env: Env) -> bool | None:
    """Whether the limit ran the statements the store's traced batch ran (None: unknown)."""
    template = env.notes.get("sqlite-template")
    shapes = env.notes.get("sqlite-limit-shapes")
    if not isinstance(template, SqliteTemplate) or not isinstance(shapes, frozenset):
        return None
    return shapes == template.store_shapes


# ---------------------------------------------------------------------- PostgreSQL


async def run_postgres_limit(env: Env, cycles: int, concurrency: int) -> Sample:
    return await _postgres_limit(env, cycles, concurrency, ceiling=False)


async def run_postgres_ceiling(env: Env, cycles: int, concurrency: int) -> Sample:
    return await _postgres_limit(env, cycles, concurrency, ceiling=True)


async def _postgres_limit(env: Env, cycles: int, concurrency: int, *, ceiling: bool) -> Sample:
    if env.postgres_url is None:
        raise RuntimeError("no PostgreSQL server")
    settings = PostgresSettings(
        url=env.postgres_url,
        schema=f"ijbench_{os.getpid()}_{secrets.token_hex(4)}",
        pool_size=PG_POOL_SIZE,
        cycles=cycles,
        cycles_single=cycles,
        rounds=1,
        backend=env.backend,
    )
    await anyio.to_thread.run_sync(_create_bare_table, settings)
    try:
        bare = Bare(settings)
        await anyio.to_thread.run_sync(bare.open)
        try:
            async with journal_beside(ceiling) as journal_part:
                cycle = with_journal(
                    bare_cycle(bare, secrets.token_hex(4), PG_POOL_SIZE), journal_part
                )
                sample = await measure(cycle, cycles, concurrency, commits=lambda: bare.commits)
        finally:
            await anyio.to_thread.run_sync(bare.close)
    finally:
        await anyio.to_thread.run_sync(_drop, settings)
    return sample
