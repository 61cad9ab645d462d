"""On the file and memory stores, a call of the blocking face starts no thread.

Each case runs in a child process of its own, so that its stores' worker pool is empty and
no other test's threads come or go while it counts. The child opens a journal, makes many
calls of every kind from its main thread (``begin``, ``complete``, ``inspect``, the claim
block, ``mark_review``, ``withdraw``, ``records``, ``counts``, ``sweep``, ``verify``,
``prune``), closes it, and reports three witnesses, none of which changes the code it
watches:

* every thread that the ``threading`` module started meanwhile, seen from inside the thread
  (``threading.setprofile``: each new thread calls the hook before its target), so a thread
  started and ended within one call is seen too;
* the threads of ``threading.enumerate()`` alive after the calls and not before;
* the kernel's threads of the process (``/proc/self/task``) alive after and not before,
  whoever started them.

The control cases show that the witnesses see threads when there are some: the async
journal on the file store hands its saves to the stores' worker threads, and a blocking
call made through an event loop and a worker thread (what the blocking face must not do)
starts and ends a thread per call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="counts the kernel's threads in /proc"
)

CYCLES = 60  # begin + complete + inspect each; the other calls every tenth cycle

CHILD = r"""
import asyncio
import json
import os
import sys
import threading
from datetime import timedelta

import anyio

import itemjournal
import itemjournal.sync
from itemjournal.testing import MemoryStore

case, root, cycles = sys.argv[1], sys.argv[2], int(sys.argv[3])
started = []


def hook(frame, event, arg):
    sys.setprofile(None)  # once per thread: only its start matters
    started.append(threading.current_thread().name)


def sync_calls(journal, call):
    # ``call(f, *args)`` makes one blocking call: directly, or (the control) through an
    # event loop and a worker thread.
    for n in range(cycles):
        item = ("test", "threads", "cycle", f"i{n}")
        claim = call(journal.begin, item, {"n": n}, "v1")
        call(journal.complete, claim, f"r{n}")
        call(journal.inspect, item)
        if n % 10 == 0:
            def block(n=n):
                item = ("test", "threads", "block", f"b{n}")
                with journal.claim(item, {"n": n}, "v1") as attempt:
                    attempt.complete(f"b{n}")
            call(block)
            call(journal.begin, ("test", "threads", "review", f"m{n}"), {"n": n}, "v1")
            call(journal.mark_review, ("test", "threads", "review", f"m{n}"), "checked by hand")
            held = call(journal.begin, ("test", "threads", "withdrawn", f"w{n}"), {"n": n}, "v1")
            call(journal.withdraw, held, "not needed")
            call(lambda: list(journal.records()))
            call(journal.counts)
    call(journal.sweep)
    call(journal.verify)
    call(journal.prune, timedelta(days=1), dry_run=True)


def direct(f, *args, **kwargs):
    return f(*args, **kwargs)


def through_a_loop(f, *args, **kwargs):
    return asyncio.run(asyncio.to_thread(f, *args, **kwargs))


async def async_calls(location):
    async with await itemjournal.Journal.open(location) as journal:
        for n in range(cycles):
            item = ("test", "threads", "cycle", f"i{n}")
            claim = await journal.begin(item, {"n": n}, "v1")
            await journal.complete(claim, f"r{n}")
            await journal.inspect(item)
            if n % 10 == 0:
                await journal.counts()
        await journal.sweep()


def run():
    location = os.path.join(root, "journal")
    if case == "sync-memory":
        with itemjournal.sync.Journal(MemoryStore()) as journal:
            sync_calls(journal, direct)
    elif case == "sync-file":
        with itemjournal.sync.Journal.open(location) as journal:
            sync_calls(journal, direct)
    elif case == "through-a-loop-memory":
        with itemjournal.sync.Journal(MemoryStore()) as journal:
            sync_calls(journal, through_a_loop)
    elif case == "async-file":
        anyio.run(async_calls, location)
    else:
        raise SystemExit(f"unknown case {case}")


def tasks():
    return set(os.listdir("/proc/self/task"))


threads_before = {thread.ident for thread in threading.enumerate()}
tasks_before = tasks()
threading.setprofile(hook)
try:
    run()
finally:
    threading.setprofile(None)
json.dump(
    {
        "hook": started,
        "enumerate": [t.name for t in threading.enumerate() if t.ident not in threads_before],
        "tasks": sorted(tasks() - tasks_before),
    },
    sys.stdout,
)
"""


def threads_started(case: str, root: Path) -> dict[str, list[str]]:
    """What the three witnesses saw while the child ran ``case``."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, case, str(root), str(CYCLES)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen: dict[str, list[str]] = json.loads(done.stdout)
    return seen


@pytest.mark.parametrize("store", ["memory", "file"])
def test_the_blocking_face_starts_no_thread(store: str, tmp_path: Path) -> None:
    assert threads_started(f"sync-{store}", tmp_path) == {"hook": [], "enumerate": [], "tasks": []}


def test_the_witnesses_see_the_async_journals_worker_threads(tmp_path: Path) -> None:
    seen = threads_started("async-file", tmp_path)
    assert seen["hook"], seen
    assert seen["enumerate"], seen
    assert seen["tasks"], seen


def test_the_witnesses_see_a_thread_started_and_ended_within_each_call(tmp_path: Path) -> None:
    # asyncio.run shuts its worker threads down before it returns: gone by the end, so only
    # the hook sees them, one or more per call.
    seen = threads_started("through-a-loop-memory", tmp_path)
    assert len(seen["hook"]) >= 3 * CYCLES, seen
