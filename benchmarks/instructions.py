"""Instructions per ``begin`` + ``complete`` on ``MemoryStore``, counted by callgrind.

``make bench-instructions`` runs this script. It starts Python under
``valgrind --tool=callgrind`` twice per workload, once for ``CYCLES`` cycles and once for
none, and divides the difference of the two totals by ``CYCLES``: what the interpreter
start, the imports and the event loop cost cancels out, and what is left is the cost of
one cycle. Instruction counts do not depend on what else the machine is doing, so the
figure is repeatable where seconds are not.

Three workloads, side by side:

``journal``
    ``Journal(MemoryStore())``: ``begin`` (a fresh claim) then ``complete``, each cycle
    on a new identity, one task, on asyncio.
``sync``
    the same cycles through the blocking face, ``itemjournal.sync.Journal(MemoryStore())``,
    called from the main thread: no event loop anywhere in the process.
``floor``
    what any journal of this design must spend per cycle: fingerprint the inputs and the
    identity, encode a started and a succeeded record of the same fields (one
    ``json.dumps`` each) and parse each back (one ``json.loads`` each), and two event-loop
    checkpoints.

``--file-store`` adds a third: the journal over the file store in a scratch directory
(``Journal.open``), also one task. Only user-space instructions are counted, so the
fsyncs' waits and the kernel's work do not show; what does is the journal's and the
store's Python and the hand-off to the worker threads.

The goals: the journal's count at most 600,000 instructions per cycle, and the blocking
face's count no more than the async face's (the blocking face is generated from the async
one; what it drops is the event loop, so a cycle of it must not cost more). ``--strict``
exits 1 when either is missed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CYCLES = 200
GOAL = 600_000
WORKLOADS = ("journal", "sync", "floor")


# ---------------------------------------------------------------------- the workloads


def _run_journal(cycles: int) -> None:
    import anyio

    from itemjournal import Claim, Journal
    from itemjournal.testing import MemoryStore

    async def main() -> None:
        journal = Journal(MemoryStore())
        definition = "bench-instructions-v1"
        # One cycle before counting starts for real: every cache and lazy import warm
        # in both runs, so that the difference is the steady state.
        for index in range(-1, cycles):
            claim = await journal.begin(
                ("bench", "instructions", "cycle", f"i{index + 1}"), {"n": str(index)}, definition
            )
            assert isinstance(claim, Claim)
            await journal.complete(claim, f"receipt-{index}")
        await journal.aclose()

    anyio.run(main)


def _run_sync(cycles: int) -> None:
    from itemjournal import Claim
    from itemjournal.sync import Journal
    from itemjournal.testing import MemoryStore

    journal = Journal(MemoryStore())
    definition = "bench-instructions-v1"
    for index in range(-1, cycles):  # one cycle to warm up, as in the async run
        claim = journal.begin(
            ("bench", "instructions", "cycle", f"i{index + 1}"), {"n": str(index)}, definition
        )
        assert isinstance(claim, Claim)
        journal.complete(claim, f"receipt-{index}")
    journal.close()


def _run_file(cycles: int) -> None:
    import anyio

    from itemjournal import Claim, Journal

    async def main(root: str) -> None:
        async with await Journal.open(root) as journal:
            for index in range(-1, cycles):  # one cycle to warm up, as above
                claim = await journal.begin(
                    ("bench", "instructions", "file", f"i{index + 1}"), {"n": str(index)}, "v1"
                )
                assert isinstance(claim, Claim)
                await journal.complete(claim, f"receipt-{index}")

    with tempfile.TemporaryDirectory(prefix="ij-callgrind-file-", dir=os.getcwd()) as root:
        anyio.run(main, root)


def _run_floor(cycles: int) -> None:
    import anyio
    import anyio.lowlevel

    async def main() -> None:
        definition = hashlib.sha256(b"bench-instructions-v1").hexdigest()
        for index in range(-1, cycles):
            identity = ["bench", "instructions", "cycle", f"i{index + 1}"]
            key = json.dumps(identity, separators=(",", ":")).encode()
            digest = hashlib.sha256(key).hexdigest()
            inputs = json.dumps({"n": str(index)}, sort_keys=True, separators=(",", ":"))
            input_hash = hashlib.sha256(inputs.encode()).hexdigest()
            record = {
                "version": 1,
                "identity": identity,
                "input_kind": "sha256",
                "input_hash": input_hash,
                "definition_hash": definition,
                "claim_id": digest[:32],
                "status": "started",
                "receipt": None,
                "attempt": 1,
                "created_at": "2026-12-02T00:00:00.000000+00:00",
                "updated_at": "2026-12-02T00:00:00.000000+00:00",
                "owner": {"host": "h", "pid": 1, "started_at": "1", "process": "p"},
                "review_reason": None,
                "history": [{"at": "t", "event": "begin", "status": "started", "attempt": 1}],
            }
            json.loads(json.dumps(record, separators=(",", ":")))
            await anyio.lowlevel.checkpoint()
            record["status"] = "succeeded"
            record["receipt"] = f"receipt-{index}"
            record["history"].append(  # type: ignore[attr-defined]
                {"at": "t", "event": "complete", "status": "succeeded", "attempt": 1}
            )
            json.loads(json.dumps(record, separators=(",", ":")))
            await anyio.lowlevel.checkpoint()

    anyio.run(main)


# ---------------------------------------------------------------------- counting


def count(workload: str, cycles: int, valgrind: str) -> int:
    """The total instructions callgrind counted for one run of ``workload``."""
    with tempfile.TemporaryDirectory(prefix="ij-callgrind-") as scratch:
        out = Path(scratch) / "callgrind.out"
        env = dict(os.environ, PYTHONHASHSEED="0", PYTHONDONTWRITEBYTECODE="1")
        done = subprocess.run(
            [
                valgrind,
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--run",
                workload,
                str(cycles),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise SystemExit(f"callgrind run of {workload} failed:\n{done.stderr[-2000:]}")
        found = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.MULTILINE)
        if found is None:
            raise SystemExit(f"no total in the callgrind output of {workload}")
        return int(found.group(1))


def per_cycle(
    cycles: int, valgrind: str, workloads: tuple[str, ...] = WORKLOADS
) -> dict[str, float]:
    """Instructions per cycle of each workload: (a run of ``cycles`` - a run of 0) / cycles."""
    counted: dict[str, float] = {}
    for workload in workloads:
        print(f"counting {workload}: {cycles} cycles and 0", file=sys.stderr)
        full = count(workload, cycles, valgrind)
        empty = count(workload, 0, valgrind)
        counted[workload] = (full - empty) / cycles
    return counted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=CYCLES)
    parser.add_argument("--strict", action="store_true", help="exit 1 when the goal is missed")
    parser.add_argument(
        "--file-store", action="store_true", help="also count the journal over the file store"
    )
    parser.add_argument("--run", nargs=2, metavar=("WORKLOAD", "CYCLES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        workload, cycles = args.run[0], int(args.run[1])
        runs = {"journal": _run_journal, "sync": _run_sync, "floor": _run_floor, "file": _run_file}
        runs[workload](cycles)
        return 0

    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    counted = per_cycle(args.cycles, valgrind, WORKLOADS + (("file",) if args.file_store else ()))
    journal, sync, floor = counted["journal"], counted["sync"], counted["floor"]
    met = journal <= GOAL
    sync_met = sync <= journal
    print("| workload | instructions per cycle | / floor |")
    print("|---|---|---|")
    print(f"| journal over MemoryStore | {journal:,.0f} | {journal / floor:.2f} |")
    print(f"| blocking face over MemoryStore | {sync:,.0f} | {sync / floor:.2f} |")
    print(f"| floor | {floor:,.0f} | 1.00 |")
    if "file" in counted:
        file = counted["file"]
        print(f"| journal over the file store | {file:,.0f} | {file / floor:.2f} |")
    print(f"goal: journal <= {GOAL:,} per cycle: {'PASS' if met else 'MISS'}")
    print(
        f"goal: blocking face <= async face per cycle: {'PASS' if sync_met else 'MISS'} "
        f"({sync:,.0f} / {journal:,.0f} = {sync / journal:.2f})"
    )
    return 1 if args.strict and not (met and sync_met) else 0


if __name__ == "__main__":
    sys.exit(main())
