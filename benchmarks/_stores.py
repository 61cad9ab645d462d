"""The three itemjournal stores as benchmark workloads: begin + complete cycles through
``Journal`` on a fresh location, each cycle on a new identity.

The ``run_*_sync`` workloads are the same cycles through the blocking face
(``itemjournal.sync.Journal``): threads, not tasks, share one journal and one cycle
counter, and each calls ``begin`` and ``complete`` itself, with no event loop.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable

import anyio.to_thread
from _common import Env, Sample, journal_cycle, measure, run_directory

import itemjournal.sync
from itemjournal import Claim, Journal, definition_digest
from itemjournal.testing import MemoryStore


def _commit_counter(journal: Journal | itemjournal.sync.Journal) -> Callable[[], int] | None:
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


# ---------------------------------------------------------------------- the blocking face


def _thread_cycles(location: str, kind: str, cycles: int, threads: int) -> Sample:
    """``cycles`` begin + complete cycles on ``threads`` threads sharing one
    ``itemjournal.sync.Journal`` and one cycle counter; run in a thread of its own, so
    that no event loop is anywhere near the calls. Each cycle is timed; there is no
    event loop, so no lag."""
    with itemjournal.sync.Journal.open(location) as journal:
        definition = definition_digest(f"bench-{kind}-v1")
        commits = _commit_counter(journal)
        counter = threading.Lock()
        next_index = 0
        latencies: list[float] = []  # list.append is atomic: no lock needed
        failures: list[BaseException] = []
        clock = time.perf_counter

        def worker() -> None:
            nonlocal next_index
            try:
                while True:
                    with counter:
                        index = next_index
                        if index >= cycles or failures:
                            return
                        next_index += 1
                    started = clock()
                    identity = ("bench", kind, "cycle", f"i{index}")
                    claim = journal.begin(identity, {"n": str(index)}, definition)
                    if not isinstance(claim, Claim):
                        raise TypeError(f"expected a fresh claim for {identity}, got {claim!r}")
                    journal.complete(claim, f"receipt-{index}")
                    latencies.append(clock() - started)
            except BaseException as error:  # re-raised by the driver: a run that fails counts
                failures.append(error)

        workers = [
            threading.Thread(target=worker, name=f"bench {kind} {n}") for n in range(threads)
        ]
        before = commits() if commits is not None else 0
        cpu = time.process_time()
        started = clock()
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
        seconds = clock() - started
        cpu = time.process_time() - cpu
        done = None if commits is None else commits() - before
        if failures:
            raise failures[0]
        counts = journal.counts()
        if counts["succeeded"] != cycles:
            raise RuntimeError(f"{kind} store, sync: expected {cycles} succeeded, found {counts}")
    return Sample(cycles, seconds, tuple(latencies), (), done, cpu)


async def run_file_sync(env: Env, cycles: int, concurrency: int) -> Sample:
    """The file store through the blocking face, ``concurrency`` threads."""
    async with run_directory(env.base, "file-sync-") as root:
        return await anyio.to_thread.run_sync(_thread_cycles, root, "file", cycles, concurrency)


async def run_sqlite_sync(env: Env, cycles: int, concurrency: int) -> Sample:
    """The SQLite store through the blocking face, ``concurrency`` threads. Its batch sizes
    are not left for the SQLite limit, which replays the async store's."""
    async with run_directory(env.base, "sqlite-sync-") as root:
        location = f"sqlite://{os.path.join(root, 'j.db')}"
        return await anyio.to_thread.run_sync(
            _thread_cycles, location, "sqlite", cycles, concurrency
        )


# ---------------------------------------------------------------------- PostgreSQL


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
