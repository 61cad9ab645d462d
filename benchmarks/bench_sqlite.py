"""SQLite store (group commit) against a plain aiosqlite journal, and the file store.

Three workloads run side by side in one process, at ``--concurrency`` tasks (16) and
at one task, each measured as begin + complete cycles per second, every cycle on a new
identity (begin grants a claim, complete moves the record to ``succeeded``):

``sqlite``
    ``Journal.open(f"sqlite://{dir}/j.db")``: the itemjournal SQLite store, which
    commits the operations that queue up while a commit is in flight as one
    transaction (group commit).

``aiosqlite``
    The peer: a claim journal written the ordinary way with aiosqlite. One shared
    connection (WAL, ``synchronous=FULL``, a busy timeout), ONE transaction per
    operation, the same claim semantics:

    * begin: ``BEGIN IMMEDIATE`` → read the row of the identity digest → refuse when
      it is present and not reusable (a succeeded record with the same fingerprints is
      reused; a released one is claimed again) → else INSERT a ``started`` row with a
      claim id and a JSON document of the same shape and size as a journal record
      (about 690 B) → COMMIT;
    * complete: ``BEGIN IMMEDIATE`` → read the row → check status ``started`` and the
      claim id → UPDATE to ``succeeded`` with the receipt (document rewritten, about
      820 B) → COMMIT.

    Each statement is one aiosqlite call (one trip to its worker thread). Because all
    tasks share one connection, an ``anyio.Lock`` is held from ``BEGIN`` to ``COMMIT``
    so that two tasks never interleave statements inside one transaction; any real
    application sharing a connection has to do the same.

``file``
    ``Journal.open(dir)``: the file store, for reference (4 fsyncs per cycle).

Everything runs on asyncio, because aiosqlite is asyncio-only; the journal stores
would also run on trio, but then the comparison would mix event loops.

Every round opens a new event loop, warms every workload up (not recorded), then runs
each workload at both concurrencies in a fresh directory; the order of the runs is
reversed every other round. The table shows medians over rounds; the ratios are taken
within a round (a run against its neighbour run of the same round) and then the median:
sqlite/aiosqlite at the high concurrency (goal >= 2.0, aim 3.0) and at one task
(goal >= 1.0), and sqlite/file for reference. It also counts the commits the SQLite
store made per cycle (``journal.store.commits``): 2.0 means no grouping at all.

Run: ``.venv/bin/python benchmarks/bench_sqlite.py [--cycles N] [--cycles-single N]
[--rounds R]`` (needs the ``bench`` extra: ``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import secrets
import socket
import sqlite3
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiosqlite
import anyio
import anyio.to_thread
from _common import (
    Sample,
    add_common_arguments,
    at_least,
    by_round,
    check_count,
    drive_cycles,
    journal_cycle,
    median,
    package_version,
    positive,
    run_benchmark,
    run_directory,
    table,
    verdict,
)

from itemjournal import Journal, SQLiteStore, definition_digest

BACKEND = "asyncio"  # aiosqlite runs on asyncio only
STORES = ("sqlite", "aiosqlite", "file")
GOAL_GROUPED = 2.0  # sqlite/aiosqlite at the high concurrency
AIM_GROUPED = 3.0
GOAL_SINGLE = 1.0  # sqlite/aiosqlite at one task
BUSY_TIMEOUT_MS = 30_000


# ---------------------------------------------------------------------- measurement


# ---------------------------------------------------------------------- the journal stores


def _count_sqlite_succeeded(path: str) -> int:
    connection = sqlite3.connect(path)
    try:
        row = connection.execute(
            "SELECT count(*) FROM itemjournal_records WHERE status = 'succeeded'"
        ).fetchone()
        return int(row[0])
    finally:
        connection.close()


_RECORD_NAME = re.compile(r"[0-9a-f]{64}\.json")


def _count_files(root: str) -> int:
    """Record files only (``<sha256>.json``), not the store's settings document."""
    return sum(1 for _, _, names in os.walk(root) for name in names if _RECORD_NAME.fullmatch(name))


async def _journal_cycles(journal: Journal, kind: str, cycles: int, concurrency: int) -> float:
    cycle = journal_cycle(journal, kind, definition_digest(f"bench-{kind}-v1"))
    return await drive_cycles(cycle, cycles, concurrency)


async def run_sqlite(base: str, cycles: int, concurrency: int) -> Sample:
    """begin + complete through ``Journal`` on a fresh SQLite store."""
    async with run_directory(base, "sqlite-") as root:
        path = os.path.join(root, "j.db")
        async with await Journal.open(f"sqlite://{path}") as journal:
            store = journal.store
            if not isinstance(store, SQLiteStore):
                raise TypeError(f"expected the SQLite store, got {store!r}")
            before = store.commits
            seconds = await _journal_cycles(journal, "sqlite", cycles, concurrency)
            commits = store.commits - before
        found = await anyio.to_thread.run_sync(_count_sqlite_succeeded, path)
        check_count(found, cycles, "sqlite store")
        return Sample(cycles, seconds, commits=commits)


async def run_file(base: str, cycles: int, concurrency: int) -> Sample:
    """begin + complete through ``Journal`` on a fresh file store."""
    async with run_directory(base, "file-") as root:
        async with await Journal.open(root) as journal:
            seconds = await _journal_cycles(journal, "file", cycles, concurrency)
        found = await anyio.to_thread.run_sync(_count_files, root)
        check_count(found, cycles, "file store")
        return Sample(cycles, seconds, commits=None)


# ---------------------------------------------------------------------- the aiosqlite peer

_PEER_SCHEMA = """
CREATE TABLE IF NOT EXISTS claims (
    digest TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    claim_id TEXT NOT NULL,
    document BLOB NOT NULL
) WITHOUT ROWID
"""


def _sha256_json(value: object) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


class PeerRefused(Exception):
    """The peer's begin or complete found the record in a state that refuses it."""


@dataclass(frozen=True)
class PeerClaim:
    digest: str
    claim_id: str
    attempt: int


@dataclass(frozen=True)
class PeerReuse:
    receipt: str


class AiosqlitePeer:
    """A claim journal the way one would write it directly on aiosqlite."""

    def __init__(self, db: aiosqlite.Connection) -> None:
        self.db = db
        self.lock = anyio.Lock()  # one transaction at a time on the shared connection
        self.commits = 0
        self.owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": _now(),
        }

    @classmethod
    async def open(cls, path: str) -> AiosqlitePeer:
        db = await aiosqlite.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        try:
            await db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            rows = list(await db.execute_fetchall("PRAGMA journal_mode = WAL"))
            if str(rows[0][0]).lower() != "wal":
                raise RuntimeError(f"{path}: cannot switch to WAL (got {rows[0][0]})")
            await db.execute("PRAGMA synchronous = FULL")
            await db.execute(_PEER_SCHEMA)
        except BaseException:
            await db.close()
            raise
        return cls(db)

    async def aclose(self) -> None:
        await self.db.close()

    async def _rollback(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.db.rollback()

    async def begin(
        self, identity: tuple[str, ...], inputs: Mapping[str, str], definition: str
    ) -> PeerClaim | PeerReuse:
        digest = _sha256_json(list(identity))
        input_hash = _sha256_json(dict(inputs))
        claim_id = secrets.token_hex(16)
        async with self.lock:
            await self.db.execute("BEGIN IMMEDIATE")
            try:
                rows = list(
                    await self.db.execute_fetchall(
                        "SELECT status, document FROM claims WHERE digest = ?", (digest,)
                    )
                )
                now = _now()
                if rows:
                    status, raw = rows[0][0], rows[0][1]
                    old: dict[str, Any] = json.loads(raw)
                    same = old["input_hash"] == input_hash and old["definition_hash"] == definition
                    if status == "succeeded" and same:
                        await self.db.rollback()  # nothing written
                        return PeerReuse(str(old["receipt"]))
                    if status != "released":
                        raise PeerRefused(f"{identity}: {status}, cannot claim")
                    attempt = int(old["attempt"]) + 1
                    document = self._document(identity, input_hash, definition, claim_id, now)
                    document.update(attempt=attempt, created_at=old["created_at"])
                    document["history"] = [*old["history"], *document["history"]][-32:]
                    await self.db.execute(
                        "UPDATE claims SET status = 'started', claim_id = ?, document = ? "
                        "WHERE digest = ?",
                        (claim_id, json.dumps(document, sort_keys=True).encode(), digest),
                    )
                else:
                    attempt = 1
                    document = self._document(identity, input_hash, definition, claim_id, now)
                    await self.db.execute(
                        "INSERT INTO claims (digest, status, claim_id, document) "
                        "VALUES (?, 'started', ?, ?)",
                        (digest, claim_id, json.dumps(document, sort_keys=True).encode()),
                    )
                await self.db.commit()
                self.commits += 1
            except BaseException:
                await self._rollback()
                raise
        return PeerClaim(digest, claim_id, attempt)

    async def complete(self, claim: PeerClaim, receipt: str) -> dict[str, Any]:
        async with self.lock:
            await self.db.execute("BEGIN IMMEDIATE")
            try:
                rows = list(
                    await self.db.execute_fetchall(
                        "SELECT status, claim_id, document FROM claims WHERE digest = ?",
                        (claim.digest,),
                    )
                )
                if not rows or rows[0][1] != claim.claim_id:
                    raise PeerRefused("claim mismatch")
                if rows[0][0] != "started":
                    raise PeerRefused(f"not started: {rows[0][0]}")
                document: dict[str, Any] = json.loads(rows[0][2])
                now = _now()
                event = self._event(now, "complete", "succeeded", int(document["attempt"]))
                history = [*document["history"], event]
                document.update(
                    status="succeeded", receipt=receipt, updated_at=now, history=history[-32:]
                )
                await self.db.execute(
                    "UPDATE claims SET status = 'succeeded', document = ? WHERE digest = ?",
                    (json.dumps(document, sort_keys=True).encode(), claim.digest),
                )
                await self.db.commit()
                self.commits += 1
            except BaseException:
                await self._rollback()
                raise
        return document

    @staticmethod
    def _event(now: str, event: str, status: str, attempt: int) -> dict[str, Any]:
        return {"at": now, "attempt": attempt, "event": event, "note": None, "status": status}

    def _document(
        self,
        identity: tuple[str, ...],
        input_hash: str,
        definition: str,
        claim_id: str,
        now: str,
    ) -> dict[str, Any]:
        """A started record of the same fields (and so about the size) as a journal record."""
        return {
            "version": 1,
            "identity": list(identity),
            "input_kind": "sha256",
            "input_hash": input_hash,
            "definition_hash": definition,
            "claim_id": claim_id,
            "status": "started",
            "receipt": None,
            "attempt": 1,
            "created_at": now,
            "updated_at": now,
            "owner": self.owner,
            "review_reason": None,
            "history": [self._event(now, "begin", "started", 1)],
        }


async def run_aiosqlite(base: str, cycles: int, concurrency: int) -> Sample:
    """begin + complete through the aiosqlite peer on a fresh database."""
    async with run_directory(base, "aiosqlite-") as root:
        peer = await AiosqlitePeer.open(os.path.join(root, "peer.db"))
        try:
            definition = definition_digest("bench-aiosqlite-v1")

            async def cycle(index: int) -> None:
                identity = ("bench", "aiosqlite", "cycle", f"i{index}")
                claim = await peer.begin(identity, {"n": str(index)}, definition)
                if not isinstance(claim, PeerClaim):
                    raise TypeError(f"expected a fresh claim for {identity}, got {claim!r}")
                await peer.complete(claim, f"receipt-{index}")

            before = peer.commits
            seconds = await drive_cycles(cycle, cycles, concurrency)
            commits = peer.commits - before
            rows = list(
                await peer.db.execute_fetchall(
                    "SELECT count(*) FROM claims WHERE status = 'succeeded'"
                )
            )
            check_count(int(rows[0][0]), cycles, "aiosqlite peer")
        finally:
            await peer.aclose()
        return Sample(cycles, seconds, commits=commits)


WORKLOADS: dict[str, Callable[[str, int, int], Awaitable[Sample]]] = {
    "sqlite": run_sqlite,
    "aiosqlite": run_aiosqlite,
    "file": run_file,
}


# ---------------------------------------------------------------------- driver


@dataclass
class Settings:
    cycles: int  # at the high concurrency
    cycles_single: int  # at one task
    concurrency: int
    rounds: int
    base: str

    def cycles_at(self, concurrency: int) -> int:
        return self.cycles_single if concurrency == 1 else self.cycles

    @property
    def concurrencies(self) -> tuple[int, int]:
        return (self.concurrency, 1)


Results = dict[tuple[str, int], list[Sample]]


async def _run_round(round_index: int, settings: Settings) -> dict[tuple[str, int], Sample]:
    """One round on a fresh event loop: warm-up, then every (store, concurrency) once."""
    for concurrency in settings.concurrencies:
        warmup = min(settings.cycles_at(concurrency), max(16, 4 * concurrency))
        for run in WORKLOADS.values():
            await run(settings.base, warmup, concurrency)
    runs = [(store, c) for c in settings.concurrencies for store in STORES]
    if round_index % 2:
        runs.reverse()
    samples: dict[tuple[str, int], Sample] = {}
    for store, concurrency in runs:
        cycles = settings.cycles_at(concurrency)
        sample = await WORKLOADS[store](settings.base, cycles, concurrency)
        samples[store, concurrency] = sample
        commits = (
            "" if sample.commits is None else f"  {sample.commits_per_cycle:5.3f} commits/cycle"
        )
        print(
            f"  round {round_index + 1}/{settings.rounds} {store:<9} c={concurrency:<3} "
            f"{sample.rate:8.1f} cycles/s  ({cycles} cycles, {sample.seconds:.2f} s){commits}",
            file=sys.stderr,
            flush=True,
        )
    return samples


def _run_all(settings: Settings) -> Results:
    results: Results = {(store, c): [] for c in settings.concurrencies for store in STORES}
    for round_index in range(settings.rounds):
        samples = anyio.run(_run_round, round_index, settings, backend=BACKEND)
        for key, sample in samples.items():
            results[key].append(sample)
    return results


def _report(settings: Settings, results: Results) -> bool:
    rows: list[list[str]] = []
    for concurrency in settings.concurrencies:
        for store in STORES:
            samples = results[store, concurrency]
            per_cycle = median([sample.commits_per_cycle for sample in samples])
            rows.append(
                [
                    store,
                    str(concurrency),
                    f"{median([sample.rate for sample in samples]):.1f}",
                    "-" if math.isnan(per_cycle) else f"{per_cycle:.3f}",
                ]
            )

    def ratios(top: str, bottom: str, concurrency: int) -> list[float]:
        pairs = zip(results[top, concurrency], results[bottom, concurrency], strict=True)
        return [a.rate / b.rate for a, b in pairs]

    ratio_rows: list[list[str]] = []
    all_pass = True
    for concurrency in settings.concurrencies:
        goal = GOAL_GROUPED if concurrency != 1 else GOAL_SINGLE
        ratios_by_round = ratios("sqlite", "aiosqlite", concurrency)
        value = median(ratios_by_round)
        ok = value >= goal
        all_pass = all_pass and ok
        aim = ""
        if concurrency != 1:
            aim = f">= {AIM_GROUPED:.1f}: {'met' if value >= AIM_GROUPED else 'not met'}"
        ratio_rows.append(
            [
                "sqlite / aiosqlite",
                str(concurrency),
                f"{value:.2f}",
                f">= {goal:.1f}",
                verdict(ok),
                by_round(ratios_by_round),
                aim,
            ]
        )
    for concurrency in settings.concurrencies:
        ratios_by_round = ratios("sqlite", "file", concurrency)
        ratio_rows.append(
            [
                "sqlite / file",
                str(concurrency),
                f"{median(ratios_by_round):.2f}",
                "-",
                "(reference)",
                by_round(ratios_by_round),
                "",
            ]
        )

    print(
        f"begin+complete cycles on {BACKEND}: {settings.cycles} cycles at concurrency "
        f"{settings.concurrency}, {settings.cycles_single} at concurrency 1, "
        f"x {settings.rounds} rounds (medians over rounds)"
    )
    print(
        "aiosqlite peer: one shared connection (WAL, synchronous=FULL, busy timeout), "
        "one BEGIN IMMEDIATE..COMMIT per operation,\n"
        "serialised by an anyio.Lock so tasks never interleave inside a transaction "
        "on the shared connection"
    )
    print()
    print(table(["store", "concurrency", "cycles/s", "commits/cycle"], rows))
    print()
    print(
        table(
            ["ratio (cycles/s)", "concurrency", "median", "goal", "verdict", "by round", "aim"],
            ratio_rows,
        )
    )
    print(
        "ratios: each round's runs against each other, median over rounds; "
        "commits/cycle 2.000 means no grouping"
    )
    return all_pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Journal SQLite store vs a plain aiosqlite journal (and the file store)."
    )
    parser.add_argument(
        "--cycles", type=positive, default=2000, help="cycles per run at the high concurrency"
    )
    parser.add_argument(
        "--cycles-single", type=positive, default=1000, help="cycles per run at concurrency 1"
    )
    parser.add_argument(
        "--concurrency", type=at_least(2), default=16, help="tasks per run (the high concurrency)"
    )
    parser.add_argument("--rounds", type=positive, default=3, help="rounds")
    add_common_arguments(parser)
    args = parser.parse_args(argv)

    def measure(base: str) -> tuple[Settings, Results]:
        settings = Settings(args.cycles, args.cycles_single, args.concurrency, args.rounds, base)
        return settings, _run_all(settings)

    versions = {
        "SQLite": sqlite3.sqlite_version,
        "aiosqlite": package_version("aiosqlite"),
        "anyio": package_version("anyio"),
    }
    return run_benchmark(
        args.dir, versions, measure, lambda done: _report(*done), strict=args.strict
    )


if __name__ == "__main__":
    sys.exit(main())
