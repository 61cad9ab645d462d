"""Running work is ``IN_PROGRESS``, not review: duplicates of an in-flight item, waiting
with ``wait=``, dead owners found at ``begin``, and replayable results."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from _builders import gone_reason_of, started_record

from itemjournal import (
    Claim,
    ConflictError,
    Identity,
    InvalidArgument,
    Journal,
    Reuse,
    definition_digest,
    input_digest,
)
from itemjournal._model.codec import clear_decode_cache
from itemjournal._model.records import Owner
from itemjournal._stores.owners import GONE_REBOOTED, boot_log_path
from itemjournal._stores.seam import Step

pytestmark = pytest.mark.anyio
# The contract holds on both faces of the journal (tests/_faces.py).
FACES = ("async", "sync")

DEFINITION = definition_digest("in-progress-v1")
INPUTS = {"order": "A-1", "cents": 1250}


def ident(item: str) -> Identity:
    return Identity("shop", "http", "orders", item)


async def claimed(journal: Journal, identity: Identity) -> Claim:
    claim = await journal.begin(identity, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    return claim


# ---------------------------------------------------------------------------- one process


async def test_a_duplicate_of_running_work_is_in_progress_not_review(journal: Journal) -> None:
    identity = ident("running")
    await claimed(journal, identity)
    with pytest.raises(ConflictError) as raised:
        await journal.begin(identity, INPUTS, DEFINITION)
    assert raised.value.code == "IN_PROGRESS"
    assert raised.value.view is not None
    assert raised.value.view.status == "started"
    assert raised.value.view.owner_alive is True
    assert (await journal.inspect(identity)).history[-1].event == "begin"  # nothing written


async def test_a_waiter_gets_the_first_callers_receipt_and_result(journal: Journal) -> None:
    identity = ident("waited-for")
    claim = await claimed(journal, identity)
    answers: list[Claim | Reuse] = []

    async def duplicate() -> None:
        answers.append(await journal.begin(identity, INPUTS, DEFINITION, wait=10))

    async with anyio.create_task_group() as tg:
        tg.start_soon(duplicate)
        await anyio.wait_all_tasks_blocked()
        assert answers == []  # still waiting: the first call has not finished
        await journal.complete(claim, "ch_1", result='{"status": 201}')
    assert len(answers) == 1
    reuse = answers[0]
    assert isinstance(reuse, Reuse)
    assert (reuse.receipt, reuse.result) == ("ch_1", '{"status": 201}')


@pytest.mark.async_only
async def test_a_waiter_on_this_journals_claim_is_woken_not_polling(
    journal: Journal, monkeypatch: pytest.MonkeyPatch
) -> None:
    identity = ident("woken")
    claim = await claimed(journal, identity)
    tries = 0
    inner = journal._runner.apply_begin  # each try of a begin goes through it once

    async def counting(*args: Any) -> Any:
        nonlocal tries
        tries += 1
        return await inner(*args)

    monkeypatch.setattr(journal._runner, "apply_begin", counting)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: journal.begin(identity, INPUTS, DEFINITION, wait=30))
        await anyio.sleep(0.3)  # a poller (every 10 ms at first) would have tried ~20 times
        await journal.complete(claim, "ch_woken")
    assert tries == 2  # refused once, then woken by the completion and reused


async def test_a_wait_that_runs_out_is_in_progress(journal: Journal) -> None:
    identity = ident("too-slow")
    await claimed(journal, identity)
    started = anyio.current_time()
    with pytest.raises(ConflictError) as raised:
        await journal.begin(identity, INPUTS, DEFINITION, wait=0.2)
    waited = anyio.current_time() - started
    assert raised.value.code == "IN_PROGRESS"
    assert 0.2 <= waited < 2


async def test_a_waiter_answers_as_usual_when_the_work_needs_review(journal: Journal) -> None:
    identity = ident("went-wrong")
    await claimed(journal, identity)
    codes: list[str] = []

    async def duplicate() -> None:
        with pytest.raises(ConflictError) as raised:
            await journal.begin(identity, INPUTS, DEFINITION, wait=10)
        codes.append(raised.value.code)

    async with anyio.create_task_group() as tg:
        tg.start_soon(duplicate)
        await anyio.wait_all_tasks_blocked()
        await journal.mark_review(identity, "provider timed out")
    assert codes == ["REVIEW_REQUIRED"]


@pytest.mark.parametrize("wait", [-1, float("nan"), float("inf"), True, "1"])
async def test_a_bad_wait_is_refused(journal: Journal, wait: Any) -> None:
    with pytest.raises(InvalidArgument) as raised:
        await journal.begin(ident("bad-wait"), INPUTS, DEFINITION, wait=wait)
    assert raised.value.code == "INVALID_ARGUMENT"
    with pytest.raises(InvalidArgument):
        journal.claim(ident("bad-wait"), INPUTS, DEFINITION, wait=wait)


async def test_fifty_waiters_one_effect(journal: Journal) -> None:
    identity = ident("fifty")
    effects = 0
    receipts: list[tuple[bool, str | None, str | None]] = []

    async def handler() -> None:
        nonlocal effects
        async with journal.claim(identity, INPUTS, DEFINITION, wait=30) as attempt:
            if not attempt.reused:
                effects += 1
                await anyio.sleep(0.05)  # the effect takes a while: the others wait
                await attempt.complete("ch_fifty", result="created")
            receipts.append((attempt.reused, attempt.receipt, attempt.result))

    async with anyio.create_task_group() as tg:
        for _ in range(50):
            tg.start_soon(handler)
    assert effects == 1
    assert sorted(receipts).count((True, "ch_fifty", "created")) == 49
    assert (False, "ch_fifty", "created") in receipts
    assert journal._busy == {}
    assert journal._live == {}


@pytest.mark.async_only
async def test_waiters_cancelled_at_random_moments_leave_nothing_behind(
    journal: Journal,
) -> None:
    chance = random.Random(7)
    identity = ident("cancelled-waiters")
    claim = await claimed(journal, identity)
    before = await journal.inspect(identity)
    wrong: list[str] = []

    async def waiter(delay: float) -> None:
        with anyio.move_on_after(delay) as scope:
            await journal.begin(identity, INPUTS, DEFINITION, wait=30)
            wrong.append("a waiter got an answer while the work was running")
        if not scope.cancelled_caught:
            wrong.append("a waiter ended without being cancelled")

    for _ in range(5):
        async with anyio.create_task_group() as tg:
            for _ in range(20):
                tg.start_soon(waiter, chance.uniform(0, 0.03))
    assert wrong == []
    assert await journal.inspect(identity) == before  # no waiter wrote anything
    assert journal._busy == {}
    view = await journal.complete(claim, "ch_after")
    assert view.status == "succeeded"
    assert journal._live == {}


# ---------------------------------------------------------------------------- results


async def test_results_are_stored_replayed_and_read_back_cold(
    location: str, journal: Journal
) -> None:
    identity = ident("replay")
    claim = await claimed(journal, identity)
    body = json.dumps({"id": "ord_1", "note": "caf\u00e9 \u2713"})
    view = await journal.complete(claim, "ch_replay", result=body)
    assert view.result == body
    clear_decode_cache()
    reuse = await journal.begin(identity, INPUTS, DEFINITION)
    assert isinstance(reuse, Reuse)
    assert reuse.result == body
    assert (await journal.inspect(identity)).result == body


async def test_a_result_at_the_limit_is_kept_and_one_byte_more_is_refused(
    journal: Journal,
) -> None:
    fits = await claimed(journal, ident("fits"))
    await journal.complete(fits, "r", result="x" * (64 * 1024))
    clear_decode_cache()
    assert (await journal.inspect(ident("fits"))).result == "x" * (64 * 1024)
    over = await claimed(journal, ident("over"))
    for bad in ("x" * (64 * 1024 + 1), "\u00e9" * (32 * 1024 + 1), b"bytes", 42, "\ud800"):
        with pytest.raises(InvalidArgument) as raised:
            await journal.complete(over, "r", result=bad)  # type: ignore[arg-type]
        assert raised.value.code == "INVALID_ARGUMENT"
    assert (await journal.inspect(ident("over"))).status == "started"  # nothing written


async def test_a_record_without_a_result_is_written_as_before(journal: Journal) -> None:
    """Records that store no result keep document version 1, so a process of an earlier
    release can still read them during a rolling upgrade."""
    from itemjournal._model.codec import encode_record

    claim = await claimed(journal, ident("no-result"))
    await journal.complete(claim, "r")
    seen: list[bytes] = []

    def grab(record: Any) -> None:
        seen.append(encode_record(record))

    await journal.store.peek(ident("no-result"), grab)
    assert json.loads(seen[0])["version"] == 1
    assert "result" not in json.loads(seen[0])


async def test_an_over_long_receipt_in_a_block_says_so_in_the_review_reason(
    journal: Journal,
) -> None:
    identity = ident("long-receipt")
    with pytest.raises(InvalidArgument):
        async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
            await attempt.complete("r" * 201, result="the response body belongs here")
    view = await journal.inspect(identity)
    assert view.status == "needs_review"
    assert view.review_reason == (
        "block raised InvalidArgument: INVALID_RECEIPT: "
        "a receipt has at most 200 characters, got 201"
    )


# ---------------------------------------------------------------------------- other processes

_OWNER = textwrap.dedent(
    """
    import sys
    import anyio
    from itemjournal import Journal, definition_digest

    async def main():
        journal = await Journal.open(sys.argv[1])
        claim = await journal.begin(
            ("shop", "http", "orders", sys.argv[2]), {"order": "A-1", "cents": 1250},
            definition_digest("in-progress-v1"),
        )
        print("claimed", flush=True)
        if sys.stdin.readline().strip() == "complete":
            await journal.complete(claim, "ch_child", result="from the child")
            print("completed", flush=True)

    anyio.run(main)
    """
)


@pytest.fixture
def owner(location: str) -> Iterator[Any]:
    children: list[subprocess.Popen[str]] = []

    def start(item: str) -> subprocess.Popen[str]:
        child = subprocess.Popen(
            [sys.executable, "-c", _OWNER, location, item],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        children.append(child)
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "claimed"
        return child

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait(10)
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()


async def test_another_process_running_the_item_is_in_progress_then_reused(
    journal: Journal, owner: Any
) -> None:
    identity = ident("child-runs")
    child = await anyio.to_thread.run_sync(owner, identity.item)
    with pytest.raises(ConflictError) as raised:
        await journal.begin(identity, INPUTS, DEFINITION)
    assert raised.value.code == "IN_PROGRESS"
    answers: list[Claim | Reuse] = []

    async def duplicate() -> None:
        answers.append(await journal.begin(identity, INPUTS, DEFINITION, wait=30))

    async with anyio.create_task_group() as tg:
        tg.start_soon(duplicate)
        await anyio.sleep(0.1)
        assert answers == []
        child.stdin.write("complete\n")
        child.stdin.flush()
    reuse = answers[0]
    assert isinstance(reuse, Reuse)
    assert (reuse.receipt, reuse.result) == ("ch_child", "from the child")


async def test_a_waiter_whose_owner_is_killed_gets_review_required(
    journal: Journal, owner: Any
) -> None:
    identity = ident("child-killed")
    child = await anyio.to_thread.run_sync(owner, identity.item)
    codes: list[ConflictError] = []

    async def duplicate() -> None:
        with pytest.raises(ConflictError) as raised:
            await journal.begin(identity, INPUTS, DEFINITION, wait=30)
        codes.append(raised.value)

    async with anyio.create_task_group() as tg:
        tg.start_soon(duplicate)
        await anyio.sleep(0.1)
        os.kill(child.pid, signal.SIGKILL)
        await anyio.to_thread.run_sync(child.wait)
    assert [error.code for error in codes] == ["REVIEW_REQUIRED"]
    view = await journal.inspect(identity)
    assert view.status == "needs_review"
    assert view.review_reason == gone_reason_of(journal)
    # Marked by begin itself: the history never claims that a sweep ran.
    assert (view.history[-1].event, view.history[-1].note) == ("begin", gone_reason_of(journal))
    assert codes[0].view == view


async def test_a_dead_owner_is_found_at_begin_and_marked_once(journal: Journal, owner: Any) -> None:
    identity = ident("child-died")
    child = await anyio.to_thread.run_sync(owner, identity.item)
    child.stdin.write("exit\n")
    child.stdin.flush()
    await anyio.to_thread.run_sync(child.wait)
    # The process has ended; on PostgreSQL its session (whose lock says the owner lives)
    # ends when the server has seen the connection go, a moment later: until then the
    # owner cannot be told from a live one, and begin rightly answers IN_PROGRESS.
    with anyio.fail_after(15):
        while (await journal.inspect(identity)).owner_alive is not False:  # noqa: ASYNC110 - the store decides
            await anyio.sleep(0.02)
    with pytest.raises(ConflictError) as raised:
        await journal.begin(identity, INPUTS, DEFINITION)
    assert raised.value.code == "REVIEW_REQUIRED"
    assert raised.value.view is not None
    assert raised.value.view.review_reason == gone_reason_of(journal)
    marked = await journal.inspect(identity)
    assert [(event.event, event.status) for event in marked.history] == [
        ("begin", "started"),
        ("begin", "needs_review"),
    ]
    # Asked again: still needs review, and nothing more is written.
    with pytest.raises(ConflictError) as again:
        await journal.begin(identity, INPUTS, DEFINITION)
    assert again.value.code == "REVIEW_REQUIRED"
    assert await journal.inspect(identity) == marked
    assert (await journal.sweep()).marked == ()


# ---------------------------------------------------------------------- reboots


def _earlier_boot_of_this_machine() -> str:
    """A boot id as this machine's log would hold it from an earlier boot."""
    earlier = str(uuid.uuid4())
    log = boot_log_path()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as stream:
        stream.write(f"{earlier}\n")
    return earlier


async def _plant(journal: Journal, identity: Identity, owner: Owner) -> None:
    """A started record written as its owner, in another boot, wrote it.

    The stores of one host only: the PostgreSQL store judges its owners by their
    database sessions and writes no started record without one of its own."""
    if type(journal.store).__name__ == "PostgresStore":
        pytest.skip("owners on PostgreSQL are sessions; reboots are judged on one host")
    record = started_record(identity, owner)
    record = dataclasses.replace(
        record, input_hash=input_digest(INPUTS), definition_hash=DEFINITION
    )
    await journal.store.apply(identity, lambda current: Step(record, None))


async def test_a_claim_from_an_earlier_boot_of_this_machine_needs_review(journal: Journal) -> None:
    """Its process cannot have survived the reboot: begin marks it, with the reason."""
    earlier = _earlier_boot_of_this_machine()
    process = f"{earlier}:4026531836:4026531834:4242"
    await _plant(journal, ident("rebooted"), Owner("this-host", 4242, "", process))
    with pytest.raises(ConflictError) as raised:
        await journal.begin(ident("rebooted"), INPUTS, DEFINITION)
    assert raised.value.code == "REVIEW_REQUIRED"
    view = await journal.inspect(ident("rebooted"))
    assert view.status == "needs_review"
    assert view.review_reason == GONE_REBOOTED
    assert (view.history[-1].event, view.history[-1].note) == ("begin", GONE_REBOOTED)
    # Known only by its boot (it could not name its process): the same proof holds.
    await _plant(journal, ident("rebooted-unnamed"), Owner("this-host", 7, "", earlier))
    report = await journal.sweep()
    assert [(v.identity, v.review_reason) for v in report.marked] == [
        (ident("rebooted-unnamed"), GONE_REBOOTED)
    ]
    assert report.marked[0].history[-1].event == "sweep"


async def test_a_claim_from_a_boot_this_machine_cannot_vouch_for_stays_in_progress(
    journal: Journal,
) -> None:
    """Another machine's boot (a shared hostname proves nothing): its owner may live."""
    stranger = str(uuid.uuid4())
    host = socket.gethostname()
    process = f"{stranger}:4026531836:4026531834:4242"
    await _plant(journal, ident("elsewhere"), Owner(host, 4242, "", process))
    await _plant(journal, ident("elsewhere-unnamed"), Owner(host, 4242, "", stranger))
    for item in ("elsewhere", "elsewhere-unnamed"):
        with pytest.raises(ConflictError) as raised:
            await journal.begin(ident(item), INPUTS, DEFINITION)
        assert raised.value.code == "IN_PROGRESS"
        assert (await journal.inspect(ident(item))).owner_alive is None
    assert (await journal.sweep()).marked == ()
