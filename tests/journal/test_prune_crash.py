"""``itemjournal prune`` killed (SIGKILL) at random points leaves a valid journal.

A journal of a few hundred records, most of them old and succeeded or released, is
copied for each run; ``python -m itemjournal prune`` is started on the copy and killed
at a random moment. Afterwards the journal verifies clean, every record left reads, and
the only records missing are old succeeded or released ones. The moments are taken from
the removals themselves, not from a clock measured once: a few runs are killed before the
first removal, the others at stratified points of the removals (seen by counting the
records from outside while the prune runs), so kills land before, during and after them
however loaded the machine is.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from _builders import written_long_ago

from itemjournal import Claim, Identity, Journal, RecordView, definition_digest

pytestmark = pytest.mark.slow

DEFINITION = definition_digest("prune-crash-v1")
OLD = "2020-01-02T03:04:05.000000+00:00"
RUNS = 16
BEFORE = 3  # runs killed before the first removal
PLAN = {  # status -> how many old records; plus YOUNG recent succeeded ones
    "succeeded": 240,
    "released": 30,
    "needs_review": 15,
    "started": 15,
}
YOUNG = 20
PRUNABLE = ("succeeded", "released")
ENV_DROP = ("ITEMJOURNAL_LOCATION", "ITEMJOURNAL_INPUT_KEY_FILE")


def _location(kind: str, base: Path) -> str:
    return f"sqlite://{base}/journal.db" if kind == "sqlite" else str(base / "journal")


def _patch_clock(monkeypatch: pytest.MonkeyPatch, stamp: str) -> None:
    from itemjournal._model import records as _records

    real = _records.utc_now
    for name, module in list(sys.modules.items()):
        if name.startswith("itemjournal") and getattr(module, "utc_now", None) is real:
            monkeypatch.setattr(module, "utc_now", lambda: stamp)


async def _fill(location: str, plan: dict[str, int], prefix: str) -> None:
    limiter = anyio.CapacityLimiter(16)
    async with await Journal.open(location) as journal:

        async def one(status: str, n: int) -> None:
            async with limiter:
                identity = Identity("shop", "billing", status, f"{prefix}{n:04}")
                claim = await journal.begin(identity, {"n": n}, DEFINITION)
                assert isinstance(claim, Claim)
                if status == "succeeded":
                    await journal.complete(claim, f"r{n}")
                elif status in ("needs_review", "released"):
                    await journal.mark_review(identity, "timeout")
                    if status == "released":
                        await journal.resolve(identity, retry=True, note="no charge")

        async with anyio.create_task_group() as group:
            for status, count in plan.items():
                for n in range(count):
                    group.start_soon(one, status, n)


async def _survey(location: str) -> tuple[dict[Identity, str], list[str], tuple[str, ...]]:
    """Every record's status, what could not be read, and what verify says."""
    found: dict[Identity, str] = {}
    unreadable: list[str] = []
    async with await Journal.open(location) as journal:
        async for item in journal.records(problems=True):
            if isinstance(item, RecordView):
                found[item.identity] = item.status
            else:
                unreadable.append(str(item))
        for identity in list(found)[::25]:  # and the records read one by one, too
            assert (await journal.inspect(identity)).status == found[identity]
        return found, unreadable, await journal.verify()


def survey(location: str) -> tuple[dict[Identity, str], list[str], tuple[str, ...]]:
    result: tuple[dict[Identity, str], list[str], tuple[str, ...]] = anyio.run(_survey, location)
    return result


def _copy(kind: str, template: Path, target: Path) -> None:
    """Copy the template's journal so that ``_location(kind, target)`` names the copy."""
    target.mkdir(mode=0o700)
    if kind == "sqlite":
        for path in template.iterdir():
            shutil.copy2(path, target / path.name)
    else:
        shutil.copytree(template, target / "journal")


def _count(kind: str, location: str) -> int:
    """How many records the journal holds, counted from outside as a prune runs."""
    if kind == "sqlite":
        path = location[len("sqlite://") :]
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as reader:
            (count,) = reader.execute("SELECT count(*) FROM itemjournal_records").fetchone()
        return int(count)
    return sum(1 for _ in Path(location).glob("??/*.json"))


def _first_removal(kind: str, location: str, child: subprocess.Popen[bytes], total: int) -> float:
    """Wait until the prune has removed a record (or ended); when that was seen."""
    while child.poll() is None and _count(kind, location) == total:
        time.sleep(0.002)
    return time.monotonic()


def _prune(location: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_DROP}
    return subprocess.Popen(
        [sys.executable, "-m", "itemjournal", "-L", location, "prune", "--older-than", "30d"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )


@pytest.fixture(params=["file", "sqlite"])
def template(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, Path, dict[Identity, str]]:
    """A closed journal to copy: old records of every status and some young succeeded."""
    kind = str(request.param)
    base = tmp_path / "template"
    base.mkdir(mode=0o700)
    location = _location(kind, base)
    with monkeypatch.context() as patched:
        _patch_clock(patched, OLD)
        anyio.run(_fill, location, PLAN, "old-")
    written_long_ago(location, 60 * 86400)  # the old records are old by the kernel's clock too
    anyio.run(_fill, location, {"succeeded": YOUNG}, "young-")
    records, unreadable, problems = survey(location)
    assert not unreadable and not problems
    assert len(records) == sum(PLAN.values()) + YOUNG
    root = Path(location[len("sqlite://") :]).parent if kind == "sqlite" else Path(location)
    return kind, root, records


def test_prune_killed_at_random_points_leaves_a_valid_journal(
    template: tuple[str, Path, dict[Identity, str]], tmp_path: Path
) -> None:
    kind, root, original = template
    prunable = {i for i, status in original.items() if status in PRUNABLE and "old-" in i.item}
    kept = set(original) - prunable

    # How long a prune takes here before its first removal, and how long the removals last.
    timing = tmp_path / "timing"
    _copy(kind, root, timing)
    started = time.monotonic()
    child = _prune(_location(kind, timing))
    first = _first_removal(kind, _location(kind, timing), child, len(original))
    _, stderr = child.communicate(timeout=120)
    removing = time.monotonic() - first
    assert child.returncode == 0, stderr
    assert set(survey(_location(kind, timing))[0]) == kept

    rng = random.Random()
    outcomes: list[int] = []
    for run in range(RUNS):
        target = tmp_path / f"run-{run}"
        _copy(kind, root, target)
        location = _location(kind, target)
        child = _prune(location)
        if run < BEFORE:  # killed while it starts, most likely before any removal
            delay = (first - started) * rng.random()
            time.sleep(delay)
        else:  # one random point in each slice of the removals, and a little past them
            _first_removal(kind, location, child, len(original))
            slot = run - BEFORE
            delay = 1.2 * removing * (slot + rng.random()) / (RUNS - BEFORE)
            time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
        records, unreadable, problems = survey(location)
        context: dict[str, Any] = {"run": run, "delay": round(delay, 3), "kind": kind}
        assert unreadable == [], context
        assert problems == (), context
        missing = set(original) - set(records)
        assert missing <= prunable, context  # nothing else was ever removed
        assert kept <= set(records), context
        assert all(records[i] == original[i] for i in records), context  # nothing changed
        outcomes.append(len(missing))
        # A killed prune can be run again and finishes the job.
        if run == RUNS // 2:
            again = _prune(location)
            _, stderr = again.communicate(timeout=120)
            assert again.returncode == 0, stderr
            assert set(survey(location)[0]) == kept

    # The kills landed before, during and after the removals, not only at one end.
    print(f"\n{kind}: records removed when killed: {outcomes} of {len(prunable)}")
    assert any(0 < n < len(prunable) for n in outcomes), outcomes
