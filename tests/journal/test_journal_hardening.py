"""The journal's own answers stay true: prompt cancels, true notes, records that read back,
a claim block settled only by its own claim, one input-digest kind per location, fair
turns on one identity, sweeps that survive bad entries.

Every test here runs on both stores (file and SQLite) and both backends unless it says
otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _pg
import anyio
import pytest
from _builders import gone_reason_of

import itemjournal._journal.turns as journal_module
from itemjournal import (
    Claim,
    ConflictError,
    Identity,
    InvalidArgument,
    Journal,
    RecordInvalid,
    Reuse,
    StorageFailed,
    SweepReport,
    UnresolvedClaim,
    definition_digest,
)
from itemjournal._model.codec import clear_decode_cache, decode_record, encode_record
from itemjournal._model.identity import identity_digest
from itemjournal._stores.files.locks import try_lock_record

pytestmark = pytest.mark.anyio
# The contract holds on both faces of the journal (tests/_faces.py).
FACES = ("async", "sync")

DEFINITION = definition_digest("hardening-v1")
INPUTS = {"n": "1"}
# Seconds from a cancel to the call's end, when nothing was written. The PostgreSQL store
# interrupts a wait with a cancel request, a connection of its own to the server.
CANCEL_BUDGET = {"file": 0.1, "sqlite": 0.1, "memory": 0.1, "postgres": 0.5}


def ident(item: str) -> Identity:
    return Identity("hard", "journal", "edges", item)


# ---------------------------------------------------------------------------- helpers


def db_path(location: str) -> str:
    return location[len("sqlite://") :]


class HeldLock:
    """Another party holding the lock ``begin`` needs: the record's byte of the fan-out's
    ``.lock`` (an open-file-description lock, which conflicts within one process too), or
    SQLite's write lock through a second connection."""

    def __init__(self, location: str, identity: Identity) -> None:
        self.location = location
        self.identity = identity
        self.fd: int | None = None
        self.connection: sqlite3.Connection | None = None
        self.postgres: Any = None

    def take(self) -> None:
        if _pg.is_postgres(self.location):
            self.postgres = _pg.hold_row(self.location, identity_digest(self.identity))
            return
        if self.location.startswith("sqlite://"):
            self.connection = sqlite3.connect(
                db_path(self.location), isolation_level=None, check_same_thread=False
            )
            self.connection.execute("BEGIN IMMEDIATE")
            return
        digest = identity_digest(self.identity)
        fanout = Path(self.location) / digest[:2]
        fanout.mkdir(mode=0o700, exist_ok=True)
        self.fd = os.open(fanout / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        assert try_lock_record(self.fd, digest)

    def give_back(self) -> None:
        if self.postgres is not None:
            self.postgres.close()  # rolls back: the placeholder row was never there
            self.postgres = None
        if self.connection is not None:
            self.connection.execute("ROLLBACK")
            self.connection.close()
            self.connection = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@pytest.fixture
def held(location: str) -> Iterator[Any]:
    locks: list[HeldLock] = []

    def hold(identity: Identity) -> HeldLock:
        lock = HeldLock(location, identity)
        lock.take()
        locks.append(lock)
        return lock

    yield hold
    for lock in locks:
        lock.give_back()


def read_in_new_process(location: str, identity: Identity) -> dict[str, Any]:
    """What a fresh process (a cold, strict reader) sees of one record."""
    script = textwrap.dedent(
        """
        import json, sys
        import anyio
        from itemjournal import Journal, JournalError

        async def main():
            journal = await Journal.open(sys.argv[1])
            try:
                view = await journal.inspect(json.loads(sys.argv[2]))
                print(json.dumps({"status": view.status, "reason": view.review_reason}))
            except JournalError as error:
                print(json.dumps({"error": error.code, "message": str(error)}))
            finally:
                await journal.aclose()

        anyio.run(main)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, location, json.dumps(list(identity))],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


# ---------------------------------------------------------------------------- defect 3


@pytest.mark.async_only
async def test_a_begin_cancelled_while_waiting_for_a_lock_ends_at_once(
    make_journal: Any, held: Any, store_kind: str
) -> None:
    journal = await make_journal(lock_timeout=5.0)
    identity = ident("waits-for-a-lock")
    await anyio.to_thread.run_sync(held, identity)
    notes: list[str] = []
    deadline = anyio.current_time() + 0.05
    with anyio.CancelScope(deadline=deadline) as scope:
        try:
            await journal.begin(identity, INPUTS, DEFINITION)
        except anyio.get_cancelled_exc_class() as cancelled:
            notes.extend(getattr(cancelled, "__notes__", ()))
            raise
    late = anyio.current_time() - deadline
    assert scope.cancelled_caught
    assert late < CANCEL_BUDGET[store_kind], f"the cancel took {late * 1000:.0f} ms"
    assert notes == []  # nothing was written, so nothing is said about a claim
    print(f"\na begin cancelled while another party held its lock ended {late * 1000:.1f} ms late")


# ---------------------------------------------------------------------------- defect 5


async def test_a_long_exception_message_is_cut_to_fit_and_reads_back(
    location: str, journal: Journal
) -> None:
    identity = ident("long-message")
    message = "timed out after the request was sent " + "x" * 2000
    with pytest.raises(RuntimeError):
        async with journal.claim(identity, INPUTS, DEFINITION):
            raise RuntimeError(message)
    seen = await anyio.to_thread.run_sync(read_in_new_process, location, identity)
    assert seen["status"] == "needs_review", seen
    assert seen["reason"].startswith("block raised RuntimeError: timed out after the request")
    assert len(seen["reason"]) <= 500


async def test_an_exception_type_name_too_long_for_a_note_still_reads_back(
    location: str, journal: Journal
) -> None:
    identity = ident("long-type-name")
    long_type = type("E" * 600, (Exception,), {})
    with pytest.raises(long_type):
        async with journal.claim(identity, INPUTS, DEFINITION):
            raise long_type("sent")
    seen = await anyio.to_thread.run_sync(read_in_new_process, location, identity)
    assert seen["status"] == "needs_review", seen
    assert len(seen["reason"]) <= 500


async def test_a_lone_surrogate_in_the_message_still_reads_back(
    location: str, journal: Journal
) -> None:
    identity = ident("surrogate")
    with pytest.raises(ValueError, match="bad"):
        async with journal.claim(identity, INPUTS, DEFINITION):
            raise ValueError("bad \udcff byte")
    seen = await anyio.to_thread.run_sync(read_in_new_process, location, identity)
    assert seen["status"] == "needs_review", seen
    assert seen["reason"].startswith("block raised ValueError: bad ")


async def test_the_reason_names_the_message_not_only_the_type(journal: Journal) -> None:
    identity = ident("message-matters")
    with pytest.raises(TimeoutError):
        async with journal.claim(identity, INPUTS, DEFINITION):
            raise TimeoutError("no answer from the provider after sending")
    clear_decode_cache()
    view = await journal.inspect(identity)
    assert view.review_reason == (
        "block raised TimeoutError: no answer from the provider after sending"
    )


def test_the_encoder_refuses_what_the_strict_reader_would_reject() -> None:
    from _builders import started_record

    record = started_record(ident("too-long-reason"))
    bad = dataclasses.replace(record, review_reason="r" * 501)
    with pytest.raises(RecordInvalid, match="strict reader"):
        encode_record(bad)
    good = encode_record(record)
    clear_decode_cache()
    assert decode_record(good, record.identity) == record


# ---------------------------------------------------------------------------- defect 6


async def test_marked_then_resolved_by_someone_else_is_not_settled_by_the_block(
    journal: Journal,
) -> None:
    identity = ident("resolved-by-operator")
    with pytest.raises(UnresolvedClaim) as raised:
        async with journal.claim(identity, INPUTS, DEFINITION):
            await journal.mark_review(identity, "operator looks at it")
            await journal.resolve(identity, receipt="operator-found-it", note="seen upstream")
    assert raised.value.view is not None
    assert raised.value.view.status == "succeeded"  # the operator's decision stands
    assert (await journal.inspect(identity)).receipt == "operator-found-it"


async def test_completed_through_the_journal_with_this_claim_is_settled(
    journal: Journal,
) -> None:
    identity = ident("completed-directly")
    async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
        await journal.complete(attempt.claim, "r-1")
    assert (await journal.inspect(identity)).status == "succeeded"


# ---------------------------------------------------------------------------- defect 7


class BytesPath(os.PathLike[bytes]):
    def __init__(self, path: bytes) -> None:
        self.path = path

    def __fspath__(self) -> bytes:
        return self.path


@pytest.mark.parametrize("location", [BytesPath(b"/tmp/journal"), b"/tmp/journal"])
async def test_a_bytes_path_is_refused_clearly(location: Any) -> None:
    with pytest.raises(InvalidArgument) as raised:
        await Journal.open(location)
    assert raised.value.code == "ABSOLUTE_ROOT_REQUIRED"


# ---------------------------------------------------------------------------- defect 10


async def test_lock_timeout_is_a_parameter_of_open(make_journal: Any, held: Any) -> None:
    journal = await make_journal(lock_timeout=0.2)
    identity = ident("times-out")
    await anyio.to_thread.run_sync(held, identity)
    started = anyio.current_time()
    with pytest.raises(StorageFailed) as raised:
        await journal.begin(identity, INPUTS, DEFINITION)
    waited = anyio.current_time() - started
    assert raised.value.errno is not None
    assert 0.2 <= waited < 2.0


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "5"])
async def test_a_bad_lock_timeout_is_refused(location: str, bad: Any) -> None:
    with pytest.raises(InvalidArgument) as raised:
        await Journal.open(location, lock_timeout=bad)
    assert raised.value.code == "INVALID_ARGUMENT"


# ---------------------------------------------------------------------------- defect 11


async def test_many_calls_on_one_identity_take_turns_without_a_stampede(
    journal: Journal, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each waiter is woken once, in arrival order: N calls cost O(N) wake-ups."""
    identity = ident("storm")
    claim = await journal.begin(identity, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    await journal.complete(claim, "r-storm")
    waits = 0
    real_event = anyio.Event

    class CountingEvent:
        def __init__(self) -> None:
            self._event = real_event()

        async def wait(self) -> None:
            nonlocal waits
            waits += 1
            await self._event.wait()

        def set(self) -> None:
            self._event.set()

        def is_set(self) -> bool:
            return self._event.is_set()

    counting = types.SimpleNamespace(**vars(anyio))
    counting.Event = CountingEvent
    monkeypatch.setattr(journal_module, "anyio", counting)
    order: list[int] = []
    calls = 300

    async def reuse(n: int) -> None:
        outcome = await journal.begin(identity, INPUTS, DEFINITION)
        assert isinstance(outcome, Reuse)
        order.append(n)

    async with anyio.create_task_group() as tg:
        for n in range(calls):
            tg.start_soon(reuse, n)
    print(f"\n{calls} calls on one identity: {waits} waits for a turn")
    assert len(order) == calls
    assert waits <= calls


@pytest.mark.async_only
async def test_a_waiter_cancelled_in_line_leaves_the_line(journal: Journal) -> None:
    identity = ident("line")
    claim = await journal.begin(identity, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    await journal.complete(claim, "r-line")
    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(journal.begin, identity, INPUTS, DEFINITION)
        tg.cancel_scope.cancel()
    assert journal._busy == {}
    assert isinstance(await journal.begin(identity, INPUTS, DEFINITION), Reuse)


# ---------------------------------------------------------------------------- defect 13


def leave_dead_claims(location: str, count: int) -> list[Identity]:
    """A child process claims ``count`` items and dies without settling any of them."""
    script = textwrap.dedent(
        """
        import os, sys
        import anyio
        from itemjournal import Journal, definition_digest

        async def main():
            journal = await Journal.open(sys.argv[1])
            for n in range(int(sys.argv[2])):
                await journal.begin(
                    ("hard", "journal", "dead", f"d{n}"), {"n": "1"},
                    definition_digest("hardening-v1"),
                )
            os._exit(0)

        anyio.run(main)
        """
    )
    subprocess.run([sys.executable, "-c", script, location, str(count)], check=True, timeout=60)
    return [Identity("hard", "journal", "dead", f"d{n}") for n in range(count)]


def spoil_one(location: str, identity: Identity) -> None:
    """Make one record unworkable: its fan-out's lock file a directory, or its row corrupt."""
    digest = identity_digest(identity)
    if _pg.is_postgres(location):
        _pg.put_document(location, digest, b"{not json")
        return
    if location.startswith("sqlite://"):
        with sqlite3.connect(db_path(location)) as connection:
            connection.execute(
                "UPDATE itemjournal_records SET document = ? WHERE digest = ?",
                (b"{not json", digest),
            )
        connection.close()
        return
    lock = Path(location) / digest[:2] / ".lock"
    lock.unlink()
    lock.mkdir(mode=0o700)


async def test_one_bad_entry_does_not_stop_a_sweep(location: str, journal: Journal) -> None:
    dead = await anyio.to_thread.run_sync(leave_dead_claims, location, 40)
    spoiled = dead[7]
    await anyio.to_thread.run_sync(spoil_one, location, spoiled)
    # Records sharing the spoiled record's fan-out directory are unworkable too there.
    fanout = identity_digest(spoiled)[:2]
    if location.startswith("sqlite://") or _pg.is_postgres(location):
        unworkable = {spoiled}
    else:
        unworkable = {i for i in dead if identity_digest(i)[:2] == fanout}
    report = await journal.sweep()
    assert isinstance(report, SweepReport)
    assert {view.identity for view in report.marked} == set(dead) - unworkable
    assert all(view.review_reason == gone_reason_of(journal) for view in report.marked)
    assert 1 <= len(report.problems) <= len(unworkable)
    for problem in report.problems:
        assert isinstance(problem, (RecordInvalid, StorageFailed))
    print(
        f"\nsweep: {len(report.marked)} of 40 dead claims marked, {len(report.problems)} problems"
    )
    again = await journal.sweep()
    assert again.marked == ()


# ---------------------------------------------------------------------------- defect 18


async def test_a_keyed_location_refuses_an_open_without_the_key(
    location: str, make_journal: Any
) -> None:
    keyed = await make_journal(input_key=b"k" * 32)
    claim = await keyed.begin(ident("keyed"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    for other in (None, b"o" * 32):
        with pytest.raises(ConflictError) as raised:
            await Journal.open(location, input_key=other)
        assert raised.value.code == "INPUT_KEY_MISMATCH"
    same = await make_journal(input_key=b"k" * 32)
    assert (await same.inspect(ident("keyed"))).status == "started"


async def test_an_unkeyed_location_refuses_an_open_with_a_key(
    location: str, make_journal: Any
) -> None:
    await make_journal()
    with pytest.raises(ConflictError) as raised:
        await Journal.open(location, input_key=b"k" * 32)
    assert raised.value.code == "INPUT_KEY_MISMATCH"
