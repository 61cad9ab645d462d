"""Where a store's CPU goes: a py-spy profile of begin + complete cycles, summarised.

``make bench-profile`` runs this script: it starts one workload under
``py-spy record --threads`` (every thread is sampled, so the SQLite writer's and the
file store's worker threads count, not only the event loop's), then prints the frames
that held the most samples, by their own time and with what they called, as a table.

    .venv/bin/python benchmarks/profile.py --store sqlite --concurrency 16 --cycles 4000
    .venv/bin/python benchmarks/profile.py --store memory --top 25
    .venv/bin/python benchmarks/profile.py --store sqlite --cpu

Samples of threads that wait (an idle worker thread in ``Condition.wait``, the event loop
in ``select``) are counted apart and left out of the shares: the table shows where the
time went, in Python and in the C it calls (a C call counts as its caller's own time).

How py-spy samples matters. By default this script has it read the process without
stopping it (``--nonblocking``): a thread that waits for the GIL inside a C call then
counts as its caller's own time. ``--pause`` stops the process for every sample, as
py-spy does by default; on the machines of ``benchmarks/README.md`` those samples gather
at system calls (a third of the event loop's fell on ``getpid``, 93 ns a call, inside
``asyncio.get_running_loop``). ``--gil`` samples only the thread holding the GIL.

``--cpu`` runs no sampler: it runs the workload in this process and prints each
thread's user and system CPU per cycle (Linux ``/proc/self/task``, clock ticks of
10 ms: over 20,000 cycles a thread's figure is good to about half a microsecond), which
says which thread a store is bound by.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STORES = ("memory", "file", "sqlite")
# Leaf frames of a thread that is waiting, not working.
WAITING = frozenset(
    {
        "Condition.wait (threading.py)",
        "EpollSelector.select (selectors.py)",
        "Event.wait (threading.py)",
        "Thread._wait_for_tstate_lock (threading.py)",
        # an idle thread of the stores' pool, waiting for a call (a lock's acquire)
        "_Pool._serve (itemjournal/_stores/workers.py)",
    }
)


def _run(store: str, cycles: int, concurrency: int, *, cpu: bool = False) -> None:
    """The profiled workload: ``cycles`` begin + complete cycles at ``concurrency``; with
    ``cpu``, after 500 cycles of warm-up, and each thread's CPU per cycle printed."""
    import anyio
    from _common import drive_cycles, journal_cycle

    from itemjournal import Journal, definition_digest
    from itemjournal.testing import MemoryStore

    async def main(scratch: str) -> None:
        if store == "memory":
            journal = Journal(MemoryStore())
        elif store == "file":
            journal = await Journal.open(scratch)
        else:
            journal = await Journal.open(f"sqlite://{scratch}/j.db")
        async with journal:
            definition = definition_digest("profile-v1")
            cycle = journal_cycle(journal, store, definition)
            if not cpu:
                await drive_cycles(cycle, cycles, concurrency)
                return
            warm_up = journal_cycle(journal, f"{store}-warm", definition)
            await drive_cycles(warm_up, 500, concurrency)
            before, started, process = _thread_times(), time.perf_counter(), time.process_time()
            await drive_cycles(cycle, cycles, concurrency)
            after, seconds = _thread_times(), time.perf_counter() - started
            process = time.process_time() - process
            names = {thread.native_id: thread.name for thread in threading.enumerate()}
        print(
            f"{store} store, asyncio c{concurrency}, {cycles:,} cycles: "
            f"{cycles / seconds:,.0f} cycles/s, process CPU {process / cycles * 1e6:.1f} µs/cycle"
        )
        print(_cpu_table(before, after, names, cycles))

    with tempfile.TemporaryDirectory(prefix="ij-profile-", dir=os.getcwd()) as scratch:
        anyio.run(main, scratch)


def _thread_times() -> dict[int, tuple[float, float]]:
    """User and system CPU seconds of each thread of this process, by native thread id."""
    ticks = os.sysconf("SC_CLK_TCK")
    times: dict[int, tuple[float, float]] = {}
    for entry in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{entry}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        times[int(entry)] = (int(fields[11]) / ticks, int(fields[12]) / ticks)
    return times


def _cpu_table(
    before: dict[int, tuple[float, float]],
    after: dict[int, tuple[float, float]],
    names: dict[int | None, str],
    cycles: int,
) -> str:
    """Each kind of thread's CPU per cycle (threads of one name summed)."""
    kinds: dict[str, list[float]] = {}
    for native_id, (user, system) in after.items():
        user_before, system_before = before.get(native_id, (0.0, 0.0))
        name = names.get(native_id, "ended threads")
        if name.startswith("itemjournal writer"):
            name = "itemjournal writer"
        elif name == "MainThread":
            name = "MainThread (the event loop)"
        row = kinds.setdefault(name, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += user - user_before
        row[2] += system - system_before
    lines = ["| thread | threads | user µs/cycle | system µs/cycle |", "|---|---|---|---|"]
    for name, (count, user, system) in sorted(kinds.items(), key=lambda item: -item[1][1]):
        if user + system > 0:
            user_us, system_us = user / cycles * 1e6, system / cycles * 1e6
            lines.append(f"| {name} | {count:.0f} | {user_us:.1f} | {system_us:.1f} |")
    return "\n".join(lines)


def summarise(raw: Path, top: int) -> str:
    """The frames with the most samples of their own, and with the most in all, as one
    table (py-spy's raw format: one ``frame;frame;...;leaf count`` line per stack)."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = waiting = 0
    for line in raw.read_text(encoding="utf-8").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_short(frame) for frame in stack.split(";")]
        frames = [frame for frame in frames if frame]
        if not frames:
            continue
        if frames[-1] in WAITING:
            waiting += count
            continue
        samples += count
        own[frames[-1]] += count
        for frame in set(frames):
            total[frame] += count
    lines = [
        f"{samples:,} samples of work ({waiting:,} of waiting left out)",
        "",
        "| own % | with callees % | frame |",
        "|---|---|---|",
    ]
    for frame, count in own.most_common(top):
        lines.append(
            f"| {100 * count / samples:.1f} | {100 * total[frame] / samples:.1f} | `{frame}` |"
        )
    return "\n".join(lines)


def _short(frame: str) -> str:
    """``function (path:line)`` as ``function (module)``: the line numbers split a
    function's samples, and the paths differ between machines."""
    name, _, where = frame.partition(" (")
    if name in ("process", "thread") or name.startswith(("process ", "thread ")):
        return ""  # py-spy's root frames of a process and of a thread
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("/itemjournal/", "/site-packages/", "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            if marker == "/itemjournal/":
                path = "itemjournal/" + path
            break
    return f"{name} ({path})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=STORES, default="sqlite")
    parser.add_argument("--cycles", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--rate", type=int, default=400, help="samples per second")
    sampling = parser.add_mutually_exclusive_group()
    sampling.add_argument(
        "--pause",
        action="store_true",
        help="stop the process for each sample, as py-spy does by default (see the README: "
        "the samples then gather at system calls)",
    )
    sampling.add_argument(
        "--gil",
        action="store_true",
        help="sample only the thread that holds the GIL (the process is stopped for each sample)",
    )
    sampling.add_argument(
        "--cpu",
        action="store_true",
        help="no sampler: each thread's user and system CPU per cycle, measured in-process",
    )
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run or args.cpu:
        _run(args.store, args.cycles, args.concurrency, cpu=args.cpu)
        return 0
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(py_spy):
        print("py-spy is not installed (pip install py-spy)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ij-pyspy-") as scratch:
        raw = Path(scratch) / "profile.txt"
        command = [
            py_spy,
            "record",
            "--threads",
            *(["--gil"] if args.gil else [] if args.pause else ["--nonblocking"]),
            "--format",
            "raw",
            "--rate",
            str(args.rate),
            "--output",
            str(raw),
            "--",
            sys.executable,
            __file__,
            "--run",
            "--store",
            args.store,
            "--cycles",
            str(args.cycles),
            "--concurrency",
            str(args.concurrency),
        ]
        subprocess.run(command, check=True, capture_output=True)
        print(
            f"{args.store} store, asyncio c{args.concurrency}, {args.cycles:,} cycles, "
            f"py-spy at {args.rate} Hz, every thread, "
            f"{'GIL holder only' if args.gil else 'paused' if args.pause else 'not paused'}"
        )
        print(summarise(raw, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
