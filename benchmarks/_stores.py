"""The three itemjournal stores as benchmark workloads: begin + complete cycles through
``Journal`` on a fresh location, each cycle on a new identity."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable

import anyio.to_thread
from _common import Env, Sample, journal_cycle, measure, run_directory

from itemjournal import Journal, definition_digest
from itemjournal.testing import MemoryStore


def _commit_counter(journal: Journal) -> Callable[[], int] | None:
    """The store's ``commits`` counter, when it keeps one (SQLite and PostgreSQL do)."""
    store = journal.store
    if not isinstance(getattr(store, "commits", None), int):
        return None
    return lambda: int(getattr(store, "commits"))  # noqa: B009  (read at call time)


async def _check_succeeded(journal: Journal, cycles: int, what: str) -> None:
    counts = await journal.counts()
    if counts["succeeded"] != cycles:
        raise RuntimeError(f"{what}: expected {cycles} succeeded records, found {counts}")


async def _cycles(
    location: str, kind: str, cycles: int, concurrency: int, *, check: bool = True
) -> Sample:
    async with await Journal.open(location) as journal:
        cycle = journal_cycle(journal, kind, definition_digest(f"bench-{kind}-v1"))
        sample = await measure(cycle, cycles, concurrency, commits=_commit_counter(journal))
        if check:
            await _check_succeeded(journal, cycles, f"{kind} store")
    return sample


async def run_memory(env: Env, cycles: int, concurrency: int) -> Sample:
    """The journal over ``MemoryStore``: no I/O at all, so what it measures is the
    journal's own work per cycle (and the event loop's)."""
    async with Journal(MemoryStore()) as journal:
        cycle = journal_cycle(journal, "memory", definition_digest("bench-memory-v1"))
        sample = await measure(cycle, cycles, concurrency)
        await _check_succeeded(journal, cycles, "memory store")
    return sample


async def run_file(env: Env, cycles: int, concurrency: int) -> Sample:
    """The file store (the default): 4 fsyncs per cycle."""
    async with run_directory(env.base, "file-") as root:
        return await _cycles(root, "file", cycles, concurrency)


async def run_sqlite(env: Env, cycles: int, concurrency: int) -> Sample:
    """The SQLite store (group commit). Its operations per commit, the batch size, are
    left in ``env.notes`` for the SQLite limit that runs next."""
    async with run_directory(env.base, "sqlite-") as root:
        sample = await _cycles(
            f"sqlite://{os.path.join(root, 'j.db')}", "sqlite", cycles, concurrency
        )
    if sample.commits:
        env.notes[f"sqlite-batch-{concurrency}"] = 2 * cycles / sample.commits
    return sample


def postgres_location(url: str, schema: str, pool_size: int) -> str:
    separator = "&" if "?" in url else "?"
    return f"{url}{separator}schema={schema}&pool_size={pool_size}"


PG_POOL_SIZE = 8  # the store's default


def _drop_schema(url: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


async def run_postgres(env: Env, cycles: int, concurrency: int) -> Sample:
    """The PostgreSQL store, in a schema of its own, dropped afterwards."""
    if env.postgres_url is None:
        raise RuntimeError("no PostgreSQL server")
    schema = f"ijbench_{os.getpid()}_{secrets.token_hex(4)}"
    try:
        location = postgres_location(env.postgres_url, schema, PG_POOL_SIZE)
        return await _cycles(location, "pg", cycles, concurrency)
    finally:
        await anyio.to_thread.run_sync(_drop_schema, env.postgres_url, schema)
