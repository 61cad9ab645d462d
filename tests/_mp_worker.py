"""Worker processes for the multi-process tests (run as a script, never imported by pytest).

Modes:
  race ROOT BACKEND SEED N          begin N shared identities in a shuffled order
  transition ROOT BACKEND SEED MODE FILE
                                    MODE complete|review: after a "go" line on stdin,
                                    complete the claims / mark the identities in FILE
  zygote ROOT BACKEND               on "fork SEED" fork a child that churns through
                                    claims with a slow fsync, logging each acknowledgement;
                                    on "wait PID" reap it and print its status
  hold ROOT BACKEND ITEM            claim ITEM, print "held", then wait on stdin
  contend ROOT BACKEND              for each line "N" on stdin: connect to the SQLite
                                    database with plain sqlite3 and close again (as any
                                    other program might), then open the journal, try to
                                    begin ("mp", "locks", "held", "iN") and print the
                                    outcome as a JSON line
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import sys
import time
from typing import Any

import anyio

from itemjournal import Claim, ConflictError, FileStore, FileSystem, Journal, definition_digest

DEFINITION = definition_digest("mp-v1")
INPUTS = {"n": "1"}


def item(n: int) -> tuple[str, str, str, str]:
    return ("mp", "race", "job", f"item-{n}")


async def race(root: str, seed: int, count: int) -> None:
    journal = await Journal.open(root)
    order = list(range(count))
    random.Random(seed).shuffle(order)
    claimed: list[int] = []
    refused = 0
    limiter = anyio.Semaphore(8)

    async def one(n: int) -> None:
        nonlocal refused
        async with limiter:
            try:
                outcome = await journal.begin(item(n), INPUTS, DEFINITION)
            except ConflictError as error:
                # The winner is running (IN_PROGRESS) or has already exited, leaving its
                # claim to a dead owner (REVIEW_REQUIRED, the record marked for review).
                assert error.code in ("IN_PROGRESS", "REVIEW_REQUIRED"), error
                refused += 1
                return
            assert isinstance(outcome, Claim)
            claimed.append(n)

    async with anyio.create_task_group() as tg:
        for n in order:
            tg.start_soon(one, n)
    print(json.dumps({"claimed": claimed, "refused": refused}), flush=True)


async def transition(root: str, seed: int, mode: str, path: str) -> None:
    journal = await Journal.open(root)
    with open(path) as stream:
        claims = [Claim(**{**c, "identity": tuple(c["identity"])}) for c in json.load(stream)]
    # The two contenders walk the claims from opposite ends, so they meet (and contest)
    # whatever their relative speed.
    claims.sort(key=lambda claim: claim.identity[3], reverse=mode == "review")
    print("ready", flush=True)
    await anyio.to_thread.run_sync(sys.stdin.readline)
    results: dict[str, str] = {}
    limiter = anyio.Semaphore(1)  # one at a time: a batch must not outrun the rival's start

    async def one(claim: Claim) -> None:
        async with limiter:
            try:
                if mode == "complete":
                    await journal.complete(claim, f"r-{claim.identity[3]}")
                else:
                    await journal.mark_review(claim.identity, "contested")
            except ConflictError as error:
                results[claim.identity[3]] = error.code
            else:
                results[claim.identity[3]] = "ok"

    async with anyio.create_task_group() as tg:
        for claim in claims:
            tg.start_soon(one, claim)
    print(json.dumps(results), flush=True)


class SlowSync(FileSystem):
    """fsync that takes a few milliseconds, so a kill often lands inside a save."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def fsync(self, fd: int) -> None:
        time.sleep(self.rng.uniform(0, 0.003))
        super().fsync(fd)

    def fsync_dir(self, fd: int) -> None:
        time.sleep(self.rng.uniform(0, 0.003))
        super().fsync_dir(fd)


async def churn(root: str, seed: int, log_fd: int) -> None:
    rng = random.Random(seed)
    if root.startswith(("sqlite:", "postgresql:")):
        journal = await Journal.open(root)
    else:
        store = FileStore(root, fs=SlowSync(rng))
        await store.open()
        journal = Journal(store)

    def log(event: str, n: int) -> None:
        os.write(log_fd, f"{event} {seed} {n}\n".encode())

    os.write(log_fd, f"open {seed} -\n".encode())

    for n in range(10_000):
        ident = ("mp", "churn", f"s{seed}", f"n{n}")
        outcome = await journal.begin(ident, INPUTS, DEFINITION)
        assert isinstance(outcome, Claim)
        log("claimed", n)
        roll = rng.random()
        if roll < 0.6:
            await journal.complete(outcome, f"r{n}")
            log("completed", n)
        elif roll < 0.7:
            await journal.mark_review(ident, "churn")
            log("reviewed", n)


def zygote(root: str, backend: str, log_path: str) -> None:
    if backend == "trio":  # import before forking, so a child starts work at once
        import trio  # noqa: F401
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    print("ready", flush=True)
    for line in sys.stdin:
        command, argument = line.split()
        if command == "fork":
            pid = os.fork()
            if pid == 0:  # the child: churn until killed
                try:
                    anyio.run(churn, root, int(argument), log_fd, backend=backend)
                finally:
                    os._exit(0)
            print(pid, flush=True)
        elif command == "wait":
            _, status = os.waitpid(int(argument), 0)
            print(status, flush=True)


async def hold(root: str, number: str) -> None:
    journal = await Journal.open(root)
    outcome = await journal.begin(("mp", "live", "owner", number), INPUTS, DEFINITION)
    assert isinstance(outcome, Claim)
    print("held", flush=True)
    await anyio.to_thread.run_sync(sys.stdin.readline)


async def contend(root: str) -> None:
    database = root[len("sqlite://") :]
    while line := await anyio.to_thread.run_sync(sys.stdin.readline):
        n = int(line)
        outcome: dict[str, str] = {}
        try:
            for _ in range(3):  # a plain connection, opened and closed again
                connection = sqlite3.connect(database)
                connection.execute("SELECT count(*) FROM itemjournal_records").fetchone()
                connection.close()
            journal = await Journal.open(root)
            try:
                result = await journal.begin(("mp", "locks", "held", f"i{n}"), INPUTS, DEFINITION)
                outcome["answer"] = type(result).__name__
            except ConflictError as error:
                outcome["answer"] = error.code
            finally:
                await journal.aclose()
        except Exception as error:
            outcome["answer"] = "error"
            outcome["error"] = f"{type(error).__name__}: {error}"
        print(json.dumps(outcome), flush=True)


def main(argv: list[str]) -> None:
    mode, root, backend, *rest = argv
    runs: dict[str, Any] = {
        "race": lambda: anyio.run(race, root, int(rest[0]), int(rest[1]), backend=backend),
        "transition": lambda: anyio.run(
            transition, root, int(rest[0]), rest[1], rest[2], backend=backend
        ),
        "zygote": lambda: zygote(root, backend, rest[0]),
        "hold": lambda: anyio.run(hold, root, rest[0], backend=backend),
        "contend": lambda: anyio.run(contend, root, backend=backend),
    }
    runs[mode]()


if __name__ == "__main__":
    main(sys.argv[1:])
