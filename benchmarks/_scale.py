"""Scale: what a journal costs when it holds many records, and its memory over many cycles.

At each size the location is filled up to that many records, then closed and measured:
``Journal.open``, begin + complete latency at concurrency 1, ``sweep`` (nothing to mark:
no record is ``started``), listing ``records(status="needs_review")`` to the end, and the
viewer's first page: ``GET /`` on a new ``create_app(journal)`` through
``httpx.ASGITransport`` (its templates are compiled once per process, by the first size's
request, as in a server that has been up a while).

Seeding: records are written through the store's own ``apply`` (so its own encoding,
layout and any index it keeps), each a copy of a real record with a new identity; one in
a hundred is ``needs_review``, the rest ``succeeded``. The file store seeds through a
``FileSystem`` whose fsyncs do nothing (seeding only: the measured calls afterwards use
a store opened normally); SQLite seeds durably, many operations a commit. PostgreSQL
seeds by ``COPY`` into the store's own table, each row the store's own encoding of a
record (its ``apply`` would take minutes for 100,000 records).
"""

from __future__ import annotations

import gc
import os
import secrets
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import anyio
import anyio.to_thread
import httpx
from _common import (
    Env,
    Sample,
    current_rss_mb,
    drive_cycles,
    journal_cycle,
    measure,
    run_directory,
)
from _stores import PG_POOL_SIZE, _drop_schema, postgres_location

from itemjournal import Claim, Journal, definition_digest
from itemjournal._model.codec import encode_record
from itemjournal._model.identity import Identity, identity_digest
from itemjournal._model.records import Record
from itemjournal._operator.viewer.app import create_app
from itemjournal._stores.fileio import FileSystem
from itemjournal._stores.files.store import FileStore
from itemjournal._stores.seam import Step, Store

SCALE_WARMUP = 10  # cycles run before the timed ones at each size, not recorded
REVIEW_EVERY = 100  # one seeded record in this many is needs_review
SEED_CONCURRENCY = {"file": 32, "sqlite": 256}


class NoSyncFileSystem(FileSystem):
    """The store's file calls with fsync skipped: for seeding only."""

    def fsync(self, fd: int) -> None:
        return None

    def fsync_dir(self, fd: int) -> None:
        return None


@dataclass(frozen=True)
class ScalePoint:
    store: str
    records: int
    open_s: float
    cycles: Sample  # begin + complete at concurrency 1
    sweep_s: float
    listing_s: float
    listed: int  # needs_review records listed
    seeded_review: int  # needs_review records seeded (listed should match)
    viewer_ms: float | None  # the viewer's first page


@dataclass(frozen=True)
class Templates:
    succeeded: Record
    review: Record


async def _templates(journal: Journal) -> Templates:
    definition = definition_digest("bench-seed-v1")
    done = Identity("bench", "seed", "template", "done")
    claim = await journal.begin(done, {"n": "0"}, definition)
    assert isinstance(claim, Claim)
    await journal.complete(claim, "receipt-template")
    review = Identity("bench", "seed", "template", "review")
    claim = await journal.begin(review, {"n": "1"}, definition)
    await journal.mark_review(review, "seeded for the benchmark")
    succeeded = await journal.store.peek(done, lambda record: record)
    in_review = await journal.store.peek(review, lambda record: record)
    assert isinstance(succeeded, Record)
    assert isinstance(in_review, Record)
    return Templates(succeeded, in_review)


async def _seed(store: Store, templates: Templates, start: int, stop: int, tasks: int) -> int:
    """Records ``start`` .. ``stop - 1``; returns how many are needs_review."""

    async def one(index: int) -> None:
        template = templates.review if index % REVIEW_EVERY == 0 else templates.succeeded
        record = replace(template, identity=Identity("bench", "seed", "record", f"s{index}"))

        def step(current: Record | None) -> Step[None]:
            if current is not None:
                raise RuntimeError(f"seed record s{index} is there already")
            return Step(record, None)

        await store.apply(record.identity, step)

    await drive_cycles(lambda n: one(start + n), stop - start, tasks)
    return sum(1 for index in range(start, stop) if index % REVIEW_EVERY == 0)


def _copy_postgres(location: str, templates: Templates, start: int, stop: int) -> int:
    """Seed the PostgreSQL store's table by COPY: its own columns, the store's own encoding
    of each record. Returns how many are needs_review."""
    import psycopg

    query = urllib.parse.parse_qs(urllib.parse.urlsplit(location).query)
    schema = query["schema"][0]
    url = location.split("?", 1)[0]
    review = 0
    with psycopg.connect(url) as connection, connection.cursor() as cursor:
        with cursor.copy(
            f"COPY {schema}.records (status, claim_id, document, digest) FROM STDIN"
        ) as copy:
            for index in range(start, stop):
                in_review = index % REVIEW_EVERY == 0
                review += in_review
                template = templates.review if in_review else templates.succeeded
                identity = Identity("bench", "seed", "record", f"s{index}")
                record = replace(template, identity=identity)
                copy.write_row(
                    (
                        record.status,
                        record.claim_id,
                        encode_record(record),
                        identity_digest(identity),
                    )
                )
        connection.commit()
    return review


@asynccontextmanager
async def _seeding_store(kind: str, location: str) -> AsyncIterator[Store]:
    if kind == "file":
        store: Store = FileStore(location, fs=NoSyncFileSystem())
        await store.open()
        try:
            yield store
        finally:
            await store.aclose()
    else:
        async with await Journal.open(location) as journal:
            yield journal.store


async def _first_page_ms(journal: Journal) -> float:
    app = create_app(journal)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        started = time.perf_counter()
        response = await client.get("/")
        elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"viewer answered {response.status_code}")
    return elapsed * 1000


async def _measure_point(
    kind: str, location: str, records: int, seeded_review: int, cycles: int, viewer: bool
) -> ScalePoint:
    started = time.perf_counter()
    journal = await Journal.open(location)
    open_s = time.perf_counter() - started
    async with journal:
        cycle = journal_cycle(journal, f"scale-{records}", definition_digest("bench-scale-v1"))
        warm = journal_cycle(journal, f"warm-{records}", definition_digest("bench-scale-v1"))
        await drive_cycles(warm, SCALE_WARMUP, 1)  # not recorded: the first trips of a new open
        sample = await measure(cycle, cycles, 1)
        started = time.perf_counter()
        report = await journal.sweep()
        sweep_s = time.perf_counter() - started
        if report.marked:
            raise RuntimeError(f"{kind}: the sweep marked {len(report.marked)} records")
        started = time.perf_counter()
        listed = 0
        async for _ in journal.records(status="needs_review"):
            listed += 1
        listing_s = time.perf_counter() - started
        viewer_ms = await _first_page_ms(journal) if viewer else None
    return ScalePoint(
        kind, records, open_s, sample, sweep_s, listing_s, listed, seeded_review, viewer_ms
    )


async def run_scale(
    env: Env,
    kind: str,
    location: str,
    sizes: tuple[int, ...],
    cycles: int,
    progress: Callable[[str], None],
) -> list[ScalePoint]:
    """Fill one location up to each size in turn and measure it there."""
    points: list[ScalePoint] = []
    async with scale_location(env, kind) as elsewhere, await Journal.open(elsewhere) as journal:
        templates = await _templates(journal)  # real records, made in another location
    await (await Journal.open(location)).aclose()  # created empty, as a user would
    have = 0  # records in the location: seeded and measured cycles
    seeded_review = 0
    next_seed = 0
    for size in sizes:
        if size > have:
            started = time.perf_counter()
            count = size - have
            if kind == "postgres":
                seeded_review += await anyio.to_thread.run_sync(
                    _copy_postgres, location, templates, next_seed, next_seed + count
                )
            else:
                async with _seeding_store(kind, location) as store:
                    seeded_review += await _seed(
                        store, templates, next_seed, next_seed + count, SEED_CONCURRENCY[kind]
                    )
            next_seed += count
            have += count
            progress(
                f"  seeded {kind} to {have:,} records in {time.perf_counter() - started:.1f} s"
            )
        point = await _measure_point(kind, location, have, seeded_review, cycles, viewer=True)
        have += SCALE_WARMUP + cycles
        points.append(point)
        progress(
            f"  scale {kind:<8} {point.records:>7,} records: open {point.open_s * 1000:.1f} ms, "
            f"cycle p50 {point.cycles.p50_ms:.2f} ms, sweep {point.sweep_s * 1000:.1f} ms, "
            f"needs_review list {point.listing_s * 1000:.1f} ms ({point.listed:,})"
            + ("" if point.viewer_ms is None else f", viewer {point.viewer_ms:.1f} ms")
        )
    return points


@asynccontextmanager
async def scale_location(env: Env, kind: str) -> AsyncIterator[str]:
    """A fresh location of the store ``kind``, removed afterwards."""
    if kind == "postgres":
        assert env.postgres_url is not None
        schema = f"ijbench_{os.getpid()}_{secrets.token_hex(4)}"
        try:
            yield postgres_location(env.postgres_url, schema, PG_POOL_SIZE)
        finally:
            await anyio.to_thread.run_sync(_drop_schema, env.postgres_url, schema)
        return

    async with run_directory(env.base, f"scale-{kind}-") as root:
        yield root if kind == "file" else f"sqlite://{os.path.join(root, 'scale.db')}"


# ---------------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryGrowth:
    store: str
    first: int  # cycles before the first reading
    total: int  # cycles before the second reading
    rss_first_mb: float
    rss_total_mb: float

    @property
    def growth_mb(self) -> float:
        return self.rss_total_mb - self.rss_first_mb


async def run_memory(
    env: Env, kind: str, first: int, total: int, concurrency: int = 16
) -> MemoryGrowth:
    """Resident memory after ``first`` and after ``total`` cycles on one open journal."""
    async with scale_location(env, kind) as location, await Journal.open(location) as journal:
        cycle = journal_cycle(journal, "memory", definition_digest("bench-memory-v1"))

        async def reading(done: int, upto: int) -> float:
            await drive_cycles(lambda n: cycle(done + n), upto - done, concurrency)
            gc.collect()
            return current_rss_mb()

        rss_first = await reading(0, first)
        rss_total = await reading(first, total)
    return MemoryGrowth(kind, first, total, rss_first, rss_total)


ScaleRunner = Callable[[Env], Awaitable[None]]
