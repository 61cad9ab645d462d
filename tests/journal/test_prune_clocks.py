"""``prune`` under wrong clocks (libfaketime): a record finished a moment ago in real
time is never removed because the writer's clock ran behind or the pruner's ahead.

Each writer and pruner with a wrong clock is a process of its own under ``faketime``
(Debian's libfaketime), on every store with a location; the monotonic clocks stay real
(``FAKETIME_DONT_FAKE_MONOTONIC``) so that waits and timeouts keep working.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from datetime import timedelta

import anyio
import pytest

from itemjournal import Identity, Journal, Reuse, definition_digest

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

FAKETIME = shutil.which("faketime")
if FAKETIME is None and os.environ.get("CI") == "true":
    pytest.fail("the clock tests need faketime (Debian's faketime) under CI", pytrace=False)
needs_faketime = pytest.mark.skipif(FAKETIME is None, reason="needs faketime (libfaketime)")

DEFINITION = definition_digest("clocks-v1")
FRESH = Identity("clocks", "prune", "test", "fresh")
WRITE = textwrap.dedent(
    f"""
    import sys, anyio
    from itemjournal import Journal, Claim
    async def main():
        async with await Journal.open(sys.argv[1]) as journal:
            claim = await journal.begin({tuple(FRESH)!r}, {{}}, {DEFINITION!r})
            assert isinstance(claim, Claim)
            await journal.complete(claim, "ch_fresh")
            print((await journal.inspect({tuple(FRESH)!r})).updated_at)
    anyio.run(main)
    """
)


def skewed(offset: str, *command: str) -> subprocess.CompletedProcess[str]:
    """``command`` run with its clock ``offset`` off (``-60d``, ``+60d``)."""
    assert FAKETIME is not None
    environment = {**os.environ, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    return subprocess.run(
        [FAKETIME, "-f", offset, *command],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
        check=False,
    )


async def write_with_clock(offset: str, location: str) -> str:
    done = await anyio.to_thread.run_sync(
        lambda: skewed(offset, sys.executable, "-c", WRITE, location)
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


async def prune_60_days_ahead(location: str) -> subprocess.CompletedProcess[str]:
    """``itemjournal prune --older-than 30d --json`` run with a clock 60 days ahead."""
    pruned = await anyio.to_thread.run_sync(
        lambda: skewed(
            "+60d",
            sys.executable,
            "-m",
            "itemjournal",
            "-L",
            location,
            "prune",
            "--older-than",
            "30d",
            "--json",
        )
    )
    assert pruned.returncode == 0, pruned.stderr
    return pruned


async def assert_reused(location: str) -> None:
    async with await Journal.open(location) as journal:
        again = await journal.begin(FRESH, {}, DEFINITION)
        assert isinstance(again, Reuse)
        assert again.receipt == "ch_fresh"


@needs_faketime
async def test_a_writer_whose_clock_ran_60_days_behind_is_not_pruned(location: str) -> None:
    written = await write_with_clock("-60d", location)
    assert written < "2026-11"  # its record says it was finished 60 days ago
    async with await Journal.open(location) as journal:
        report = await journal.prune(timedelta(days=30))
    assert report.removed == ()
    assert [view.identity for view in report.kept] == [FRESH]  # and says why it stays
    await assert_reused(location)


@needs_faketime
async def test_a_pruner_whose_clock_runs_60_days_ahead_prunes_nothing_fresh(
    location: str,
) -> None:
    await write_with_clock("+0", location)
    pruned = await prune_60_days_ahead(location)
    report = json.loads(pruned.stdout)
    assert report["removed"] == []
    assert [view["identity"] for view in report["kept"]] == [list(FRESH)]
    await assert_reused(location)


@needs_faketime
async def test_a_record_from_a_clock_ahead_of_the_pruner_is_kept_and_reported(
    location: str,
) -> None:
    await write_with_clock("+60d", location)
    async with await Journal.open(location) as journal:
        report = await journal.prune(timedelta(days=30), dry_run=True)
        assert report.removed == ()
        assert [view.identity for view in report.kept] == [FRESH]
        report = await journal.prune(timedelta(seconds=1))
        assert report.removed == ()
        assert [view.identity for view in report.kept] == [FRESH]
    await assert_reused(location)


@needs_faketime
async def test_what_every_clock_calls_old_is_pruned(location: str) -> None:
    """The rule keeps only what some clock calls young: a record old by all is removed."""
    await write_with_clock("+0", location)
    pruned = await prune_60_days_ahead(location)
    assert json.loads(pruned.stdout)["removed"] == []
    async with await Journal.open(location) as journal:
        report = await journal.prune(timedelta(microseconds=1))
        assert [view.identity for view in report.removed] == [FRESH]
