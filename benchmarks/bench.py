"""Every store next to its limit and its peers, at scale, in one run: one table, one JSON.

Run: ``make bench`` (full) or ``make bench-quick`` (under a minute), or
``.venv/bin/python benchmarks/bench.py [--quick] [--rounds R] [--json PATH] [--strict]``.
PostgreSQL is measured when ``--postgres-url``, ``$ITEMJOURNAL_BENCH_POSTGRES`` or
``$ITEMJOURNAL_TEST_POSTGRES`` names a server, and skipped with a notice otherwise.
See ``benchmarks/README.md`` for what each row means.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import _limits
import _peers
import _scale
import _stores
import anyio
import instructions
from _common import (
    Env,
    Runner,
    Sample,
    environment_line,
    median,
    package_version,
    peak_rss_mb,
    pick_base,
    positive,
    table,
    verdict,
    without_password,
)

Setting = tuple[str, int]  # (event loop, concurrency), or (THREADS, threads)
THREADS = "threads"  # the blocking face: threads sharing one itemjournal.sync.Journal
ALL_SETTINGS: tuple[Setting, ...] = (
    ("asyncio", 1),
    ("asyncio", 4),
    ("asyncio", 16),
    ("asyncio", 64),
    ("trio", 16),
)
PEER_SETTINGS: tuple[Setting, ...] = (("asyncio", 1), ("asyncio", 16), ("asyncio", 64))
C16: tuple[Setting, ...] = (("asyncio", 16), ("trio", 16))
T16: tuple[Setting, ...] = ((THREADS, 16),)
POSTGRES_VARIABLES = ("ITEMJOURNAL_BENCH_POSTGRES", "ITEMJOURNAL_TEST_POSTGRES")
WARMUP_CYCLES = 16  # per workload, once per event loop, at concurrency 4: not recorded
DEFAULT_JSON = Path(__file__).resolve().parent / "out" / "results.json"


@dataclass(frozen=True)
class Workload:
    name: str
    group: str  # "store", "limit", "ceiling" or "peer"
    runner: Runner
    settings: tuple[Setting, ...]
    needs_postgres: bool = False
    # For the blocking face's workloads: the async workload it runs beside, whose row it
    # follows in the table and against which its ratio is taken.
    beside: str | None = None


WORKLOADS: tuple[Workload, ...] = (
    Workload("memory store", "store", _stores.run_memory, ALL_SETTINGS),
    Workload("file store sync", "store", _stores.run_file_sync, T16, beside="file store"),
    Workload("file store", "store", _stores.run_file, ALL_SETTINGS),
    Workload("file limit", "limit", _limits.run_file_limit, ALL_SETTINGS),
    Workload("file saves", "limit", _limits.run_file_saves, C16),
    Workload("file ceiling", "ceiling", _limits.run_file_ceiling, C16),
    Workload("sqlite store sync", "store", _stores.run_sqlite_sync, T16, beside="sqlite store"),
    Workload("sqlite store", "store", _stores.run_sqlite, ALL_SETTINGS),
    Workload("sqlite limit", "limit", _limits.run_sqlite_limit, ALL_SETTINGS),
    Workload("sqlite ceiling", "ceiling", _limits.run_sqlite_ceiling, C16),
    Workload("postgres store", "store", _stores.run_postgres, ALL_SETTINGS, True),
    Workload("postgres limit", "limit", _limits.run_postgres_limit, ALL_SETTINGS, True),
    Workload("postgres ceiling", "ceiling", _limits.run_postgres_ceiling, C16, True),
    Workload("lean sqlite peer", "peer", _peers.run_lean, PEER_SETTINGS),
    Workload("aiosqlite peer", "peer", _peers.run_aiosqlite, PEER_SETTINGS),
    Workload("serialised peer", "peer", _peers.run_serial, PEER_SETTINGS),
    Workload("serialised on loop", "peer", _peers.run_serial_on_loop, PEER_SETTINGS),
    Workload("aiofiles peer", "peer", _peers.run_aiofiles, PEER_SETTINGS),
    Workload("idempotency pkg", "peer", _peers.run_idempotency, PEER_SETTINGS),
)
# Workloads that run next to each other, in reverse order every other round (the SQLite
# limit always after the store: it replays the store's batch sizes of that very run; the
# blocking face's SQLite run, which leaves no batch sizes, goes before or after the store).
NEIGHBOURS = (
    ("file store sync", "file store", "file limit", "file saves", "file ceiling"),
    ("sqlite store sync", "sqlite store"),
    ("postgres store", "postgres limit", "postgres ceiling"),
)


@dataclass(frozen=True)
class Plan:
    quick: bool
    rounds: int
    cycles: dict[int, int]  # concurrency -> cycles per run
    sizes: tuple[int, ...]  # scale: record counts
    scale_cycles: int  # c1 cycles measured at each size
    memory: tuple[int, int]  # RSS read after this many cycles, then after this many

    def runs(self, workload: Workload) -> tuple[Setting, ...]:
        """The settings a workload runs at: a quick run measures the peers at c1 and c16."""
        if self.quick and workload.group == "peer":
            return tuple(s for s in workload.settings if s[1] != 64)
        return workload.settings


def make_plan(quick: bool, rounds: int | None) -> Plan:
    if quick:
        return Plan(
            True, rounds or 1, {1: 30, 4: 80, 16: 160, 64: 192}, (0, 5_000), 40, (1_000, 3_000)
        )
    return Plan(
        False,
        rounds or 3,
        {1: 200, 4: 500, 16: 1000, 64: 1500},
        (0, 10_000, 100_000),
        300,
        (10_000, 100_000),
    )


Key = tuple[str, str, int]  # (workload, event loop, concurrency)


@dataclass
class Results:
    samples: dict[Key, list[Sample]] = field(default_factory=dict)
    scale: list[_scale.ScalePoint] = field(default_factory=list)
    memory: _scale.MemoryGrowth | None = None
    sqlite_statements_same: bool | None = None
    file_calls_same: bool | None = None
    skipped: list[str] = field(default_factory=list)
    # callgrind's instructions per begin + complete on MemoryStore, and the floor's
    instructions: dict[str, float] | None = None


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _host(setting: Setting) -> str:
    """The event loop whose turn a setting runs in: the blocking face's threads run in
    asyncio's, beside its tasks at the same concurrency (they use no event loop)."""
    return "asyncio" if setting[0] == THREADS else setting[0]


def _label(setting: Setting) -> str:
    kind, concurrency = setting
    return f"sync, {concurrency} threads" if kind == THREADS else f"{kind} c{concurrency}"


# ---------------------------------------------------------------------- running


def _order(workloads: list[Workload], round_index: int) -> list[Workload]:
    if round_index % 2 == 0:
        return workloads
    names = [w.name for w in workloads]
    for neighbours in NEIGHBOURS:
        places = [i for i, name in enumerate(names) if name in neighbours]
        for place, name in zip(places, reversed([names[i] for i in places]), strict=True):
            names[place] = name
    by_name = {w.name: w for w in workloads}
    return [by_name[name] for name in names]


async def _run_backend(
    env: Env, plan: Plan, workloads: list[Workload], round_index: int, results: Results
) -> None:
    """Every workload at every concurrency of this event loop: warm-up, then measured.

    The blocking face's threads run in asyncio's turn, each run next to the async runs of
    the same concurrency."""
    slots = dict.fromkeys((_host(s), s[1]) for w in workloads for s in plan.runs(w))
    for host, concurrency in slots:
        if host != env.backend:
            continue
        here = [
            (w, s)
            for w in _order(workloads, round_index)
            for s in plan.runs(w)
            if (_host(s), s[1]) == (host, concurrency)
        ]
        if round_index == 0 and (host, concurrency) == next(
            s for s in ALL_SETTINGS if s[0] == env.backend
        ):
            for workload in workloads:  # warm-up: threads, caches, imports; not recorded
                if any(_host(s) == env.backend for s in workload.settings):
                    await workload.runner(env, WARMUP_CYCLES, 4)
        for workload, setting in here:
            cycles = plan.cycles[concurrency]
            sample = await workload.runner(env, cycles, concurrency)
            results.samples.setdefault((workload.name, *setting), []).append(sample)
            commits = (
                "" if sample.commits is None else f"  {sample.commits_per_cycle:.3f} commits/cycle"
            )
            _log(
                f"  round {round_index + 1}/{plan.rounds} {setting[0]:<7} c={concurrency:<3}"
                f"{workload.name:<20} {sample.rate:8.1f} cycles/s  p50 {sample.p50_ms:7.2f} ms"
                f"  p99 {sample.p99_ms:7.2f} ms  lag p99 {sample.lag_p99_ms:7.2f} ms"
                f"  CPU {sample.cpu_us:6.0f} µs/cycle{commits}"
            )


async def _run_scale(env: Env, plan: Plan, kinds: list[str], results: Results) -> None:
    for kind in kinds:
        async with _scale.scale_location(env, kind) as location:
            results.scale += await _scale.run_scale(
                env, kind, location, plan.sizes, plan.scale_cycles, _log
            )
    first, total = plan.memory
    results.memory = await _scale.run_memory(env, "sqlite", first, total)
    _log(
        f"  memory sqlite: {results.memory.rss_first_mb:.1f} MB after {first:,} cycles, "
        f"{results.memory.rss_total_mb:.1f} MB after {total:,}"
    )


def run_all(base: str, plan: Plan, postgres_url: str | None) -> Results:
    started = time.perf_counter()
    results = Results()
    workloads = [w for w in WORKLOADS if postgres_url is not None or not w.needs_postgres]
    notes: dict[str, object] = {}
    for round_index in range(plan.rounds):
        backends = ("asyncio", "trio") if round_index % 2 == 0 else ("trio", "asyncio")
        for backend in backends:
            env = Env(base, backend, postgres_url, notes)
            anyio.run(_run_backend, env, plan, workloads, round_index, results, backend=backend)
    results.sqlite_statements_same = _limits.same_statements(Env(base, "asyncio", None, notes))
    results.file_calls_same = _limits.file_calls_same(base)
    _log(f"  throughput runs done at {time.perf_counter() - started:.1f} s")
    kinds = ["file", "sqlite"] + (["postgres"] if postgres_url else [])
    env = Env(base, "asyncio", postgres_url, notes)
    anyio.run(_run_scale, env, plan, kinds, results, backend="asyncio")
    return results


# ---------------------------------------------------------------------- report


def _fmt(value: float, digits: int = 2) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


@dataclass(frozen=True)
class Goal:
    name: str
    value: float
    goal: str
    ok: bool | None  # None: not measured
    by_round: list[float]
    note: str = ""


def _ratios(
    results: Results, top: Key, bottom: Key, what: Callable[[Sample], float]
) -> list[float]:
    pairs = zip(results.samples.get(top, []), results.samples.get(bottom, []), strict=False)
    return [what(a) / what(b) if what(b) > 0 else math.inf for a, b in pairs]


def _rate(sample: Sample) -> float:
    return sample.rate


def _lag(sample: Sample) -> float:
    return sample.lag_p99_ms


def goals(results: Results, plan: Plan) -> list[Goal]:
    found: list[Goal] = []

    def ratio_goal(
        name: str,
        top: Key,
        bottom: Key,
        minimum: float | None,
        maximum: float | None,
        *,
        what: Callable[[Sample], float] = _rate,
        beside: Key | None = None,
        ceiling: Key | None = None,
    ) -> None:
        by = _ratios(results, top, bottom, what)
        if not by:
            return
        value = median(by)
        notes: list[str] = []
        if beside is not None:  # the same ratio against a reference workload, for the note
            against = _ratios(results, top, beside, what)
            if against:
                notes.append(f"against the {beside[0]} alone: {median(against):.2f}")
        if ceiling is not None:  # what the journal's own work leaves, and the store of that
            most = _ratios(results, ceiling, bottom, what)
            ours = _ratios(results, top, ceiling, what)
            if most and ours:
                notes.append(
                    f"{ceiling[0]} / {bottom[0]}: {median(most):.2f}; "
                    f"store / {ceiling[0]}: {median(ours):.2f}"
                )
        note = "; ".join(notes)
        if minimum is not None:
            found.append(Goal(name, value, f">= {minimum:g}", value >= minimum, by, note))
        elif maximum is not None:
            found.append(Goal(name, value, f"<= {maximum:g}", value <= maximum, by, note))

    c16 = ("asyncio", 16)
    ratio_goal(
        "file store / file limit, cycles/s, asyncio c16",
        ("file store", *c16),
        ("file limit", *c16),
        0.8,
        None,
        beside=("file saves", *c16),
        ceiling=("file ceiling", *c16),
    )
    ratio_goal(
        "file store / file limit, cycles/s, trio c16",
        ("file store", "trio", 16),
        ("file limit", "trio", 16),
        0.8,
        None,
        beside=("file saves", "trio", 16),
        ceiling=("file ceiling", "trio", 16),
    )
    ratio_goal(
        "file store / file limit, lag p99, asyncio c16",
        ("file store", *c16),
        ("file limit", *c16),
        None,
        1.5,
        what=_lag,
        beside=("file saves", *c16),
        ceiling=("file ceiling", *c16),
    )
    ratio_goal(
        "sqlite store / lean peer, cycles/s, c16",
        ("sqlite store", *c16),
        ("lean sqlite peer", *c16),
        3.0,
        None,
        ceiling=("sqlite ceiling", *c16),
    )
    ratio_goal(
        "sqlite store / lean peer, cycles/s, c1",
        ("sqlite store", "asyncio", 1),
        ("lean sqlite peer", "asyncio", 1),
        1.2,
        None,
    )
    ratio_goal(
        "sqlite store / sqlite limit, cycles/s, c16",
        ("sqlite store", *c16),
        ("sqlite limit", *c16),
        0.5,
        None,
        ceiling=("sqlite ceiling", *c16),
    )
    ratio_goal(
        "postgres store / postgres limit, cycles/s, c16",
        ("postgres store", *c16),
        ("postgres limit", *c16),
        0.9,
        None,
        ceiling=("postgres ceiling", *c16),
    )
    if results.instructions is not None:
        count = results.instructions["journal"]
        floor = results.instructions["floor"]
        found.append(
            Goal(
                "memory store: instructions per cycle (callgrind)",
                count,
                f"<= {instructions.GOAL:,}",
                count <= instructions.GOAL,
                [count],
                f"{count / floor:.2f} x the floor's {floor:,.0f}",
            )
        )
        sync = results.instructions.get("sync")
        if sync is not None:  # the blocking face drops the event loop: it must not cost more
            found.append(
                Goal(
                    "memory store: sync face / async face, instructions per cycle",
                    sync / count,
                    "<= 1",
                    sync <= count,
                    [sync / count],
                    f"{sync:,.0f} against {count:,.0f}",
                )
            )

    largest = plan.sizes[-1]
    size_note = "" if largest == 100_000 else f"at {largest:,} records, not 100,000"
    by_store: dict[str, list[_scale.ScalePoint]] = {}
    for point in results.scale:
        by_store.setdefault(point.store, []).append(point)
    for store, points in by_store.items():
        empty, full = points[0], points[-1]
        value = full.cycles.p50_ms / empty.cycles.p50_ms
        found.append(
            Goal(
                f"{store}: cycle p50 at {full.records:,} / at {empty.records:,}",
                value,
                "<= 1.2",
                value <= 1.2,
                [value],
                size_note,
            )
        )
        if store == "file":
            found.append(
                Goal(
                    f"file: sweep at {full.records:,} records, s",
                    full.sweep_s,
                    "<= 3",
                    full.sweep_s <= 3.0,
                    [full.sweep_s],
                    size_note,
                )
            )
        if store == "sqlite":
            ms = full.sweep_s * 1000
            found.append(
                Goal(
                    f"sqlite: sweep at {full.records:,} records, ms",
                    ms,
                    "<= 50",
                    ms <= 50,
                    [ms],
                    size_note,
                )
            )
        if full.viewer_ms is not None:
            found.append(
                Goal(
                    f"{store}: viewer first page at {full.records:,} records, ms",
                    full.viewer_ms,
                    "<= 100",
                    full.viewer_ms <= 100,
                    [full.viewer_ms],
                    size_note,
                )
            )
    if results.memory is not None:
        memory = results.memory
        note = (
            ""
            if (memory.first, memory.total) == (10_000, 100_000)
            else (f"{memory.first:,} to {memory.total:,} cycles, not 10,000 to 100,000")
        )
        found.append(
            Goal(
                f"{memory.store}: RSS growth, MB",
                memory.growth_mb,
                "<= 5",
                memory.growth_mb <= 5,
                [memory.growth_mb],
                note,
            )
        )
    return found


def sync_ratios(results: Results) -> list[Goal]:
    """The blocking face against the async one on the same store, each with no target:
    its threads' cycles/s over the async face's tasks' at the same concurrency (asyncio),
    run next to each other in each round; the note gives the same ratio of p50, p99 and
    CPU per cycle."""
    found: list[Goal] = []
    for workload in WORKLOADS:
        if workload.beside is None:
            continue
        for setting in workload.settings:
            top: Key = (workload.name, *setting)
            bottom: Key = (workload.beside, _host(setting), setting[1])
            by = _ratios(results, top, bottom, _rate)
            if not by:
                continue
            parts = {
                "p50": _ratios(results, top, bottom, lambda s: s.p50_ms),
                "p99": _ratios(results, top, bottom, lambda s: s.p99_ms),
                "CPU per cycle": _ratios(results, top, bottom, lambda s: s.cpu_us),
            }
            note = ", ".join(f"{name} {median(values):.2f}" for name, values in parts.items())
            found.append(
                Goal(
                    f"{workload.name} / {workload.beside}, cycles/s, "
                    f"{setting[1]} threads / {_host(setting)} c{setting[1]}",
                    median(by),
                    "-",
                    None,
                    by,
                    f"{note} of the async face's",
                )
            )
    return found


def _in_table_order() -> list[Workload]:
    """``WORKLOADS``, each blocking-face workload right after the async one it runs beside."""
    ordered: list[Workload] = []
    for workload in WORKLOADS:
        if workload.beside is None:
            ordered.append(workload)
            ordered += [w for w in WORKLOADS if w.beside == workload.name]
    return ordered


def _table_rows(results: Results, plan: Plan) -> list[list[str]]:
    rows: list[list[str]] = []
    for workload in _in_table_order():
        for setting in workload.settings:
            samples = results.samples.get((workload.name, *setting))
            if not samples:
                continue
            per_cycle = median([s.commits_per_cycle for s in samples])
            rows.append(
                [
                    workload.group,
                    workload.name,
                    _label(setting),
                    _fmt(median([s.rate for s in samples]), 1),
                    _fmt(median([s.p50_ms for s in samples])),
                    _fmt(median([s.p99_ms for s in samples])),
                    _fmt(median([s.lag_p99_ms for s in samples])),
                    _fmt(median([s.cpu_us for s in samples]), 0),
                    _fmt(per_cycle, 3),
                    "",
                ]
            )
    for point in results.scale:
        viewer = "" if point.viewer_ms is None else f"; viewer first page {point.viewer_ms:.1f} ms"
        rows.append(
            [
                "scale",
                f"{point.store} store",
                f"{point.records:,} records",
                _fmt(point.cycles.rate, 1),
                _fmt(point.cycles.p50_ms),
                _fmt(point.cycles.p99_ms),
                _fmt(point.cycles.lag_p99_ms),
                _fmt(point.cycles.cpu_us, 0),
                "-",
                f"open {point.open_s * 1000:.1f} ms; sweep {point.sweep_s * 1000:.1f} ms; "
                f"needs_review list {point.listing_s * 1000:.1f} ms "
                f"({point.listed:,} of {point.seeded_review:,}){viewer}",
            ]
        )
    if results.memory is not None:
        memory = results.memory
        rows.append(
            [
                "memory",
                f"{memory.store} store",
                "asyncio c16",
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                f"RSS {memory.rss_first_mb:.1f} MB after {memory.first:,} cycles, "
                f"{memory.rss_total_mb:.1f} MB after {memory.total:,}: "
                f"growth {memory.growth_mb:+.1f} MB",
            ]
        )
    peak = f"peak RSS {peak_rss_mb():.1f} MB"
    rows.append(["memory", "whole run", "-", "-", "-", "-", "-", "-", "-", peak])
    return rows


HEADERS = [
    "group",
    "workload",
    "setting",
    "cycles/s",
    "p50 ms",
    "p99 ms",
    "lag p99 ms",
    "CPU µs/cycle",
    "commits/cycle",
    "notes",
]


def report(
    results: Results, plan: Plan, environment: str, seconds: float
) -> tuple[bool, dict[str, object]]:
    print(environment)
    print(
        f"{'quick' if plan.quick else 'full'} run: {plan.rounds} round(s); cycles per run "
        + ", ".join(f"c{c}: {n}" for c, n in plan.cycles.items())
        + "; figures are medians over rounds, ratios taken within a round"
    )
    for skipped in results.skipped:
        print(f"skipped: {skipped}")
    same = results.sqlite_statements_same
    print(
        "sqlite limit statements vs the store's traced batch: "
        + {True: "same", False: "DIFFERENT (the store's SQL changed)", None: "not checked"}[same]
    )
    print(
        "file limit system calls vs a traced store cycle: "
        + {
            True: "same",
            False: "DIFFERENT (the store's system calls changed)",
            None: "not checked",
        }[results.file_calls_same]
    )
    print()
    rows = _table_rows(results, plan)
    print(table(HEADERS, rows))
    print()
    found = goals(results, plan)
    goal_rows = [
        [
            g.name,
            _fmt(g.value),
            g.goal,
            "-" if g.ok is None else verdict(g.ok),
            " ".join(_fmt(v) for v in g.by_round),
            g.note,
        ]
        for g in found
    ]
    print(table(["goal", "value", "target", "verdict", "by round", "note"], goal_rows))
    ratios = sync_ratios(results)
    if ratios:
        print()
        ratio_rows = [
            [r.name, _fmt(r.value), " ".join(_fmt(v) for v in r.by_round), r.note] for r in ratios
        ]
        print(table(["sync face / async face (no goal)", "value", "by round", "note"], ratio_rows))
    print(
        "idempotency pkg: one guarded call per cycle (it has no separate begin and complete) "
        "and no fsync"
    )
    print(f"\ntotal {seconds:.1f} s")
    all_pass = all(g.ok is not False for g in found)
    document: dict[str, object] = {
        "environment": environment,
        "plan": asdict(plan),
        "seconds": seconds,
        "sqlite_limit_statements_same": same,
        "file_limit_calls_same": results.file_calls_same,
        "skipped": results.skipped,
        "runs": [
            {
                "workload": name,
                "backend": backend,
                "concurrency": concurrency,
                "rounds": [
                    {
                        "cycles": s.cycles,
                        "seconds": s.seconds,
                        "cycles_per_s": s.rate,
                        "p50_ms": _num(s.p50_ms),
                        "p99_ms": _num(s.p99_ms),
                        "lag_p99_ms": _num(s.lag_p99_ms),
                        "commits": s.commits,
                        "cpu_us_per_cycle": _num(s.cpu_us),
                    }
                    for s in samples
                ],
            }
            for (name, backend, concurrency), samples in results.samples.items()
        ],
        "scale": [
            {
                "store": p.store,
                "records": p.records,
                "open_s": p.open_s,
                "cycles_per_s": p.cycles.rate,
                "p50_ms": p.cycles.p50_ms,
                "p99_ms": p.cycles.p99_ms,
                "sweep_s": p.sweep_s,
                "needs_review_list_s": p.listing_s,
                "listed": p.listed,
                "seeded_needs_review": p.seeded_review,
                "viewer_first_page_ms": p.viewer_ms,
            }
            for p in results.scale
        ],
        "memory": None
        if results.memory is None
        else {**asdict(results.memory), "growth_mb": results.memory.growth_mb},
        "peak_rss_mb": peak_rss_mb(),
        "instructions_per_cycle": results.instructions,
        "goals": [{**asdict(g), "value": _num(g.value)} for g in found],
        "sync_ratios": [{**asdict(r), "value": _num(r.value)} for r in ratios],
        "table": {"headers": HEADERS, "rows": rows},
    }
    return all_pass, document


def _num(value: float) -> float | None:
    return None if math.isnan(value) or math.isinf(value) else value


# ---------------------------------------------------------------------- command line


def _source() -> str:
    """The commit measured, and whether ``src/`` had changes not committed yet."""
    import subprocess

    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=False
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "itemjournal (not a git checkout)"
    changed = git("status", "--porcelain", "--", "src")
    return f"itemjournal at {commit}" + (" + uncommitted changes in src/" if changed else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small runs: under a minute")
    parser.add_argument("--rounds", type=positive, default=None, help="rounds (quick 1, full 3)")
    parser.add_argument("--postgres-url", default=None, help="a postgresql:// server to measure")
    parser.add_argument(
        "--json", default=str(DEFAULT_JSON), help=f"where the JSON goes ({DEFAULT_JSON})"
    )
    parser.add_argument("--dir", default=None, help="parent of the scratch directory")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args(argv)

    plan = make_plan(args.quick, args.rounds)
    url = args.postgres_url or next(
        (os.environ[v] for v in POSTGRES_VARIABLES if os.environ.get(v)), None
    )
    base = pick_base(args.dir)
    versions = {
        "SQLite": sqlite3.sqlite_version,
        "anyio": package_version("anyio"),
        "trio": package_version("trio"),
        "aiosqlite": package_version("aiosqlite"),
        "aiofiles": package_version("aiofiles"),
        "idempotency": package_version("idempotency"),
        "psycopg": package_version("psycopg"),
    }
    environment = f"{environment_line(base, versions)}; {platform.platform()}; {_source()}"
    skipped: list[str] = []
    if url is None:
        notice = (
            "PostgreSQL: no server given (--postgres-url, $ITEMJOURNAL_BENCH_POSTGRES or "
            "$ITEMJOURNAL_TEST_POSTGRES); its rows are skipped"
        )
        print(notice, file=sys.stderr)
        skipped.append(notice)
    else:
        environment += f"; PostgreSQL server {without_password(url)}"
    _log(environment)
    started = time.perf_counter()
    import shutil

    try:
        results = run_all(base, plan, url)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results.skipped = skipped
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        results.skipped.append("instructions per cycle: valgrind is not installed")
    else:
        cycles = instructions.CYCLES // 2 if plan.quick else instructions.CYCLES
        _log(
            f"counting instructions (callgrind): {cycles} cycles and 0 of "
            + ", ".join(instructions.WORKLOADS)
        )
        results.instructions = instructions.per_cycle(cycles, valgrind)
    _log("")
    all_pass, document = report(results, plan, environment, time.perf_counter() - started)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    print(f"results written to {out}")
    return 1 if args.strict and not all_pass else 0


if __name__ == "__main__":
    sys.exit(main())
