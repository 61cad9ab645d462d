"""A process for the namespace tests, run inside the namespaces ``unshare`` made.

``owner LOCATION TARGET EMFILE``: claims ``item-1``, says ``claimed <pid> <process>``,
completes it when told ``complete`` (saying ``completed`` or ``refused <code>``), then
claims ``item-2``, says ``claimed <pid> <process>`` again and waits to be killed.
With TARGET > 1 (in a fresh pid namespace, whose pids count up from 1) it first forks
until its pid is at least TARGET, a pid the test saw unused outside, so that its pid
names no process there. With EMFILE=1 every descriptor is taken while it claims.

``judge LOCATION BACKEND``: for each line read, one judgement of ``item-N`` (N the line) as
JSON: what ``begin`` answered, ``owner_alive``, the review reason, and how many records
a sweep marked.
"""

from __future__ import annotations

import json
import os
import resource
import sys

import anyio

from itemjournal import Claim, Identity, Journal, JournalError, definition_digest

DEFINITION = definition_digest("ns-owner-v1")


def identity(n: str) -> Identity:
    return Identity("ns", "owner", "test", f"item-{n}")


def become_target(target: int) -> None:
    """Fork until this process has a pid >= target; the first process waits for it."""
    if target <= 1:
        return
    while True:
        pid = os.fork()
        if pid == 0:
            if os.getpid() >= target:
                return  # the owner
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        if pid >= target:
            os._exit(os.waitstatus_to_exitcode(status))


async def claim(journal: Journal, n: str, emfile: bool) -> Claim:
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    if emfile:  # no descriptor left: a /proc read now fails with EMFILE
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/dev/fd")) - 1, limits[1]))
    try:
        claimed = await journal.begin(identity(n), {}, DEFINITION)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    assert isinstance(claimed, Claim)
    view = await journal.inspect(identity(n))
    assert view.owner is not None
    print(f"claimed {os.getpid()} {view.owner.process or '-'}", flush=True)
    return claimed


async def owner(location: str, emfile: bool) -> None:
    async with await Journal.open(location) as journal:
        first = await claim(journal, "1", emfile)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        try:
            await journal.complete(first, "done")
        except JournalError as error:
            print(f"refused {error.code}", flush=True)
        else:
            print("completed", flush=True)
        await claim(journal, "2", False)
        await anyio.to_thread.run_sync(sys.stdin.read)


async def judge(location: str) -> None:
    async with await Journal.open(location) as journal:
        while line := (await anyio.to_thread.run_sync(sys.stdin.readline)).strip():
            try:
                await journal.begin(identity(line), {}, DEFINITION)
            except JournalError as error:
                answer = error.code
            else:
                answer = "granted"
            view = await journal.inspect(identity(line))
            marked = len((await journal.sweep()).marked)
            verdict = {
                "begin": answer,
                "alive": view.owner_alive,
                "reason": view.review_reason,
                "marked": marked,
            }
            print(json.dumps(verdict), flush=True)


def main() -> None:
    if sys.argv[1] == "owner":
        become_target(int(sys.argv[3]))
        anyio.run(owner, sys.argv[2], sys.argv[4] == "1")
    else:
        anyio.run(judge, sys.argv[2], backend=sys.argv[3])


if __name__ == "__main__":
    main()
