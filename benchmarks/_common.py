"""Helpers shared by the benchmark scripts in this directory.

The scripts run as ``python benchmarks/bench_X.py``, which puts this directory on
``sys.path``, so they import this module as ``_common``.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from itemjournal import Claim, Journal

REPO = Path(__file__).resolve().parent.parent

CycleFunction = Callable[[int], Awaitable[None]]
"""One begin + complete cycle; the argument numbers the cycle (0, 1, ...)."""

T = TypeVar("T")


# ---------------------------------------------------------------------- running cycles


async def drive_cycles(cycle: CycleFunction, cycles: int, concurrency: int) -> float:
    """Run ``cycles`` cycles on ``concurrency`` tasks sharing one counter; the seconds taken."""
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < cycles:
            index = next_index
            next_index += 1
            await cycle(index)

    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        for _ in range(concurrency):
            group.start_soon(worker)
    return time.perf_counter() - started


def journal_cycle(journal: Journal, kind: str, definition: str) -> CycleFunction:
    """A cycle that begins (requiring a fresh claim) and completes a new identity each time."""

    async def cycle(index: int) -> None:
        identity = ("bench", kind, "cycle", f"i{index}")
        claim = await journal.begin(identity, {"n": str(index)}, definition)
        if not isinstance(claim, Claim):
            raise TypeError(f"expected a fresh claim for {identity}, got {claim!r}")
        await journal.complete(claim, f"receipt-{index}")

    return cycle


@asynccontextmanager
async def run_directory(base: str, prefix: str) -> AsyncIterator[str]:
    """A fresh directory under ``base`` for one run, removed (in a worker thread) after it."""
    root = tempfile.mkdtemp(prefix=prefix, dir=base)
    try:
        yield root
    finally:
        await anyio.to_thread.run_sync(shutil.rmtree, root)


# ---------------------------------------------------------------------- report


def median(values: list[float]) -> float:
    """The median of the values that are not NaN; NaN when there are none."""
    finite = [value for value in values if not math.isnan(value)]
    return statistics.median(finite) if finite else math.nan


def without_password(url: str) -> str:
    """A server's URL fit to print: a password in its user part or its query (``password``,
    ``sslpassword``) replaced by ``***``."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username}:***@{netloc.rpartition('@')[2]}"
    query = urllib.parse.urlencode(
        [
            (name, "***" if name in ("password", "sslpassword") else value)
            for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        ],
        safe="*",
    )
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))


def verdict(ok: bool) -> str:
    """``PASS`` or ``MISS``."""
    return "PASS" if ok else "MISS"


def by_round(values: Iterable[float]) -> str:
    """Per-round values for a table cell: two decimals, separated by spaces."""
    return " ".join(f"{value:.2f}" for value in values)


def _numeric(cell: str) -> bool:
    """Whether a cell is a number (or ``-``), and so right-aligned."""
    try:
        float(cell)
    except ValueError:
        return cell == "-"
    return True


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain-text table: a header line, a rule, the rows; numbers right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            cell.rjust(width) if _numeric(cell) else cell.ljust(width)
            for cell, width in zip(cells, widths, strict=True)
        ).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


# ---------------------------------------------------------------------- command line


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` that accepts whole numbers from ``minimum`` up."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


positive = at_least(1)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--dir`` and ``--strict``, the flags every benchmark ends with."""
    parser.add_argument(
        "--dir", default=None, help="parent of the scratch directory (default: system temp)"
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit with status 1 when a goal is missed"
    )


def package_version(name: str) -> str:
    """The installed version of a distribution, or ``not installed``."""
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


# ---------------------------------------------------------------------- the whole run


def pick_base(requested: str | None) -> str:
    """A scratch directory on the repository's filesystem (the system temp dir if it is)."""
    if requested is not None:
        parent = requested
    else:
        parent = tempfile.gettempdir()
        if os.stat(parent).st_dev != os.stat(REPO).st_dev:
            parent = str(REPO / "benchmarks")
    return tempfile.mkdtemp(prefix="itemjournal-bench-", dir=parent)


def environment_line(base: str, versions: Mapping[str, str]) -> str:
    """Python, the given ``name: version`` pairs, the CPUs, and where the scratch dir is."""
    same_fs = os.stat(base).st_dev == os.stat(REPO).st_dev
    parts = [f"python {platform.python_version()}"]
    parts += [f"{name} {number}" for name, number in versions.items()]
    parts.append(f"{os.cpu_count()} CPUs")
    return (
        f"{', '.join(parts)}; scratch {base} "
        f"({'same' if same_fs else 'NOT the same'} filesystem as the repository)"
    )


def run_benchmark(
    requested_dir: str | None,
    versions: Mapping[str, str],
    measure: Callable[[str], T],
    report: Callable[[T], bool],
    *,
    strict: bool,
) -> int:
    """Measure in a scratch directory (deleted afterwards), then print the report.

    The environment line goes to stderr before the runs and to stdout before the
    report; the total time comes last. ``measure`` gets the scratch directory;
    ``report`` prints the results and says whether every goal was met. Returns the
    exit status: 1 when ``strict`` and a goal was missed, else 0.
    """
    base = pick_base(requested_dir)
    environment = environment_line(base, versions)
    print(environment, file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        results = measure(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(file=sys.stderr)
    print(environment)
    all_pass = report(results)
    print(f"\ntotal {time.perf_counter() - started:.1f} s")
    return 1 if strict and not all_pass else 0


# ---------------------------------------------------------------------- latency and lag

TICK = 0.001
"""The ticker's sleep: event-loop lag is how late each such wake-up comes."""


def percentile(values: Iterable[float], fraction: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


async def ticker(lags: list[float]) -> None:
    """Sleep ``TICK`` in a loop and record how much later than asked each wake-up came."""
    clock = time.perf_counter
    while True:
        expected = clock() + TICK
        await anyio.sleep(TICK)
        lags.append(max(0.0, clock() - expected))


async def timed_cycles(
    cycle: CycleFunction, cycles: int, concurrency: int
) -> tuple[float, list[float], list[float]]:
    """``drive_cycles`` with each cycle timed, while ``ticker`` watches the event loop.

    Returns the seconds taken, the latency of every cycle and the lag of every tick.
    """
    latencies: list[float] = []
    lags: list[float] = []
    clock = time.perf_counter

    async def timed(index: int) -> None:
        started = clock()
        await cycle(index)
        latencies.append(clock() - started)

    async with anyio.create_task_group() as outer:
        outer.start_soon(ticker, lags)
        await anyio.lowlevel.checkpoint()  # let the ticker take its first step
        seconds = await drive_cycles(timed, cycles, concurrency)
        outer.cancel_scope.cancel()
    return seconds, latencies, lags


# ---------------------------------------------------------------------- memory


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MB (``getrusage``)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 if sys.platform != "darwin" else peak / (1024 * 1024)


def current_rss_mb() -> float:
    """This process's resident set size now, in MB (``/proc/self/statm``; NaN elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            pages = int(statm.read().split()[1])
    except OSError:
        return math.nan
    return pages * os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)


# ---------------------------------------------------------------------- one measured run


@dataclass(frozen=True)
class Sample:
    """One measured run of one workload at one setting (event loop and concurrency)."""

    cycles: int
    seconds: float
    latencies: tuple[float, ...] = ()  # seconds per cycle; empty when not timed per cycle
    lags: tuple[float, ...] = ()  # seconds late per ticker wake-up; empty: no event loop
    commits: int | None = None  # write transactions committed; None: not counted
    cpu_seconds: float | None = None  # process CPU (every thread) over the run; None: not read

    @property
    def rate(self) -> float:
        return self.cycles / self.seconds if self.seconds > 0 else math.nan

    @property
    def p50_ms(self) -> float:
        return percentile(self.latencies, 0.50) * 1000

    @property
    def p99_ms(self) -> float:
        return percentile(self.latencies, 0.99) * 1000

    @property
    def lag_p99_ms(self) -> float:
        return percentile(self.lags, 0.99) * 1000

    @property
    def cpu_us(self) -> float:
        """Process CPU per cycle, in microseconds (every thread of the process counts)."""
        if self.cpu_seconds is None or not self.cycles:
            return math.nan
        return self.cpu_seconds / self.cycles * 1e6

    @property
    def commits_per_cycle(self) -> float:
        return math.nan if self.commits is None else self.commits / self.cycles


def check_count(found: int, cycles: int, what: str) -> None:
    """A run counts only when every cycle left its succeeded record behind."""
    if found != cycles:
        raise RuntimeError(f"{what}: expected {cycles} succeeded records, found {found}")


async def measure(
    cycle: CycleFunction, cycles: int, concurrency: int, *, commits: Callable[[], int] | None = None
) -> Sample:
    """Run and time the cycles (latency per cycle, loop lag, process CPU); ``commits``
    reads a counter."""
    before = commits() if commits is not None else 0
    cpu = time.process_time()
    seconds, latencies, lags = await timed_cycles(cycle, cycles, concurrency)
    cpu = time.process_time() - cpu
    done = None if commits is None else commits() - before
    return Sample(cycles, seconds, tuple(latencies), tuple(lags), done, cpu)


@dataclass
class Env:
    """What every workload of one run gets: where to write, the server, what came before."""

    base: str  # scratch directory on the repository's file system
    backend: str  # "asyncio" or "trio"
    postgres_url: str | None = None
    notes: dict[str, object] = field(default_factory=dict)  # e.g. the store's batch sizes


Runner = Callable[[Env, int, int], Awaitable[Sample]]
"""A workload: ``run(env, cycles, concurrency)`` measures one run in a fresh location."""
