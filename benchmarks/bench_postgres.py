"""PostgreSQL store against a bare loop of the same SQL on the same kind of pool.

Two workloads run side by side in one process, at concurrency 1, 16 and 64, each
measured as begin + complete cycles per second, every cycle on a new identity:

``store``
    ``Journal.open(f"{url}?schema=...&pool_size=N")``: the itemjournal PostgreSQL store
    (a ``psycopg_pool.ConnectionPool`` of N connections driven through anyio worker
    threads, one trip per operation, plus the connection holding its owner lock).

``bare``
    The same SQL and nothing else, on a ``psycopg_pool.ConnectionPool`` of the same size,
    driven the same way (one ``anyio.to_thread.run_sync`` trip per operation, holding one
    pooled connection, at most N trips at once), on a table of the same shape (digest,
    status, claim id, document as ``bytea``) with documents of the size of a journal
    record:

    * begin: ``SELECT status, document … FOR UPDATE`` → ``INSERT … ON CONFLICT DO
      NOTHING`` (a started document of about 700 B) → ``COMMIT``;
    * complete: ``SELECT … FOR UPDATE`` → check the claim id → ``UPDATE`` (the document
      rewritten as succeeded) → ``COMMIT``.

    No JSON decoding of the row, no state machine, no owner-lock check, no cancellation
    handling: what is left is the cost of the store itself.

Both live in a schema of their own (``ijbench_<pid>_<hex>``), emptied before every run
and dropped at the end. Every round opens a new event loop, warms both workloads up (not
recorded), then runs each workload at each concurrency; the order is reversed every
other round. The table shows medians over rounds; the ratios are taken within a round
and then the median: store/bare at concurrency 1 and 16 (goal >= 0.70) and 64, and the
store at 64 against itself at 16 (goal >= 1.00: more tasks than connections must not
cost throughput; no herd at the pool).

The server is ``--url``, else ``ITEMJOURNAL_BENCH_POSTGRES``, else
``ITEMJOURNAL_TEST_POSTGRES``; without one the script says so and exits 0.

Run: ``.venv/bin/python benchmarks/bench_postgres.py --url postgresql://user@host/db
[--cycles N] [--cycles-single N] [--rounds R] [--pool-size N] [--backend trio]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import socket
import sys
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import anyio
import anyio.to_thread
import psycopg
import psycopg_pool
from _common import (
    CycleFunction,
    Sample,
    at_least,
    by_round,
    check_count,
    drive_cycles,
    journal_cycle,
    median,
    package_version,
    positive,
    table,
    verdict,
    without_password,
)

from itemjournal import Journal, definition_digest, identity_digest, input_digest

WORKLOADS = ("store", "bare")
CONCURRENCIES = (1, 16, 64)
GOAL_RATIO = 0.70  # store/bare at concurrency 1 and 16
GOAL_SCALING = 1.00  # store at 64 / store at 16
VARIABLES = ("ITEMJOURNAL_BENCH_POSTGRES", "ITEMJOURNAL_TEST_POSTGRES")


@dataclass(frozen=True)
class Settings:
    url: str
    schema: str
    pool_size: int
    cycles: int  # at concurrency 16 and 64
    cycles_single: int  # at concurrency 1
    rounds: int
    backend: str

    def cycles_at(self, concurrency: int) -> int:
        return self.cycles_single if concurrency == 1 else self.cycles

    @property
    def location(self) -> str:
        separator = "&" if "?" in self.url else "?"
        return f"{self.url}{separator}schema={self.schema}&pool_size={self.pool_size}"


Results = dict[tuple[str, int], list[Sample]]


# ---------------------------------------------------------------------- the schema


def _admin(settings: Settings) -> psycopg.Connection[Any]:
    return psycopg.connect(settings.url, autocommit=True)


def _create_bare_table(settings: Settings) -> None:
    """The bare loop's table: a copy of the store's own (its checks and its indexes), so
    that both run the same statements against the same schema."""
    anyio.run(_open_and_close, settings.location)  # the store makes its tables as it opens
    with _admin(settings) as connection:
        connection.execute(
            f"CREATE TABLE IF NOT EXISTS {settings.schema}.bare "
            f"(LIKE {settings.schema}.records INCLUDING ALL)"
        )


async def _open_and_close(location: str) -> None:
    await (await Journal.open(location)).aclose()


def _empty(settings: Settings) -> None:
    """Both tables emptied, so that every run starts from the same size."""
    with _admin(settings) as connection:
        tables = [f"{settings.schema}.bare"]
        found = connection.execute(
            "SELECT to_regclass(%s) IS NOT NULL", (f"{settings.schema}.records",)
        ).fetchone()
        if found and found[0]:
            tables.append(f"{settings.schema}.records")
        connection.execute(f"TRUNCATE {', '.join(tables)}")


def _count(settings: Settings, table_name: str) -> int:
    with _admin(settings) as connection:
        row = connection.execute(
            f"SELECT count(*) FROM {settings.schema}.{table_name} WHERE status = 'succeeded'"
        ).fetchone()
    return int(row[0]) if row else 0


def _drop(settings: Settings) -> None:
    with _admin(settings) as connection:
        connection.execute(f"DROP SCHEMA IF EXISTS {settings.schema} CASCADE")


# ---------------------------------------------------------------------- the store


async def run_store(settings: Settings, run: str, cycles: int, concurrency: int) -> Sample:
    """begin + complete through ``Journal`` on the PostgreSQL store."""
    await anyio.to_thread.run_sync(_empty, settings)
    async with await Journal.open(settings.location) as journal:
        store = journal.store
        if not isinstance(getattr(store, "commits", None), int):
            raise TypeError(f"expected the PostgreSQL store, which counts commits: {store!r}")
        cycle = journal_cycle(journal, f"pg-{run}", definition_digest("bench-postgres-v1"))
        before = store.commits
        seconds = await drive_cycles(cycle, cycles, concurrency)
        commits = store.commits - before
    found = await anyio.to_thread.run_sync(_count, settings, "records")
    check_count(found, cycles, "store")
    return Sample(cycles, seconds, commits=commits)


# ---------------------------------------------------------------------- the bare loop


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


class Bare:
    """begin and complete as the plain SQL on a pool, one worker-thread trip each."""

    def __init__(self, settings: Settings) -> None:
        self.table = f"{settings.schema}.bare"
        self.commits = 0
        self.owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process": "",
            "session": "",
            "started_at": _now(),
        }
        self.pool: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
            settings.url,
            min_size=1,
            max_size=settings.pool_size,
            open=False,
            kwargs={"autocommit": False},
        )

    def open(self) -> None:
        self.pool.open(wait=True)

    def close(self) -> None:
        self.pool.close()

    def _document(self, identity: tuple[str, ...], claim_id: str, **changes: object) -> bytes:
        """A document of the fields (and so about the size) of a journal record."""
        now = _now()
        document: dict[str, object] = {
            "version": 1,
            "identity": list(identity),
            "input_kind": "sha256",
            "input_hash": input_digest({"n": identity[3]}),
            "definition_hash": definition_digest("bench-bare-v1"),
            "claim_id": claim_id,
            "status": "started",
            "receipt": None,
            "attempt": 1,
            "created_at": now,
            "updated_at": now,
            "owner": self.owner,
            "review_reason": None,
            "history": [
                {"at": now, "attempt": 1, "event": "begin", "note": None, "status": "started"}
            ],
        }
        document.update(changes)
        return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()

    def begin(self, identity: tuple[str, ...]) -> tuple[str, str]:
        digest = identity_digest(identity)
        claim_id = secrets.token_hex(16)
        with self.pool.connection() as connection:
            row = connection.execute(
                f"SELECT status, document FROM {self.table} WHERE digest = %s FOR UPDATE",
                (digest,),
            ).fetchone()
            if row is not None:
                raise RuntimeError(f"{identity}: already there")
            cursor = connection.execute(
                f"INSERT INTO {self.table} (status, claim_id, document, digest) "
                "VALUES ('started', %s, %s, %s) ON CONFLICT (digest) DO NOTHING",
                (claim_id, self._document(identity, claim_id), digest),
            )
            if cursor.rowcount != 1:
                raise RuntimeError(f"{identity}: lost the insert")
            connection.commit()
        self.commits += 1
        return digest, claim_id

    def complete(self, identity: tuple[str, ...], digest: str, claim_id: str, receipt: str) -> None:
        with self.pool.connection() as connection:
            row = connection.execute(
                f"SELECT status, claim_id, document FROM {self.table} WHERE digest = %s FOR UPDATE",
                (digest,),
            ).fetchone()
            if row is None or row[0] != "started" or row[1] != claim_id:
                raise RuntimeError(f"{identity}: not started by this claim")
            now = _now()
            history = [
                {"at": now, "attempt": 1, "event": "begin", "note": None, "status": "started"},
                {"at": now, "attempt": 1, "event": "complete", "note": None, "status": "succeeded"},
            ]
            document = self._document(
                identity, claim_id, status="succeeded", receipt=receipt, history=history
            )
            connection.execute(
                f"UPDATE {self.table} SET status = 'succeeded', document = %s WHERE digest = %s",
                (document, digest),
            )
            connection.commit()
        self.commits += 1


def bare_cycle(bare: Bare, run: str, pool_size: int) -> CycleFunction:
    """A cycle of the bare SQL: one worker-thread trip per operation, at most
    ``pool_size`` trips at once, as the store makes them (one per pooled connection)."""
    threads = anyio.CapacityLimiter(pool_size)

    async def cycle(index: int) -> None:
        identity = ("bench", f"bare-{run}", "cycle", f"i{index}")
        digest, claim_id = await anyio.to_thread.run_sync(bare.begin, identity, limiter=threads)
        await anyio.to_thread.run_sync(
            bare.complete, identity, digest, claim_id, f"receipt-{index}", limiter=threads
        )

    return cycle


async def run_bare(settings: Settings, run: str, cycles: int, concurrency: int) -> Sample:
    """begin + complete as the bare SQL on a pool of the same size."""
    await anyio.to_thread.run_sync(_empty, settings)
    bare = Bare(settings)
    await anyio.to_thread.run_sync(bare.open)
    try:
        cycle = bare_cycle(bare, run, settings.pool_size)
        before = bare.commits
        seconds = await drive_cycles(cycle, cycles, concurrency)
        commits = bare.commits - before
    finally:
        await anyio.to_thread.run_sync(bare.close)
    found = await anyio.to_thread.run_sync(_count, settings, "bare")
    check_count(found, cycles, "bare")
    return Sample(cycles, seconds, commits=commits)


RUNNERS: dict[str, Callable[[Settings, str, int, int], Awaitable[Sample]]] = {
    "store": run_store,
    "bare": run_bare,
}


# ---------------------------------------------------------------------- driver


async def _run_round(round_index: int, settings: Settings) -> dict[tuple[str, int], Sample]:
    """One round on a fresh event loop: warm-up, then every (workload, concurrency) once."""
    for concurrency in CONCURRENCIES:
        warmup = min(settings.cycles_at(concurrency), max(32, 4 * concurrency))
        for workload, run in RUNNERS.items():
            await run(settings, f"w{round_index}-{workload}-{concurrency}", warmup, concurrency)
    runs = [(workload, c) for c in CONCURRENCIES for workload in WORKLOADS]
    if round_index % 2:
        runs.reverse()
    samples: dict[tuple[str, int], Sample] = {}
    for workload, concurrency in runs:
        cycles = settings.cycles_at(concurrency)
        sample = await RUNNERS[workload](
            settings, f"r{round_index}-{workload}-{concurrency}", cycles, concurrency
        )
        samples[workload, concurrency] = sample
        print(
            f"  round {round_index + 1}/{settings.rounds} {workload:<5} c={concurrency:<3} "
            f"{sample.rate:8.1f} cycles/s  ({cycles} cycles, {sample.seconds:.2f} s)  "
            f"{sample.commits_per_cycle:5.3f} commits/cycle",
            file=sys.stderr,
            flush=True,
        )
    return samples


def _run_all(settings: Settings) -> Results:
    results: Results = {(w, c): [] for c in CONCURRENCIES for w in WORKLOADS}
    _create_bare_table(settings)
    try:
        for round_index in range(settings.rounds):
            samples = anyio.run(_run_round, round_index, settings, backend=settings.backend)
            for key, sample in samples.items():
                results[key].append(sample)
    finally:
        _drop(settings)
    return results


def _report(settings: Settings, results: Results) -> bool:
    rows = [
        [
            workload,
            str(concurrency),
            f"{median([s.rate for s in results[workload, concurrency]]):.1f}",
            f"{median([s.commits_per_cycle for s in results[workload, concurrency]]):.3f}",
        ]
        for concurrency in CONCURRENCIES
        for workload in WORKLOADS
    ]

    def ratios(top: tuple[str, int], bottom: tuple[str, int]) -> list[float]:
        pairs = zip(results[top], results[bottom], strict=True)
        return [a.rate / b.rate for a, b in pairs]

    ratio_rows: list[list[str]] = []
    all_pass = True
    for concurrency in CONCURRENCIES:
        by = ratios(("store", concurrency), ("bare", concurrency))
        value = median(by)
        if concurrency == 64:
            goal, mark = "-", "(reference)"
        else:
            ok = value >= GOAL_RATIO
            all_pass = all_pass and ok
            goal, mark = f">= {GOAL_RATIO:.2f}", verdict(ok)
        ratio_rows.append(
            ["store / bare", str(concurrency), f"{value:.2f}", goal, mark, by_round(by)]
        )
    for workload in WORKLOADS:
        by = ratios((workload, 64), (workload, 16))
        value = median(by)
        if workload == "store":
            ok = value >= GOAL_SCALING
            all_pass = all_pass and ok
            goal, mark = f">= {GOAL_SCALING:.2f}", verdict(ok)
        else:
            goal, mark = "-", "(reference)"
        ratio_rows.append(
            [f"{workload} c=64 / c=16", "-", f"{value:.2f}", goal, mark, by_round(by)]
        )

    print(
        f"begin+complete cycles on {settings.backend}: {settings.cycles} cycles at concurrency "
        f"16 and 64, {settings.cycles_single} at concurrency 1, x {settings.rounds} rounds "
        f"(medians over rounds); pool_size={settings.pool_size} for both"
    )
    print(
        "bare: the same SELECT ... FOR UPDATE, INSERT ... ON CONFLICT DO NOTHING / UPDATE, "
        "COMMIT per operation,\non a psycopg_pool.ConnectionPool of the same size, one "
        "anyio worker-thread trip per operation"
    )
    print()
    print(table(["workload", "concurrency", "cycles/s", "commits/cycle"], rows))
    print()
    print(
        table(
            ["ratio (cycles/s)", "concurrency", "median", "goal", "verdict", "by round"],
            ratio_rows,
        )
    )
    print("ratios: each round's runs against each other, median over rounds")
    return all_pass


def _server_version(url: str) -> str:
    with psycopg.connect(url, autocommit=True) as connection:
        row = connection.execute("SHOW server_version").fetchone()
    return str(row[0]) if row else "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Journal PostgreSQL store vs a bare loop of the same SQL on the same pool."
    )
    parser.add_argument(
        "--url",
        default=None,
        help=f"the server, a postgresql:// URL (default: ${VARIABLES[0]}, else ${VARIABLES[1]})",
    )
    parser.add_argument(
        "--cycles", type=positive, default=2000, help="cycles per run at concurrency 16 and 64"
    )
    parser.add_argument(
        "--cycles-single", type=positive, default=500, help="cycles per run at concurrency 1"
    )
    parser.add_argument("--rounds", type=positive, default=3, help="rounds")
    parser.add_argument(
        "--pool-size",
        type=at_least(1),
        default=8,
        help="connections per pool (the store's default)",
    )
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument(
        "--strict", action="store_true", help="exit with status 1 when a goal is missed"
    )
    args = parser.parse_args(argv)
    url = args.url or next((os.environ[v] for v in VARIABLES if os.environ.get(v)), "")
    if not url:
        print(
            f"bench_postgres: no server given (--url, or ${VARIABLES[0]} / ${VARIABLES[1]}); "
            "nothing measured",
            file=sys.stderr,
        )
        return 0
    if "schema=" in urllib.parse.urlsplit(url).query or "pool_size=" in url:
        parser.error("the URL names the server only: the benchmark picks schema and pool_size")
    settings = Settings(
        url=url,
        schema=f"ijbench_{os.getpid()}_{secrets.token_hex(4)}",
        pool_size=args.pool_size,
        cycles=args.cycles,
        cycles_single=args.cycles_single,
        rounds=args.rounds,
        backend=args.backend,
    )
    environment = (
        f"python {platform.python_version()}, PostgreSQL {_server_version(url)}, "
        f"psycopg {package_version('psycopg')}, psycopg-pool {package_version('psycopg-pool')}, "
        f"anyio {package_version('anyio')}, {os.cpu_count()} CPUs; server {without_password(url)}, "
        f"schema {settings.schema}"
    )
    print(environment, file=sys.stderr, flush=True)
    started = time.perf_counter()
    results = _run_all(settings)
    print(file=sys.stderr)
    print(environment)
    all_pass = _report(settings, results)
    print(f"\ntotal {time.perf_counter() - started:.1f} s")
    return 1 if args.strict and not all_pass else 0


if __name__ == "__main__":
    sys.exit(main())
