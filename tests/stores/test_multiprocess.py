"""Many processes over one journal directory: exclusive claims, no lost transitions,
survival of SIGKILL, and ``sweep`` of dead owners' claims (SPEC §5)."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import anyio
import pytest
from _builders import gone_reason_of

from itemjournal import Claim, ConflictError, FileStore, Journal, StorageFailed, definition_digest
from itemjournal._model.identity import Identity, identity_digest
from itemjournal._stores.files.locks import try_lock_record

pytestmark = pytest.mark.anyio

WORKER = str(Path(__file__).parents[1] / "_mp_worker.py")
DEFINITION = definition_digest("mp-v1")
INPUTS = {"n": "1"}


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, WORKER, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen[str], stdin: str = "") -> str:
    out, _ = process.communicate(stdin, timeout=120)
    assert process.returncode == 0, out
    return out


async def every_record_valid(journal: Journal) -> int:
    count = 0
    async for record in journal.store.scan():
        assert not isinstance(record, Exception), record
        count += 1
    return count


async def test_eight_processes_race_for_500_identities(location: str, anyio_backend: str) -> None:
    journal = await Journal.open(location)
    processes = [spawn("race", location, anyio_backend, str(seed), "500") for seed in range(8)]
    reports = [json.loads(await anyio.to_thread.run_sync(finish, p)) for p in processes]
    claims = Counter(n for report in reports for n in report["claimed"])
    refused = sum(report["refused"] for report in reports)
    print(f"\n8 processes x 500 begins: {sum(claims.values())} claims, {refused} refusals")
    assert sorted(claims) == list(range(500))
    assert set(claims.values()) == {1}
    assert refused == 7 * 500
    assert await every_record_valid(journal) == 500


async def test_contested_transitions_lose_no_update(
    location: str, root: Path, anyio_backend: str
) -> None:
    journal = await Journal.open(location)
    claims = []
    for n in range(500):
        claim = await journal.begin(("mp", "contest", "job", f"c{n}"), INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        claims.append(dataclasses.asdict(claim))
    claims_file = root.parent / "claims.json"
    claims_file.write_text(json.dumps(claims))
    completer = spawn("transition", location, anyio_backend, "1", "complete", str(claims_file))
    reviewer = spawn("transition", location, anyio_backend, "2", "review", str(claims_file))
    for process in (completer, reviewer):
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
    for process in (completer, reviewer):  # start both at once
        assert process.stdin is not None
        process.stdin.write("go\n")
        process.stdin.flush()
    completed = json.loads(await anyio.to_thread.run_sync(finish, completer))
    reviewed = json.loads(await anyio.to_thread.run_sync(finish, reviewer))
    outcomes = Counter()
    for claim in claims:
        name = claim["identity"][3]
        pair = (completed[name], reviewed[name])
        outcomes[pair] += 1
        view = await journal.inspect(claim["identity"])
        if pair == ("ok", "NOT_STARTED"):
            assert view.status == "succeeded"
            assert view.receipt == f"r-{name}"
        else:
            assert pair == ("NOT_STARTED", "ok"), pair
            assert view.status == "needs_review"
            assert view.review_reason == "contested"
        assert next(e.event for e in view.history) == "begin"
        assert len(view.history) == 2
    # Which process wins how many is up to the scheduler (and SQLite's write lock is not
    # fair); what must hold, and is checked above for every record, is that exactly one
    # of the two calls won and the record shows exactly that call's outcome.
    print(f"\n1000 contested transitions: {dict(outcomes)}")
    assert sum(outcomes.values()) == 500


def lock_is_free(path: Path) -> bool:
    """No byte of the lock file is locked by anyone (an OFD lock over the whole file)."""
    fd = os.open(path, os.O_RDWR)
    try:
        whole = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0).ljust(32, b"\0")
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, whole)
        except (BlockingIOError, PermissionError):
            return False
        return True
    finally:
        os.close(fd)


_ACK = re.compile(r"(claimed|completed|reviewed) (\d+) (\d+)\n")


def acknowledged(text: str) -> list[tuple[str, str, str]]:
    """The acknowledgements in the children's log, each a whole line.

    A child writes one line per acknowledged operation. A SIGKILL can land inside that
    write and leave part of the line without its newline; the next child's first line
    ("open N -") then continues it. Such a torn line, or a torn last line, is no
    acknowledgement (the child died before saying it), and anything else must be whole.
    """
    acks: list[tuple[str, str, str]] = []
    for line in text.splitlines(keepends=True):
        _, opened, _ = line.partition("open ")
        if opened or not line.endswith("\n"):
            continue
        match = _ACK.fullmatch(line)
        assert match is not None, f"a log line that is neither whole nor torn: {line!r}"
        acks.append((match[1], match[2], match[3]))
    return acks


def test_torn_acknowledgements_are_not_counted() -> None:
    text = "open 0 -\nclaimed 0 0\ncompleted 0 0\nclaimed 0 1open 1 -\nclaimed 1 0\nclaim"
    assert acknowledged(text) == [
        ("claimed", "0", "0"),
        ("completed", "0", "0"),
        ("claimed", "1", "0"),
    ]
    with pytest.raises(AssertionError, match="neither whole nor torn"):
        acknowledged("claimed 0 0 0\n")


@pytest.mark.slow
async def test_sigkill_at_random_moments(
    location: str, root: Path, store_kind: str, anyio_backend: str
) -> None:
    await (await Journal.open(location)).aclose()
    log = root.parent / "acks.log"
    zygote = spawn("zygote", location, anyio_backend, str(log))
    assert zygote.stdin is not None and zygote.stdout is not None
    assert zygote.stdout.readline().strip() == "ready"
    rng = random.Random(20261130)
    kills = 100
    for seed in range(kills):
        zygote.stdin.write(f"fork {seed}\n")
        zygote.stdin.flush()
        pid = int(zygote.stdout.readline())
        with anyio.fail_after(10):  # the child opened its journal: now kill it mid-work
            while f"open {seed} -\n" not in log.read_text():  # noqa: ASYNC110 - a child writes it
                await anyio.sleep(0.001)
        await anyio.sleep(rng.uniform(0, 0.04))
        os.kill(pid, signal.SIGKILL)
        zygote.stdin.write(f"wait {pid}\n")
        zygote.stdin.flush()
        status = int(zygote.stdout.readline())
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    finish(zygote)

    temps_before = 0
    if store_kind == "file":
        locks = list(root.glob("??/.lock"))
        assert locks and all(lock_is_free(lock) for lock in locks)
        temps_before = len(list(root.glob("??/*.tmp")))
        store = FileStore(str(root), temp_grace=0)
        await store.open()  # every writer is dead: their temp files go
        assert not list(root.glob("??/*.tmp"))
        journal = Journal(store)
    else:
        journal = await Journal.open(location)
    records = await every_record_valid(journal)

    # Every acknowledged operation survived...
    acks = acknowledged(log.read_text())
    last_claim: dict[str, int] = {}
    for event, seed, n in acks:
        view = await journal.inspect(("mp", "churn", f"s{seed}", f"n{n}"))
        if event == "claimed":
            last_claim[seed] = max(last_claim.get(seed, -1), int(n))
            assert view.status in {"started", "succeeded", "needs_review"}
        elif event == "completed":
            assert view.status == "succeeded" and view.receipt == f"r{n}"
        else:
            assert view.status == "needs_review"
    # ...and nothing else appeared: a child works on one item at a time, so at most
    # the one after its last acknowledged claim may exist unacknowledged.
    started = []
    async for record in journal.store.scan():
        assert not isinstance(record, Exception)
        if record.identity.program == "churn":
            seed, n = record.identity.job[1:], int(record.identity.item[1:])
            assert n <= last_claim.get(seed, -1) + 1, record.identity
        if record.status == "started":
            started.append(record.identity)
            # A killed process's database session ends when the server reads the closed
            # socket: allow it a moment (the files and SQLite know at once).
            with anyio.fail_after(10 if store_kind == "postgres" else 0.5):
                while (await journal.inspect(record.identity)).owner_alive is not False:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
    report = await journal.sweep()
    assert report.problems == ()
    swept = report.marked
    assert sorted(view.identity for view in swept) == sorted(started)
    for view in swept:
        assert view.status == "needs_review"
        assert view.review_reason == gone_reason_of(journal)
        assert view.history[-1].event == "sweep"  # a sweep ran, and says so
    assert (await journal.sweep()).marked == ()
    print(
        f"\n{store_kind}: {kills} SIGKILLs: {len(acks)} acknowledgements kept, {records} valid "
        f"records, {temps_before} temp files swept, {len(swept)} dead claims marked for review"
    )


async def test_a_live_owners_claim_is_never_swept(location: str, anyio_backend: str) -> None:
    journal = await Journal.open(location)
    mine = await journal.begin(("mp", "live", "owner", "mine"), INPUTS, DEFINITION)
    assert isinstance(mine, Claim)
    other = spawn("hold", location, anyio_backend, "theirs")
    assert other.stdout is not None
    assert other.stdout.readline().strip() == "held"
    try:
        assert (await journal.sweep()).marked == ()
        theirs = await journal.inspect(("mp", "live", "owner", "theirs"))
        assert theirs.status == "started"
        assert theirs.owner_alive is True
        assert theirs.owner is not None
        assert theirs.owner.pid == other.pid
        assert (await journal.inspect(mine.identity)).status == "started"
    finally:
        finish(other, "\n")
    # Now the owner is gone: the same call takes its claim, and only its claim.
    swept = (await journal.sweep()).marked
    assert [view.identity.item for view in swept] == ["theirs"]
    assert (await journal.inspect(mine.identity)).status == "started"


async def test_owner_elsewhere_is_unknown_not_dead(root: Path) -> None:
    journal = await Journal.open(str(root))
    claim = await journal.begin(("mp", "remote", "owner", "x"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    path = journal.store.path_for(claim.identity)  # type: ignore[attr-defined]
    document = json.loads(path.read_text())
    # Another machine: its own boot id (a hostname alone proves nothing either way).
    boot = document["owner"]["process"].split(":")[0]
    document["owner"]["host"] = "another-host.example"
    document["owner"]["process"] = document["owner"]["process"].replace(boot, str(uuid.uuid4()))
    path.write_text(json.dumps(document))
    assert (await journal.inspect(claim.identity)).owner_alive is None
    assert (await journal.sweep()).marked == ()


def neighbour_of(digest: str) -> Identity:
    """Another identity whose record shares the fan-out directory of ``digest``."""
    for n in range(100_000):
        candidate = Identity("mp", "lock", "neighbour", f"n{n}")
        if identity_digest(candidate)[:2] == digest[:2]:
            return candidate
    raise AssertionError("no neighbour found")  # pragma: no cover


async def test_a_held_lock_times_out_with_a_clear_error(root: Path) -> None:
    store = FileStore(str(root), lock_timeout=0.2)
    await store.open()
    journal = Journal(store)
    ident = ("mp", "lock", "held", "x")
    claim = await journal.begin(ident, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    lock = store.path_for(claim.identity).parent / ".lock"
    fd = os.open(lock, os.O_RDWR)
    assert try_lock_record(fd, claim.key)  # another holder of this record's lock
    neighbour = await journal.begin(neighbour_of(claim.key), INPUTS, DEFINITION)
    assert isinstance(neighbour, Claim)  # a record in the same directory is not held up
    assert not lock_is_free(lock)
    try:
        started = time.monotonic()
        with pytest.raises(StorageFailed) as caught:
            await journal.complete(claim, "r")
        assert 0.2 <= time.monotonic() - started < 5
        assert "stayed held" in str(caught.value)
        with anyio.move_on_after(0.05) as scope:  # waiting for the lock is cancellable
            await journal.complete(claim, "r")
        assert scope.cancelled_caught
    finally:
        os.close(fd)
    assert (await journal.complete(claim, "r")).status == "succeeded"
    with pytest.raises(ConflictError):
        await journal.complete(claim, "r")
