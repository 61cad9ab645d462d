"""Where a store's CPU goes: a py-spy profile of begin + complete cycles, summarised.

``make bench-profile`` runs this script: it starts one workload under
``py-spy record --threads`` (every thread is sampled, so the SQLite writer's and the
file store's worker threads count, not only the event loop's), then prints the frames
that held the most samples, by their own time and with what they called, as a table.

    .venv/bin/python benchmarks/profile.py --store sqlite --concurrency 16 --cycles 4000
    .venv/bin/python benchmarks/profile.py --store memory --top 25

Samples of threads that wait (an idle worker thread in ``Condition.wait``, the event loop
in ``select``) are counted apart and left out of the shares: the table shows where the
CPU went, in Python and in the C it calls (a C call counts as its caller's own time).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
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


def _run(store: str, cycles: int, concurrency: int) -> None:
    """The profiled workload: ``cycles`` begin + complete cycles at ``concurrency``."""
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
            cycle = journal_cycle(journal, store, definition_digest("profile-v1"))
            await drive_cycles(cycle, cycles, concurrency)

    with tempfile.TemporaryDirectory(prefix="ij-profile-", dir=os.getcwd()) as scratch:
        anyio.run(main, scratch)


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
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        _run(args.store, args.cycles, args.concurrency)
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
            f"py-spy at {args.rate} Hz, every thread"
        )
        print(summarise(raw, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
