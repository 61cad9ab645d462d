"""Crash consistency of the file store, checked exhaustively with ``_crashsim``.

A scripted workload (begin new, mark_review, resolve with retry, begin after release,
complete on one identity; then begin new and resolve with a receipt on a second identity
in the same fan-out directory) runs through a ``RecordingFileSystem``. For each operation,
starting from the durable state before it, every crash point (after 0, 1, …, all of its
filesystem calls) and every on-disk state the crash model allows there is built in a
fresh directory, reopened, and checked:

1. an acknowledged operation (all its calls done: it returned) is never lost, and an
   unacknowledged one left either the old record or the new one, byte for byte;
2. a record is never partial; were one found, ``inspect`` and ``begin`` must refuse it as
   ``RECORD_INVALID`` and leave its bytes alone;
3. ``begin`` after the crash never grants a second claim while an acknowledged claim or
   completion stands;
4. temp leftovers never shadow a record; reopening keeps those whose named writer lives
   (here: this very process, so that is the only safe answer), and once renamed to a dead
   writer they are swept on open with ``temp_grace=0`` without touching any record.

The same test runs the workload over two broken stores, one whose directory fsync does
nothing and one whose file fsync does nothing, and requires the simulator to find
violations in each: proof that it can see the failures it is meant to rule out.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio.to_thread
import pytest
from _crashsim import CrashState, Image, Op, RecordingFileSystem, crash_states, materialize

from itemjournal import (
    Claim,
    ConflictError,
    FileStore,
    FileSystem,
    Identity,
    Journal,
    RecordInvalid,
    definition_digest,
)

FIRST = Identity("shop", "billing", "charge", "order-1")
INPUTS = {"amount": "10"}
DEFINITION = definition_digest("v1")
DEAD_PID = 2**22 + 1  # above the largest possible Linux pid_max: surely no live process
_TEMP = re.compile(r"\.(\d+)-(\d*)-([0-9a-f]{32})\.tmp")


def neighbour_of(identity: Identity) -> Identity:
    """Another identity whose record lives in the same fan-out directory."""
    store = FileStore("/nonexistent")
    fanout = store.path_for(identity).parent
    for number in range(2, 10_000):
        other = identity._replace(item=f"order-{number}")
        if store.path_for(other).parent == fanout:
            return other
    raise AssertionError("no neighbour found")


SECOND = neighbour_of(FIRST)


# ---------------------------------------------------------------------- the stores under test


class SkipDirSync(RecordingFileSystem):
    """Broken on purpose: a directory fsync does nothing (and so is never recorded)."""

    def fsync_dir(self, fd: int) -> None:
        return None


class SkipFileSync(RecordingFileSystem):
    """Broken on purpose: a file fsync does nothing (and so is never recorded)."""

    def fsync(self, fd: int) -> None:
        return None


class Unsynced(FileSystem):
    """For the journals that inspect crash states: their own durability is irrelevant."""

    def fsync(self, fd: int) -> None:
        return None

    def fsync_dir(self, fd: int) -> None:
        return None


# ---------------------------------------------------------------------- recording the workload


@dataclass
class Recorded:
    """One journal operation: its durable pre-state, its calls, its record before and after."""

    name: str
    identity: Identity
    record: str  # the record's path relative to the root
    pre: Image
    ops: list[Op]
    before: bytes | None
    after: bytes | None
    others: dict[str, bytes] = field(default_factory=dict)  # other records, unchanged


def status_of(data: bytes | None) -> str:
    return "absent" if data is None else str(json.loads(data)["status"])


def read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


async def record_workload(root: Path, fs: RecordingFileSystem) -> list[Recorded]:
    store = FileStore(str(root), fs=fs)
    await store.open()
    journal = Journal(store)
    claims: dict[Identity, Claim] = {}

    async def begin(identity: Identity) -> None:
        outcome = await journal.begin(identity, INPUTS, DEFINITION)
        assert isinstance(outcome, Claim)
        claims[identity] = outcome

    steps: list[tuple[str, Identity, Callable[[], Awaitable[object]]]] = [
        ("begin new", FIRST, lambda: begin(FIRST)),
        ("mark_review", FIRST, lambda: journal.mark_review(FIRST, "timeout")),
        ("resolve retry", FIRST, lambda: journal.resolve(FIRST, retry=True, note="not charged")),
        ("begin after release", FIRST, lambda: begin(FIRST)),
        ("complete", FIRST, lambda: journal.complete(claims[FIRST], "ch_1")),
        ("begin new, same fan-out", SECOND, lambda: begin(SECOND)),
        ("mark_review 2", SECOND, lambda: journal.mark_review(SECOND)),
        ("resolve receipt", SECOND, lambda: journal.resolve(SECOND, receipt="ch_2", note="ok")),
    ]
    recorded: list[Recorded] = []
    for name, identity, run in steps:
        path = store.path_for(identity)
        pre = await anyio.to_thread.run_sync(Image.scan, root)
        before = await anyio.to_thread.run_sync(read, path)
        fs.start(pre)
        await run()
        ops = fs.take()
        after = await anyio.to_thread.run_sync(read, path)
        record = os.path.relpath(path, root)
        others = {
            name: (root / name).read_bytes()
            for name in pre.names
            if name.endswith(".json") and name != record
        }
        recorded.append(Recorded(name, identity, record, pre, ops, before, after, others))
    return recorded


# ---------------------------------------------------------------------- checking one state


def temps_in(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if _TEMP.fullmatch(p.name))


def kill_writers(root: Path) -> list[Path]:
    """Rename every temp as if its writer had died long ago; the new paths.

    Alternately a pid that no process has, and this process's pid with another start
    time: after a reboot, a new process may well have the crashed writer's pid.
    """
    renamed: list[Path] = []
    old = time.time() - 3600
    for number, temp in enumerate(temps_in(root)):
        match = _TEMP.fullmatch(temp.name)
        assert match is not None
        writer = f"{DEAD_PID}-20240101000000123" if number % 2 else f"{os.getpid()}-1"
        dead = temp.with_name(f".{writer}-{match[3]}.tmp")
        temp.rename(dead)
        os.utime(dead, (old, old), follow_symlinks=False)
        renamed.append(dead)
    return renamed


def build(state: CrashState, root: Path) -> list[Path]:
    materialize(state, root)
    return temps_in(root)


async def check_state(
    step: Recorded, state: CrashState, acknowledged: bool, root: Path, tally: Tally
) -> list[str]:
    """Reopen a journal on ``state`` and return the violations found (empty: none)."""
    problems: list[str] = []
    temps = await anyio.to_thread.run_sync(build, state, root)
    record = root / step.record
    data = state.file(step.record)
    whole = data in (step.before, step.after)
    tally.with_temps += bool(temps)
    tally.with_invalid += not whole

    # (1) acknowledged work is never lost; unacknowledged work is all or nothing
    if not whole:
        problems.append("partial record at the destination")
    elif acknowledged and data != step.after:
        problems.append("acknowledged operation lost")
    for name, content in step.others.items():
        if state.file(name) != content:
            problems.append("another record changed or vanished")

    # (4a) the writer named in the temps is this live process: reopening must keep them
    store = FileStore(str(root), fs=Unsynced(), temp_grace=0)
    await store.open()
    journal = Journal(store)
    left = await anyio.to_thread.run_sync(temps_in, root)
    if left != temps:
        problems.append("a temp file of a live writer was swept")

    # (2) and (4) what inspect reports is the record file, never a temp
    try:
        view = await journal.inspect(step.identity)
    except RecordInvalid as error:
        assert error.code == "RECORD_INVALID"
        if whole:
            problems.append("a whole record was reported invalid")
    else:
        if not whole:
            problems.append("a partial record was read as valid")
        elif view.status != status_of(data):
            problems.append("inspect disagrees with the record file (shadowed)")

    # (4b) the same temps, written by a dead writer, are swept on open; records stay
    await anyio.to_thread.run_sync(kill_writers, root)
    await FileStore(str(root), fs=Unsynced(), temp_grace=0).open()
    if await anyio.to_thread.run_sync(temps_in, root):
        problems.append("a dead writer's old temp file was not swept")
    if await anyio.to_thread.run_sync(read, record) != data:
        problems.append("sweeping temp files changed the record")

    # (2) and (3) begin refuses an invalid record untouched, and never claims twice: a
    # claim is fine only over no record or a released one, judged by what was
    # acknowledged, or, for an operation cut short, by the whole record it left on disk
    # (an operator's release that reached the disk is a release even if unacknowledged)
    standing = status_of(step.after if acknowledged else data if whole else step.before)
    try:
        outcome = await journal.begin(step.identity, INPUTS, DEFINITION)
    except RecordInvalid:
        if whole:
            problems.append("begin refused a whole record")
        if await anyio.to_thread.run_sync(read, record) != data:
            problems.append("begin overwrote an invalid record")
    except ConflictError:
        pass
    else:
        if isinstance(outcome, Claim) and standing not in ("absent", "released"):
            problems.append(f"a second claim was granted over a {standing} record")
    await anyio.to_thread.run_sync(shutil.rmtree, root)
    return problems


@dataclass
class Tally:
    crash_points: int = 0
    states: int = 0
    violating_states: int = 0
    with_temps: int = 0  # states holding a leftover temp file (for check 4)
    with_invalid: int = 0  # states whose record was partial (for check 2)
    kinds: Counter[str] = field(default_factory=Counter)
    by_step: Counter[str] = field(default_factory=Counter)


async def simulate(workdir: Path, fs_class: type[RecordingFileSystem]) -> Tally:
    root = workdir / "journal"
    recorded = await record_workload(root, fs_class(root))
    tally = Tally()
    number = 0
    for step in recorded:
        distinct: dict[tuple[CrashState, bool], None] = {}
        for count in range(len(step.ops) + 1):
            tally.crash_points += 1
            acknowledged = count == len(step.ops)
            for state in crash_states(step.pre, step.ops[:count]):
                distinct.setdefault((state, acknowledged), None)
        for state, acknowledged in distinct:
            number += 1
            problems = await check_state(step, state, acknowledged, workdir / f"s{number}", tally)
            tally.states += 1
            if problems:
                tally.violating_states += 1
                tally.by_step[step.name] += 1
                tally.kinds.update(problems)
    return tally


def report(backend: str, variant: str, tally: Tally) -> str:
    line = (
        f"crash simulation [{backend}] {variant}: {tally.crash_points} crash points, "
        f"{tally.states} distinct crash states checked ({tally.with_temps} with temp leftovers, "
        f"{tally.with_invalid} with a partial record), {tally.violating_states} with violations"
    )
    if tally.kinds:
        line += f" {dict(tally.kinds)}; by operation {dict(tally.by_step)}"
    return line


# ---------------------------------------------------------------------- the tests


@pytest.mark.anyio
async def test_no_crash_state_loses_or_duplicates_work_and_broken_stores_are_caught(
    anyio_backend: str, tmp_path: Path
) -> None:
    real = await simulate(tmp_path / "real", RecordingFileSystem)
    no_dir_sync = await simulate(tmp_path / "no-dir-sync", SkipDirSync)
    no_file_sync = await simulate(tmp_path / "no-file-sync", SkipFileSync)

    print()
    print(report(anyio_backend, "real store", real))
    print(report(anyio_backend, "store without directory fsync", no_dir_sync))
    print(report(anyio_backend, "store without file fsync", no_file_sync))

    assert real.states > 40
    assert real.with_temps > 0  # the sweep checks were not vacuous
    assert real.violating_states == 0, dict(real.kinds)
    assert no_dir_sync.violating_states > 0
    assert no_dir_sync.kinds["acknowledged operation lost"] > 0
    assert any(kind.startswith("a second claim") for kind in no_dir_sync.kinds)
    assert no_file_sync.violating_states > 0
    assert no_file_sync.kinds["partial record at the destination"] > 0
    # partial records were met, and inspect and begin refused them without overwriting
    assert no_file_sync.with_invalid > 0
    assert set(no_file_sync.kinds) == {"partial record at the destination"}


# ---------------------------------------------------------------------- the model itself


def _log(*ops: tuple[str, dict[str, object]]) -> list[Op]:
    return [Op(index, kind, **fields) for index, (kind, fields) in enumerate(ops)]  # type: ignore[arg-type]


EMPTY = Image({".", "d"}, {}, {})


def test_model_unsynced_data_may_be_lost_kept_torn_or_zeroed() -> None:
    ops = _log(
        ("create", {"path": "d/f", "inode": 1}),
        ("write", {"inode": 1, "data": b"abcd"}),
        ("fsync_dir", {"path": "d"}),
    )
    found = {state.file("d/f") for state in crash_states(EMPTY, ops)}
    assert found == {b"", b"ab", b"abcd", b"\0\0\0\0"}


def test_model_fsync_makes_data_durable_and_dir_fsync_makes_names_durable() -> None:
    ops = _log(
        ("create", {"path": "d/f", "inode": 1}),
        ("write", {"inode": 1, "data": b"abcd"}),
        ("fsync", {"inode": 1}),
    )
    assert {s.file("d/f") for s in crash_states(EMPTY, ops)} == {None, b"abcd"}
    ops.append(Op(3, "fsync_dir", path="d"))
    assert {s.file("d/f") for s in crash_states(EMPTY, ops)} == {b"abcd"}
    ops.append(Op(4, "fsync_dir", path="."))  # another directory's sync covers nothing here
    ops.append(Op(5, "unlink", path="d/f", inode=1))
    ops.append(Op(6, "fsync_dir", path="."))
    assert {s.file("d/f") for s in crash_states(EMPTY, ops)} == {None, b"abcd"}


def test_model_unsynced_changes_survive_in_any_subset_and_renames_whole() -> None:
    pre = Image({".", "d"}, {"d/r": 1}, {1: b"old"})
    ops = _log(
        ("create", {"path": "d/t", "inode": 2}),
        ("write", {"inode": 2, "data": b"new"}),
        ("fsync", {"inode": 2}),
        ("rename", {"path": "d/r", "source": "d/t", "inode": 2}),
    )
    seen = {(s.file("d/r"), s.file("d/t")) for s in crash_states(pre, ops)}
    # never both names for the new inode, never the record gone, never a torn record
    assert seen == {(b"old", None), (b"old", b"new"), (b"new", None)}


def test_model_loses_what_was_inside_a_lost_directory() -> None:
    pre = Image({"."}, {}, {})
    ops = _log(
        ("mkdir", {"path": "d"}),
        ("create", {"path": "d/f", "inode": 1}),
        ("fsync", {"inode": 1}),
        ("fsync_dir", {"path": "d"}),
    )
    seen = {(s.dirs, s.file("d/f")) for s in crash_states(pre, ops)}
    assert seen == {((".",), None), ((".", "d"), b"")}
