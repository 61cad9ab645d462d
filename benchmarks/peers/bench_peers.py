"""How it compares: itemjournal next to the peers a user would pick instead, in one run.

Run: ``make bench-peers`` (full, about 20 minutes on a loaded machine) or
``make bench-peers BENCH_ARGS=--quick`` (about 3 minutes), or
``.venv/bin/python benchmarks/peers/bench_peers.py [--quick] [--rounds R] [--seconds S]
[--crash-runs N] [--json PATH] [--strict]``.

Two tables and the goals go to stdout (progress to stderr); every figure, every round's,
to ``benchmarks/out/peers.json``. See the "How it compares" section of
``benchmarks/README.md`` and ``docs/comparison.md`` for what each row does and writes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import servers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import (
    by_round,
    median,
    package_version,
    pick_base,
    positive,
    table,
    verdict,
    without_password,
)

HERE = Path(__file__).resolve().parent
CHILD = str(HERE / "child.py")
DEFAULT_JSON = HERE.parent / "out" / "peers.json"
POSTGRES_VARIABLES = ("ITEMJOURNAL_BENCH_POSTGRES", "ITEMJOURNAL_TEST_POSTGRES")
MACHINE_REDIS = "redis://127.0.0.1:6379/0"
CONCURRENCIES = (1, 16)
IN_PROGRESS_EXPIRY_MS = 5_000  # Powertools' crash runs: the Lambda context's time left


@dataclass(frozen=True)
class Workload:
    """One row of the throughput table."""

    key: str
    system: str  # systems.py's name: itemjournal, dbos, powertools, idempotency
    face: str  # "sync" (threads) or "async" (asyncio tasks)
    store: str  # file, sqlite, postgres, redis, redis-durable
    label: str
    promise: str

    @property
    def needs(self) -> str | None:
        return {"postgres": "postgres", "redis": "redis", "redis-durable": "durable"}.get(
            self.store
        )


FILE_PROMISE = "fsync: 2 file + 2 directory syncs per item"
SQLITE_PROMISE = "fsync: WAL, synchronous=FULL, commits grouped"
DBOS_SQLITE_PROMISE = "fsync: rollback journal, synchronous=FULL"
NO_FSYNC = "no fsync (JSON files, flock)"

# In this order (reversed every other round): a pair compared by a goal runs side by side.
W = Workload
WORKLOADS = (
    W("ij-pg-sync", "itemjournal", "sync", "postgres", "itemjournal postgres", "{pg}"),
    W("dbos-pg-sync", "dbos", "sync", "postgres", "DBOS postgres", "{pg}"),
    W("ij-pg-async", "itemjournal", "async", "postgres", "itemjournal postgres", "{pg}"),
    W("dbos-pg-async", "dbos", "async", "postgres", "DBOS postgres", "{pg}"),
    W("ij-sqlite-async", "itemjournal", "async", "sqlite", "itemjournal sqlite", SQLITE_PROMISE),
    W("dbos-sqlite-async", "dbos", "async", "sqlite", "DBOS sqlite", DBOS_SQLITE_PROMISE),
    W("dbos-sqlite-sync", "dbos", "sync", "sqlite", "DBOS sqlite", DBOS_SQLITE_PROMISE),
    W("ij-sqlite-sync", "itemjournal", "sync", "sqlite", "itemjournal sqlite", SQLITE_PROMISE),
    W("pt-durable", "powertools", "sync", "redis-durable", "Powertools redis (own)", "{durable}"),
    W("ij-file-sync", "itemjournal", "sync", "file", "itemjournal file", FILE_PROMISE),
    W("ij-file-async", "itemjournal", "async", "file", "itemjournal file", FILE_PROMISE),
    W("pt-machine", "powertools", "sync", "redis", "Powertools redis (machine)", "{redis}"),
    W("idempotency", "idempotency", "sync", "file", "idempotency pkg FileStore", NO_FSYNC),
)  # fmt: skip


@dataclass(frozen=True)
class CrashSystem:
    key: str
    system: str
    store: str
    label: str
    after: str  # what happens between "at once" and "after"


CRASH_SYSTEMS = (
    CrashSystem("ij-file", "itemjournal", "file", "itemjournal file", "asked again later"),
    CrashSystem("ij-sqlite", "itemjournal", "sqlite", "itemjournal sqlite", "asked again later"),
    CrashSystem("ij-pg", "itemjournal", "postgres", "itemjournal postgres", "asked again later"),
    CrashSystem("dbos-pg", "dbos", "postgres", "DBOS postgres", "restart: recovery"),
    CrashSystem("dbos-sqlite", "dbos", "sqlite", "DBOS sqlite", "restart: recovery"),
    CrashSystem(
        "pt-durable", "powertools", "redis-durable", "Powertools redis (own)", "in-progress expiry"
    ),
    CrashSystem("idempotency", "idempotency", "file", "idempotency pkg", "asked again later"),
)


@dataclass
class Context:
    base: str
    seconds: float
    warmup: float
    postgres_url: str | None
    redis_url: str | None
    durable_url: str | None
    promises: dict[str, str]
    skipped: dict[str, str] = field(default_factory=dict)

    def available(self, needs: str | None) -> bool:
        return (
            needs is None
            or {
                "postgres": self.postgres_url,
                "redis": self.redis_url,
                "durable": self.durable_url,
            }[needs]
            is not None
        )

    def spec(
        self, system: str, store: str, directory: str
    ) -> tuple[dict[str, Any], Callable[[], None]]:
        """The spec of a child process, and the cleanup of what it may leave on a server."""
        spec: dict[str, Any] = {"system": system, "store": store, "dir": directory}
        cleanup: Callable[[], None] = lambda: None  # noqa: E731
        if store == "postgres":
            assert self.postgres_url is not None
            schema = servers.new_schema()
            url = self.postgres_url
            spec.update(postgres_url=url, schema=schema)
            cleanup = lambda: servers.drop_schema(url, schema)  # noqa: E731
        elif store in ("redis", "redis-durable"):
            url = self.redis_url if store == "redis" else self.durable_url
            assert url is not None
            prefix = f"ijpeers-{os.getpid()}-{os.path.basename(directory)}"
            spec.update(redis_url=url, key_prefix=prefix)
            cleanup = lambda: servers.delete_keys(url, prefix)  # noqa: E731
        return spec, cleanup


def _run_child(args: list[str], timeout: float) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, CHILD, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-6:])
        raise RuntimeError(f"child exited {done.returncode}: {tail}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# ---------------------------------------------------------------------- throughput


def measure_one(context: Context, workload: Workload, concurrency: int) -> dict[str, Any]:
    directory = tempfile.mkdtemp(prefix=f"{workload.key}-c{concurrency}-", dir=context.base)
    spec, cleanup = context.spec(workload.system, workload.store, directory)
    spec.update(
        face=workload.face,
        concurrency=concurrency,
        seconds=context.seconds,
        warmup=context.warmup,
    )
    try:
        return _run_child(["measure", json.dumps(spec)], timeout=context.seconds * 10 + 180)
    finally:
        try:
            cleanup()
        finally:
            subprocess.run(["rm", "-rf", directory], check=False)


def run_throughput(context: Context, rounds: int) -> dict[str, dict[int, list[dict[str, Any]]]]:
    results: dict[str, dict[int, list[dict[str, Any]]]] = {
        w.key: {c: [] for c in CONCURRENCIES} for w in WORKLOADS
    }
    workloads = [w for w in WORKLOADS if context.available(w.needs)]
    for number in range(rounds):
        order = workloads if number % 2 == 0 else workloads[::-1]
        levels = CONCURRENCIES if number % 2 == 0 else CONCURRENCIES[::-1]
        for workload in order:
            for concurrency in levels:
                try:
                    sample = measure_one(context, workload, concurrency)
                except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as error:
                    print(f"  {workload.key} c={concurrency}: FAILED {error}", file=sys.stderr)
                    sample = {"rate": math.nan, "p50_ms": math.nan, "p99_ms": math.nan}
                sample["round"] = number
                results[workload.key][concurrency].append(sample)
                print(
                    f"round {number + 1}/{rounds} {workload.key:18} {workload.face:5} "
                    f"c={concurrency:<2} {sample['rate']:9.1f} items/s  "
                    f"p50 {sample['p50_ms']:8.2f} ms  p99 {sample['p99_ms']:8.2f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    return results


def _cell(value: float, digits: int = 2) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def throughput_table(context: Context, results: dict[str, dict[int, list[dict[str, Any]]]]) -> str:
    rows = []
    for workload in WORKLOADS:
        if not context.available(workload.needs):
            continue
        cells = [workload.label, "threads" if workload.face == "sync" else "tasks"]
        cells.append(workload.promise.format(**context.promises))
        for concurrency in CONCURRENCIES:
            samples = results[workload.key][concurrency]
            cells += [
                _cell(median([s["rate"] for s in samples]), 0),
                _cell(median([s["p50_ms"] for s in samples])),
                _cell(median([s["p99_ms"] for s in samples])),
            ]
        rows.append(cells)
    headers = ["system", "driven by", "what the store promises"]
    for concurrency in CONCURRENCIES:
        headers += [f"c{concurrency} items/s", f"c{concurrency} p50 ms", f"c{concurrency} p99 ms"]
    return table(headers, rows)


@dataclass(frozen=True)
class Goal:
    text: str
    numerator: str
    denominator: str
    concurrency: int
    target: float | None  # None: for reference, no verdict
    measure: str = "rate"  # or "p50_ms": then the goal is "at most target"


G = Goal
GOALS = (
    G("postgres c16: itemjournal / DBOS, threads", "ij-pg-sync", "dbos-pg-sync", 16, 2.0),
    G("postgres c16: itemjournal / DBOS, tasks", "ij-pg-async", "dbos-pg-async", 16, 2.0),
    G("postgres c1: itemjournal / DBOS, threads", "ij-pg-sync", "dbos-pg-sync", 1, None),
    G("postgres c1: itemjournal / DBOS, tasks", "ij-pg-async", "dbos-pg-async", 1, None),
    G("sqlite c16: itemjournal / DBOS, threads", "ij-sqlite-sync", "dbos-sqlite-sync", 16, 5.0),
    G("sqlite c16: itemjournal / DBOS, tasks", "ij-sqlite-async", "dbos-sqlite-async", 16, 5.0),
    G("sqlite c1: itemjournal / DBOS, threads", "ij-sqlite-sync", "dbos-sqlite-sync", 1, None),
    G("sqlite c1: itemjournal / DBOS, tasks", "ij-sqlite-async", "dbos-sqlite-async", 1, None),
    G("c16: sqlite store / Powertools durable", "ij-sqlite-sync", "pt-durable", 16, 1.2),
    G("c1: sqlite store / Powertools durable", "ij-sqlite-sync", "pt-durable", 1, 1.0),
    G(
        "c1 p50: sqlite store / Powertools durable (lower is faster)",
        "ij-sqlite-sync", "pt-durable", 1, 1.0, "p50_ms",
    ),
    G("  beside, c16 sqlite store (tasks) / Powertools", "ij-sqlite-async", "pt-durable", 16, None),
    G("  beside, c1 sqlite store (tasks) / Powertools", "ij-sqlite-async", "pt-durable", 1, None),
    G("  beside, c16 file store (tasks) / Powertools", "ij-file-async", "pt-durable", 16, None),
    G("  beside, c1 file store (tasks) / Powertools", "ij-file-async", "pt-durable", 1, None),
    G(
        "  beside, c1 p50 file store (tasks) / Powertools",
        "ij-file-async", "pt-durable", 1, None, "p50_ms",
    ),
    G("  beside, c16 file store (threads) / Powertools", "ij-file-sync", "pt-durable", 16, None),
    G("  beside, c16 Powertools machine / sqlite store", "pt-machine", "ij-sqlite-sync", 16, None),
    G("  beside, c16 postgres / Powertools durable", "ij-pg-sync", "pt-durable", 16, None),
)  # fmt: skip


def goal_rows(
    results: dict[str, dict[int, list[dict[str, Any]]]],
) -> tuple[list[list[str]], list[dict[str, Any]], bool]:
    rows, records, all_pass = [], [], True
    for goal in GOALS:
        tops = {s["round"]: s[goal.measure] for s in results[goal.numerator][goal.concurrency]}
        bottoms = {s["round"]: s[goal.measure] for s in results[goal.denominator][goal.concurrency]}
        ratios = [tops[r] / bottoms[r] for r in sorted(tops) if r in bottoms and bottoms[r] > 0]
        ratio = median(ratios)
        if goal.target is None:
            status, target = "-", "-"
        else:
            at_most = goal.measure == "p50_ms"
            met = not math.isnan(ratio) and (
                ratio <= goal.target if at_most else ratio >= goal.target
            )
            status = verdict(met) if not math.isnan(ratio) else "MISS (not measured)"
            target = f"{'<=' if at_most else '>='} {goal.target:g}"
            all_pass = all_pass and met
        rows.append([goal.text, _cell(ratio), target, status, by_round(ratios)])
        records.append({"goal": goal.text, "ratio": ratio, "rounds": ratios, "verdict": status})
    return rows, records, all_pass


# ---------------------------------------------------------------------- the crash table


def _ledger_counts(ledger: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    if os.path.exists(ledger):
        with open(ledger, encoding="utf-8") as stream:
            for line in stream:
                counts[line.strip()] = counts.get(line.strip(), 0) + 1
    return counts


def crash_one(context: Context, crash: CrashSystem, runs: int) -> dict[str, Any]:
    directory = tempfile.mkdtemp(prefix=f"crash-{crash.key}-", dir=context.base)
    spec, cleanup = context.spec(crash.system, crash.store, directory)
    spec["in_progress_expiry_ms"] = IN_PROGRESS_EXPIRY_MS
    ledger = os.path.join(directory, "ledger.txt")
    items = [f"crash{run}" for run in range(runs)]
    at_once: list[str] = []
    once_counts: list[int] = []
    last_claim = time.monotonic()
    try:
        for item in items:
            asker = subprocess.Popen(  # opens the system while the crash runs: asks at once
                [sys.executable, CHILD, "ask", json.dumps(spec), ledger, "-"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            process = subprocess.Popen(
                [sys.executable, CHILD, "crash", json.dumps(spec), item, ledger],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            assert process.stdout is not None
            line = process.stdout.readline()
            process.kill()  # SIGKILL, after the effect and before the completion
            _, errors = process.communicate()
            if line.strip() != "EFFECT":
                asker.kill()
                asker.communicate()
                raise RuntimeError(f"{crash.key}: no effect before the kill: {errors[-400:]}")
            last_claim = time.monotonic()
            output, errors = asker.communicate(item + "\n", timeout=120)
            if asker.returncode != 0:
                raise RuntimeError(
                    f"{crash.key}: the asker exited {asker.returncode}: {errors[-400:]}"
                )
            at_once.append(json.loads(output.strip().splitlines()[-1])["answers"][0])
            once_counts.append(_ledger_counts(ledger).get(item, 0))
        if crash.system == "powertools":
            time.sleep(max(0.0, last_claim + IN_PROGRESS_EXPIRY_MS / 1000 + 1 - time.monotonic()))
        after = _run_child(["after", json.dumps(spec), ledger, *items], timeout=300)["answers"]
        counts = _ledger_counts(ledger)
    finally:
        try:
            cleanup()
        finally:
            subprocess.run(["rm", "-rf", directory], check=False)
    final = [counts.get(item, 0) for item in items]
    return {
        "runs": runs,
        "at_once": at_once,
        "after": after,
        "effects_at_once": once_counts,
        "effects_after": final,
    }


def _tally(answers: list[str]) -> str:
    counts: dict[str, int] = {}
    for answer in answers:
        counts[answer] = counts.get(answer, 0) + 1
    return ", ".join(f"{answer} x{n}" for answer, n in counts.items())


def run_crash(context: Context, runs: int) -> dict[str, dict[str, Any]]:
    results = {}
    for crash in CRASH_SYSTEMS:
        needs = {"postgres": "postgres", "redis-durable": "durable"}.get(crash.store)
        if not context.available(needs):
            continue
        started = time.perf_counter()
        try:
            results[crash.key] = crash_one(context, crash, runs)
        except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as error:
            print(f"  crash {crash.key}: FAILED {error}", file=sys.stderr)
            results[crash.key] = {"failed": str(error)}
            continue
        result = results[crash.key]
        print(
            f"crash {crash.key:12} {time.perf_counter() - started:6.1f} s  "
            f"effects at once {result['effects_at_once']}  after {result['effects_after']}",
            file=sys.stderr,
            flush=True,
        )
    return results


def crash_table(results: dict[str, dict[str, Any]]) -> tuple[str, list[list[str]], bool]:
    rows, goal_lines, all_pass = [], [], True
    for crash in CRASH_SYSTEMS:
        if crash.key not in results:
            continue
        result = results[crash.key]
        if "failed" in result:
            rows.append([crash.label, "-", "FAILED", "-", crash.after, "-", "-", "-"])
            seconds = math.nan
        else:
            twice_once = sum(1 for n in result["effects_at_once"] if n > 1)
            twice_after = sum(1 for n in result["effects_after"] if n > 1)
            seconds = twice_after
            rows.append(
                [
                    crash.label,
                    str(result["runs"]),
                    _tally(result["at_once"]),
                    f"{twice_once}/{result['runs']}",
                    crash.after,
                    _tally(result["after"]),
                    f"{twice_after}/{result['runs']}",
                    str(sum(result["effects_after"])),
                ]
            )
        if crash.system == "itemjournal":
            met = seconds == 0
            all_pass = all_pass and met
            goal_lines.append(
                [f"crash: {crash.label}, runs with a second effect", _cell(seconds, 0), "= 0",
                 verdict(met), ""]
            )  # fmt: skip
    headers = [
        "system", "runs", "asked at once: answers", "2nd effect", "then",
        "asked after: answers", "2nd effect", "effects",
    ]  # fmt: skip
    return table(headers, rows), goal_lines, all_pass


# ---------------------------------------------------------------------- the run


def _source() -> str:
    """Where the measured itemjournal was imported from, and the repository's commit."""
    import itemjournal

    commit = subprocess.run(
        ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return f"{Path(itemjournal.__file__).parent.parent}, HEAD {commit or '?'}"


def load_average() -> str:
    try:
        return " ".join(f"{value:.1f}" for value in os.getloadavg())
    except OSError:
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round, 1 s runs, 3 crash runs")
    parser.add_argument("--rounds", type=positive, default=None)
    parser.add_argument("--seconds", type=float, default=None, help="measured seconds per run")
    parser.add_argument("--crash-runs", type=positive, default=None)
    parser.add_argument("--no-throughput", action="store_true", help="the crash table only")
    parser.add_argument("--no-crash", action="store_true", help="the throughput table only")
    parser.add_argument("--postgres-url", default=None)
    parser.add_argument("--redis-url", default=os.environ.get("ITEMJOURNAL_BENCH_REDIS"))
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    parser.add_argument("--dir", default=None, help="parent of the scratch directory")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    seconds = args.seconds or (1.0 if args.quick else 3.0)
    crash_runs = args.crash_runs or (3 if args.quick else 10)

    started = time.perf_counter()
    load_before = load_average()
    base = pick_base(args.dir)
    durable: servers.DurableRedis | None = None
    try:
        postgres_url = args.postgres_url or next(
            (os.environ[name] for name in POSTGRES_VARIABLES if os.environ.get(name)), None
        )
        pg = servers.postgres_settings(postgres_url) if postgres_url else None
        context = Context(base, seconds, min(0.5, seconds / 4), None, None, None, {})
        notes = []
        if pg is not None:
            context.postgres_url = postgres_url
            context.promises["pg"] = (
                f"server commit: fsync={pg['fsync']}, synchronous_commit={pg['synchronous_commit']}"
            )
            servers.drop_leftover_schemas(str(postgres_url))
        else:
            notes.append("PostgreSQL: no server answered (--postgres-url): its rows are skipped")
        machine_url = args.redis_url or MACHINE_REDIS
        machine = servers.redis_settings(machine_url)
        if machine is not None:
            context.redis_url = machine_url
            context.promises["redis"] = servers.redis_promise(machine)
        else:
            notes.append(f"Redis at {machine_url}: no answer, its rows are skipped")
        started_redis = servers.start_durable_redis(base)
        if isinstance(started_redis, str):
            notes.append(f"durable Redis: {started_redis}; its rows are skipped")
            own = None
        else:
            durable = started_redis
            own = servers.redis_settings(durable.url)
            context.durable_url = durable.url
            context.promises["durable"] = servers.redis_promise(own or {})
        environment = (
            f"python {platform.python_version()}, itemjournal {package_version('itemjournal')} "
            f"({_source()}), "
            f"dbos {package_version('dbos')}, aws-lambda-powertools "
            f"{package_version('aws-lambda-powertools')}, idempotency "
            f"{package_version('idempotency')}, redis-py {package_version('redis')}; "
            f"{os.cpu_count()} CPUs; PostgreSQL "
            f"{pg['server_version'] if pg else '-'} at "
            f"{without_password(postgres_url) if postgres_url else '-'}; Redis "
            f"{machine['version'] if machine else '-'} at {machine_url}; own Redis "
            f"{own['version'] if own else '-'}; scratch {base}"
        )
        print(environment, file=sys.stderr, flush=True)
        for note in notes:
            print(note, file=sys.stderr)
        throughput = {} if args.no_throughput else run_throughput(context, rounds)
        crashes = {} if args.no_crash else run_crash(context, crash_runs)
    finally:
        if durable is not None:
            durable.stop()
        if context.postgres_url:
            servers.drop_leftover_schemas(context.postgres_url)
        subprocess.run(["rm", "-rf", base], check=False)
    total = time.perf_counter() - started

    print(environment)
    print(f"load average before {load_before}, after {load_average()}")
    for note in notes:
        print(note)
    all_pass = True
    records: list[dict[str, Any]] = []
    goal_lines: list[list[str]] = []
    if throughput:
        print(
            f"\nThroughput: claim, trivial effect, completion; {rounds} round(s) of "
            f"{seconds:g} s per run, one fresh process per run; medians over rounds\n"
        )
        print(throughput_table(context, throughput))
        goal_lines, records, all_pass = goal_rows(throughput)
    if crashes:
        print(
            "\nCrash: the effect appends a line to a ledger and fsyncs, the process is "
            "SIGKILLed before completion, the item is asked again\n"
        )
        text, crash_goals, crash_pass = crash_table(crashes)
        print(text)
        goal_lines += crash_goals
        all_pass = all_pass and crash_pass
    print("\nGoals (ratios taken within a round; the median over rounds)\n")
    print(table(["goal", "ratio", "target", "verdict", "per round"], goal_lines))
    print(f"\ntotal {total:.1f} s")

    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps(
            {
                "environment": environment,
                "promises": context.promises,
                "rounds": rounds,
                "seconds": seconds,
                "throughput": throughput,
                "goals": records,
                "crash": crashes,
                "total_seconds": total,
            },
            indent=1,
            default=str,
        )
    )
    return 1 if args.strict and not all_pass else 0


if __name__ == "__main__":
    sys.exit(main())
