"""File-store throughput and event-loop lag, next to its system-call limit.

Three workloads run side by side in one process, on asyncio and on trio:

``journal``
    ``Journal.open`` on a fresh directory, then ``begin`` + ``complete`` cycles, each
    cycle on a new identity ``("bench", "file", "cycle", f"i{n}")``.

``limit``
    Every system call the file store makes for those two saves while its saves
    overlap, without any journal logic (no JSON, no state machine), one
    ``anyio.to_thread.run_sync`` trip per save in at most ``FileStore.trips_at_once``
    threads at once, like the store (``StoreSaves``): the
    record's lock on one byte of the fan-out's ``.lock``, the read of the current
    document, then

    * begin: exclusive temp file (0600) → write the payload → fsync → close →
      ``os.link`` to the record name → unlink the temp → fsync the directory;
    * complete: temp file → write → fsync → close → link the current version to a
      backup name → ``os.replace`` → fsync the directory → unlink the backup;

    and the lock released. The fan-out directory and its ``.lock`` stay open, as the
    store keeps them while saves overlap. ``--traced-calls`` compares the audited calls
    (``sys.addaudithook``: open, link, rename, remove, fcntl) of one store cycle with
    one of the limit's and prints whether they are the same, as JSON.

``bare``
    The saves alone (``BareSaves``: no lock, no read, no backup; the directory opened
    for each fsync), for reference.

The limit and the saves use the store's layout,
``root/<first two hex of sha256>/<sha256>.json``; a fan-out directory is created on first
use and the root is synced after it, as the store does.

Each runs ``--concurrency`` tasks in one task group that share a cycle counter, while a
ticker task sleeps 1 ms in a loop and records how late each wake-up is. Rounds alternate
the order of the workloads; the table shows medians over rounds, then the ratios
journal/limit throughput (goal >= 0.70) and journal/limit p99 lag (goal <= 1.5), each
taken within a round (journal against the limit run next to it) and then the median,
and journal/bare throughput for reference.

Run: ``.venv/bin/python benchmarks/bench_filestore.py [--cycles N] [--concurrency C]
[--rounds R]``.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import itertools
import json
import math
import os
import secrets
import struct
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import anyio.to_thread
from _common import (
    CycleFunction,
    add_common_arguments,
    by_round,
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

from itemjournal import FileStore, Journal, Reuse, definition_digest

BACKENDS = ("asyncio", "trio")
TICK = 0.001
THROUGHPUT_GOAL = 0.70
LAG_GOAL = 1.5
IDLE_SECONDS = 0.25


# ---------------------------------------------------------------------- measurement


def _percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile; NaN for an empty list."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class Sample:
    """One measured run of one workload."""

    cycles: int
    seconds: float
    lags: tuple[float, ...]  # seconds late, one per ticker wake-up

    @property
    def rate(self) -> float:
        return self.cycles / self.seconds if self.seconds > 0 else math.nan

    @property
    def p50_ms(self) -> float:
        return _percentile(list(self.lags), 0.50) * 1000

    @property
    def p99_ms(self) -> float:
        return _percentile(list(self.lags), 0.99) * 1000


async def _ticker(lags: list[float]) -> None:
    """Sleep TICK in a loop and record how much later than asked each wake-up came."""
    clock = time.perf_counter
    while True:
        expected = clock() + TICK
        await anyio.sleep(TICK)
        lags.append(max(0.0, clock() - expected))


async def _measure(cycle: CycleFunction, cycles: int, concurrency: int) -> Sample:
    """Run ``cycles`` cycles on ``concurrency`` tasks while the ticker watches the loop."""
    lags: list[float] = []
    async with anyio.create_task_group() as outer:
        outer.start_soon(_ticker, lags)
        await anyio.lowlevel.checkpoint()  # let the ticker take its first step
        elapsed = await drive_cycles(cycle, cycles, concurrency)
        outer.cancel_scope.cancel()
    return Sample(cycles, elapsed, tuple(lags))


async def _idle_sample() -> Sample:
    """The ticker alone: the loop's own wake-up lateness, for reference."""
    lags: list[float] = []
    with anyio.move_on_after(IDLE_SECONDS):
        await _ticker(lags)
    return Sample(0, IDLE_SECONDS, tuple(lags))


# ---------------------------------------------------------------------- workloads


async def run_journal(base: str, cycles: int, concurrency: int, payload: int) -> Sample:
    """begin + complete cycles through ``Journal`` on a fresh file store."""
    del payload  # the journal writes its own records
    async with run_directory(base, "journal-") as root:
        definition = definition_digest("bench-filestore-v1")
        async with await Journal.open(root) as journal:
            cycle = journal_cycle(journal, "file", definition)
            return await _measure(cycle, cycles, concurrency)


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``, fsync it and close it."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


class BareSaves:
    """The store's durable-save system calls and nothing else (worker-thread code)."""

    def __init__(self, root: str, payload: int) -> None:
        self.root = root
        self.data = (b"0123456789abcdef" * (payload // 16 + 1))[:payload]
        self.prefix = f".{os.getpid()}-bench-"
        self.known_dirs: set[str] = set()

    def _paths(self, index: int) -> tuple[str, str]:
        digest = hashlib.sha256(f"i{index}".encode()).hexdigest()
        directory = os.path.join(self.root, digest[:2])
        if directory not in self.known_dirs:
            try:
                os.mkdir(directory, 0o700)
            except FileExistsError:
                pass
            else:
                _sync_dir(self.root)
            self.known_dirs.add(directory)
        return directory, os.path.join(directory, f"{digest}.json")

    def _write_temp(self, directory: str) -> str:
        temp = os.path.join(directory, f"{self.prefix}{secrets.token_hex(16)}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temp, flags, 0o600)
        _write_synced(fd, self.data)
        return temp

    def begin(self, index: int) -> None:
        directory, target = self._paths(index)
        temp = self._write_temp(directory)
        os.link(temp, target, follow_symlinks=False)
        os.unlink(temp)
        _sync_dir(directory)

    def complete(self, index: int) -> None:
        directory, target = self._paths(index)
        temp = self._write_temp(directory)
        os.replace(temp, target)
        _sync_dir(directory)


_OFD_FORMAT = "hhqqi"  # struct flock
_OFD_SIZE = (struct.calcsize(_OFD_FORMAT) + 7) // 8 * 8
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_TEMP = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class StoreSaves:
    """Every system call the file store makes for ``begin`` and ``complete`` while saves
    overlap, and nothing else: no JSON, no state machine (worker-thread code).

    Per save: the record's lock (an open-file-description lock on one byte of the fan-out
    directory's ``.lock``), the read of the current document (absent for ``begin``; open,
    ``fstat``, read, close for ``complete``), then the save: temp file, write, fsync,
    close, and either link + unlink the temp (create) or link the current version to a
    backup name + ``rename`` + unlink the backup (replace), the directory fsync'd in
    between; the lock released. The fan-out directory's descriptor and its ``.lock``
    descriptor stay open, as the store keeps them while its saves overlap. The payload is
    written as given. Linux only (``F_OFD_SETLK``).
    """

    def __init__(self, root: str, payload: int) -> None:
        self.root = root
        self.data = (b"0123456789abcdef" * (payload // 16 + 1))[:payload]
        self.prefix = f".{os.getpid()}-bench-"
        self.temps = itertools.count()
        self.fanouts: dict[str, tuple[int, int]] = {}  # name -> (directory fd, .lock fd)
        self.guard = threading.Lock()

    def close(self) -> None:
        for dir_fd, lock_fd in self.fanouts.values():
            os.close(lock_fd)
            os.close(dir_fd)
        self.fanouts.clear()

    def _fanout(self, name: str) -> tuple[int, int]:
        with self.guard:
            known = self.fanouts.get(name)
            if known is not None:
                return known
            directory = os.path.join(self.root, name)
            try:
                os.mkdir(directory, 0o700)
            except FileExistsError:
                pass
            else:
                _sync_dir(self.root)
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            dir_fd = os.open(directory, flags)
            lock_fd = os.open(
                ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd
            )
            self.fanouts[name] = (dir_fd, lock_fd)
            return dir_fd, lock_fd

    @staticmethod
    def _lock(lock_fd: int, offset: int, kind: int) -> None:
        request = struct.pack(_OFD_FORMAT, kind, os.SEEK_SET, offset, 1, 0)
        fcntl.fcntl(lock_fd, fcntl.F_OFD_SETLK, request.ljust(_OFD_SIZE, b"\0"))

    @staticmethod
    def _read(dir_fd: int, name: str) -> bytes | None:
        try:
            fd = os.open(name, _READ, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        try:
            return os.read(fd, os.fstat(fd).st_size + 1)
        finally:
            os.close(fd)

    def _write_temp(self, dir_fd: int) -> str:
        temp = f"{self.prefix}{next(self.temps)}.tmp"
        fd = os.open(temp, _TEMP, 0o600, dir_fd=dir_fd)
        _write_synced(fd, self.data)
        return temp

    def _save(self, index: int, create: bool) -> None:
        digest = hashlib.sha256(f"i{index}".encode()).hexdigest()
        dir_fd, lock_fd = self._fanout(digest[:2])
        offset = int(digest[:15], 16)
        name = f"{digest}.json"
        self._lock(lock_fd, offset, fcntl.F_WRLCK)
        try:
            self._read(dir_fd, name)
            temp = self._write_temp(dir_fd)
            if create:
                os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
                os.unlink(temp, dir_fd=dir_fd)
                os.fsync(dir_fd)
            else:
                backup = f"{self.prefix}{next(self.temps)}.tmp"
                os.link(name, backup, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
                os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                os.fsync(dir_fd)
                os.unlink(backup, dir_fd=dir_fd)
        finally:
            self._lock(lock_fd, offset, fcntl.F_UNLCK)

    def begin(self, index: int) -> None:
        self._save(index, create=True)

    def complete(self, index: int) -> None:
        self._save(index, create=False)


# The audited calls that tell the store's saves apart from bare ones (``sys.addaudithook``;
# write, fsync, read, fstat and close raise no audit event and are left out).
_TRACED = ("open", "os.link", "os.rename", "os.remove", "fcntl.fcntl")


def _kind(name: object) -> str:
    text = os.fsdecode(name) if isinstance(name, (str, bytes)) else str(name)
    base = os.path.basename(text)
    if base.endswith(".json"):
        return "record"
    if base.endswith(".tmp"):
        return "temp"
    return base


def _shape(event: str, args: tuple[object, ...]) -> tuple[object, ...] | None:
    """One audited call with its names reduced to their kind, or None when it is the
    opening of a descriptor the store keeps while its saves overlap (a directory, a
    ``.lock``), or not one of ``_TRACED``."""
    if event not in _TRACED:
        return None
    if event == "open":
        name, flags = args[0], args[2]
        if not isinstance(flags, int) or flags & os.O_DIRECTORY or _kind(name) == ".lock":
            return None
        return (event, _kind(name), flags)
    if event == "fcntl.fcntl":
        return (event, args[1])
    if event == "os.remove":
        return (event, _kind(args[0]))
    return (event, _kind(args[0]), _kind(args[1]))


def traced_calls(base: str) -> dict[str, list[tuple[object, ...]]]:
    """The audited calls of one ``begin`` + ``complete`` on the store (the second cycle of a
    fresh journal, in a fan-out directory already made) and on ``StoreSaves``. Installs
    an audit hook, which stays for the life of the process: run it in a process of its
    own (``--traced-calls``)."""
    calls: list[tuple[object, ...]] | None = None

    def hook(event: str, args: tuple[object, ...]) -> None:
        if calls is not None:
            shape = _shape(event, args)
            if shape is not None:
                calls.append(shape)

    sys.addaudithook(hook)
    found: dict[str, list[tuple[object, ...]]] = {}

    async def store() -> None:
        async with await Journal.open(os.path.join(base, "store")) as journal:
            definition = definition_digest("bench-filestore-v1")
            for index in range(2):
                identity = ("bench", "file", "trace", f"i{index}")
                nonlocal calls
                calls = [] if index == 1 else None
                claim = await journal.begin(identity, {"n": index}, definition)
                assert not isinstance(claim, Reuse)
                await journal.complete(claim, f"r{index}")
            found["store"], calls = calls or [], None

    anyio.run(store)
    saves = StoreSaves(os.path.join(base, "limit"), 1024)
    os.mkdir(saves.root, 0o700)
    try:
        saves.begin(0)
        saves.complete(0)
        calls = []
        saves.begin(1)
        saves.complete(1)
        found["limit"], calls = calls, None
    finally:
        saves.close()
    return found


def save_cycle(saves: BareSaves | StoreSaves) -> CycleFunction:
    """A cycle of bare saves: ``begin`` and ``complete``, one worker-thread trip each, in
    at most as many threads at once as the store uses (``FileStore.trips_at_once``)."""
    threads = anyio.CapacityLimiter(FileStore.trips_at_once)

    async def cycle(index: int) -> None:
        await anyio.to_thread.run_sync(saves.begin, index, limiter=threads)
        await anyio.to_thread.run_sync(saves.complete, index, limiter=threads)

    return cycle


async def run_bare(base: str, cycles: int, concurrency: int, payload: int) -> Sample:
    """The same saves with no journal logic, one worker-thread trip per save."""
    async with run_directory(base, "bare-") as root:
        return await _measure(save_cycle(BareSaves(root, payload)), cycles, concurrency)


async def run_limit(base: str, cycles: int, concurrency: int, payload: int) -> Sample:
    """Every system call the store makes (``StoreSaves``), one worker-thread trip per save."""
    async with run_directory(base, "limit-") as root:
        saves = StoreSaves(root, payload)
        try:
            return await _measure(save_cycle(saves), cycles, concurrency)
        finally:
            saves.close()


WORKLOADS = {"journal": run_journal, "limit": run_limit, "bare": run_bare}


# ---------------------------------------------------------------------- driver


@dataclass
class Settings:
    cycles: int
    concurrency: int
    rounds: int
    payload: int
    base: str


async def _run_round(backend: str, round_index: int, settings: Settings) -> dict[str, Sample]:
    """One round on one backend: both workloads (order alternating by round), then idle."""
    # Warm up worker threads and caches of this event loop; not recorded.
    warmup = min(settings.cycles, settings.concurrency * 4)
    for run in WORKLOADS.values():
        await run(settings.base, warmup, settings.concurrency, settings.payload)
    order = ("journal", "limit", "bare") if round_index % 2 == 0 else ("bare", "limit", "journal")
    samples: dict[str, Sample] = {}
    for name in order:
        sample = await WORKLOADS[name](
            settings.base, settings.cycles, settings.concurrency, settings.payload
        )
        samples[name] = sample
        print(
            f"  round {round_index + 1}/{settings.rounds} {backend:<7} {name:<7} "
            f"{sample.rate:8.1f} cycles/s  p50 {sample.p50_ms:6.3f} ms  "
            f"p99 {sample.p99_ms:7.3f} ms  ({sample.seconds:.2f} s, {len(sample.lags)} ticks)",
            file=sys.stderr,
            flush=True,
        )
    samples["idle"] = await _idle_sample()
    return samples


Results = dict[str, dict[str, list[Sample]]]  # backend -> workload -> one sample a round


def _run_all(backends: tuple[str, ...], settings: Settings) -> Results:
    """Every round runs each backend once; the backend order alternates too."""
    results: Results = {
        backend: {name: [] for name in (*WORKLOADS, "idle")} for backend in backends
    }
    for round_index in range(settings.rounds):
        order = backends if round_index % 2 == 0 else backends[::-1]
        for backend in order:
            samples = anyio.run(_run_round, backend, round_index, settings, backend=backend)
            for name, sample in samples.items():
                results[backend][name].append(sample)
    return results


def _report(settings: Settings, results: Results) -> bool:
    main_rows: list[list[str]] = []
    ratio_rows: list[list[str]] = []
    all_pass = True
    for backend, by_workload in results.items():
        medians: dict[str, tuple[float, float, float]] = {}
        for name in (*WORKLOADS, "idle"):
            samples = by_workload[name]
            medians[name] = (
                median([sample.rate for sample in samples]),
                median([sample.p50_ms for sample in samples]),
                median([sample.p99_ms for sample in samples]),
            )
            rate, p50, p99 = medians[name]
            main_rows.append(
                [
                    backend,
                    name,
                    "-" if name == "idle" else f"{rate:.1f}",
                    f"{p50:.3f}",
                    f"{p99:.3f}",
                ]
            )
        # Ratios are taken per round, journal against the limit run of the same round
        # (adjacent in time, so on the same disk state), then the median over rounds.
        paired = list(zip(by_workload["journal"], by_workload["limit"], strict=True))
        rate_ratios = [journal.rate / bare.rate for journal, bare in paired]
        saves_only = median(
            [
                journal.rate / bare.rate
                for journal, bare in zip(by_workload["journal"], by_workload["bare"], strict=True)
            ]
        )
        lag_ratios = [
            journal.p99_ms / bare.p99_ms if bare.p99_ms > 0 else math.inf
            for journal, bare in paired
        ]
        throughput = median(rate_ratios)
        lag = median(lag_ratios)
        throughput_ok = throughput >= THROUGHPUT_GOAL
        lag_ok = lag <= LAG_GOAL
        all_pass = all_pass and throughput_ok and lag_ok
        ratio_rows.append(
            [
                backend,
                f"{throughput:.3f}",
                verdict(throughput_ok),
                f"{lag:.3f}",
                verdict(lag_ok),
                by_round(rate_ratios),
                by_round(lag_ratios),
                f"{saves_only:.3f}",
            ]
        )

    print(
        f"file store: begin+complete cycles, {settings.cycles} cycles x {settings.rounds} rounds, "
        f"concurrency {settings.concurrency}, bare payload {settings.payload} B "
        f"(medians over rounds; lag = lateness of a {TICK * 1000:g} ms sleep)"
    )
    print()
    print(table(["backend", "workload", "cycles/s", "p50 lag ms", "p99 lag ms"], main_rows))
    print()
    print(
        table(
            [
                "backend",
                "journal/limit cycles/s",
                f"goal >= {THROUGHPUT_GOAL:.2f}",
                "journal/limit p99 lag",
                f"goal <= {LAG_GOAL:.2f}",
                "cycles/s ratio by round",
                "p99 lag ratio by round",
                "journal/bare cycles/s",
            ],
            ratio_rows,
        )
    )
    print(
        "ratios: each round's journal run against the limit run of the same round, "
        "median over rounds; journal/bare: against the saves alone (no lock, no read)"
    )
    return all_pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Journal file store vs its system-call limit: throughput and loop lag."
    )
    parser.add_argument(
        "--traced-calls",
        action="store_true",
        help="compare the audited calls of one store cycle with the limit's, then exit",
    )
    parser.add_argument("--cycles", type=positive, default=2000, help="cycles per run")
    parser.add_argument("--concurrency", type=positive, default=16, help="tasks per run")
    parser.add_argument("--rounds", type=positive, default=3, help="rounds per backend")
    parser.add_argument(
        "--payload", type=positive, default=1024, help="bytes per bare save (default 1024)"
    )
    parser.add_argument(
        "--backend", choices=[*BACKENDS, "both"], default="both", help="which anyio backend(s)"
    )
    add_common_arguments(parser)
    args = parser.parse_args(argv)

    if args.traced_calls:
        with tempfile.TemporaryDirectory(prefix="itemjournal-trace-", dir=args.dir) as base:
            found = traced_calls(base)
        same = found["store"] == found["limit"]
        print(json.dumps({"same": same, **{name: len(calls) for name, calls in found.items()}}))
        return 0

    backends = BACKENDS if args.backend == "both" else (args.backend,)

    def measure(base: str) -> tuple[Settings, Results]:
        settings = Settings(args.cycles, args.concurrency, args.rounds, args.payload, base)
        return settings, _run_all(backends, settings)

    versions = {"anyio": package_version("anyio"), "trio": package_version("trio")}
    return run_benchmark(
        args.dir, versions, measure, lambda done: _report(*done), strict=args.strict
    )


if __name__ == "__main__":
    sys.exit(main())
