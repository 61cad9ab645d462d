"""The blocking face (``itemjournal.sync``) where it must work: many threads on one
journal, inside a thread that runs an event loop, after ``fork``, beside an async journal
on the same location, and after a SIGKILL in the middle of a claim. And the async face
used from another thread's event loop: refused at once, never a hang.

The journal's contract itself runs on both faces in the other modules of this folder
(``FACES``); these are the situations only threads, forks and event loops make.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import trio
from blockbuster import BlockBuster

import itemjournal
from itemjournal import Claim, ConflictError, JournalError, Reuse, Withdraw, sync
from itemjournal.testing import MemoryStore

DEFINITION = "billing-v1"
INPUTS = {"amount_cents": 1250}
SyncOpener = Callable[[], sync.Journal]


def item(name: str) -> tuple[str, str, str, str]:
    return ("shop", "billing", "charge", name)


@pytest.fixture
def open_sync(store_kind: str, request: pytest.FixtureRequest) -> Iterator[SyncOpener]:
    """Open blocking journals on the test's location (one shared ``MemoryStore`` for the
    in-memory store); all are closed at the end."""
    opened: list[sync.Journal] = []
    shared = MemoryStore() if store_kind == "memory" else None
    location = None if shared is not None else str(request.getfixturevalue("location"))

    def opener() -> sync.Journal:
        journal = sync.Journal(shared) if shared is not None else sync.Journal.open(location or "")
        opened.append(journal)
        return journal

    yield opener
    for journal in opened:
        journal.close()


# ---------------------------------------------------------------------------- threads


def test_32_threads_on_8_identities_one_claim_at_a_time(open_sync: SyncOpener) -> None:
    """Every thread races for every identity; a holder withdraws half the time (the next
    waiter then claims) and completes otherwise. At most one claim is open per identity
    at any moment, and every ``wait=`` is answered within its timeout and a second."""
    journal = open_sync()
    identities = [item(f"race-{n}") for n in range(8)]
    wait = 3.0
    lock = threading.Lock()
    holding: collections.Counter[tuple[str, ...]] = collections.Counter()
    most = 0
    claims: collections.Counter[tuple[str, ...]] = collections.Counter()
    answers: collections.Counter[str] = collections.Counter()
    slowest = 0.0
    start = threading.Barrier(32)
    problems: list[BaseException] = []

    def worker(number: int) -> None:
        nonlocal most, slowest
        start.wait()
        for identity in identities[number % 8 :] + identities[: number % 8]:
            began = time.monotonic()
            try:
                outcome = journal.begin(identity, INPUTS, DEFINITION, wait=wait)
            except ConflictError as refusal:
                outcome = refusal.code
            took = time.monotonic() - began
            with lock:
                slowest = max(slowest, took)
            if not isinstance(outcome, Claim):
                answers["reuse" if isinstance(outcome, Reuse) else str(outcome)] += 1
                continue
            with lock:
                holding[identity] += 1
                claims[identity] += 1
                most = max(most, holding[identity])
            time.sleep(0.002)
            with lock:
                holding[identity] -= 1
            if number % 2:
                journal.withdraw(outcome, "the provider was never called")
            else:
                journal.complete(outcome, f"receipt-{number}")

    def guarded(number: int) -> None:
        try:
            worker(number)
        except BaseException as error:  # a thread's failure must fail the test
            problems.append(error)

    threads = [threading.Thread(target=guarded, args=(n,)) for n in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not problems, problems
    assert not any(thread.is_alive() for thread in threads)
    assert most == 1, f"{most} claims open at once on one identity"
    assert slowest <= wait + 1.0, f"a wait={wait} begin took {slowest:.2f} s"
    for identity in identities:
        assert journal.inspect(identity).status == "succeeded"
        assert claims[identity] >= 1
    assert set(answers) <= {"reuse", "IN_PROGRESS"}
    print(f"claims per identity {sorted(claims.values())}; answers {dict(answers)}")


def test_a_waiting_thread_is_woken_when_the_holder_settles(open_sync: SyncOpener) -> None:
    journal = open_sync()
    claim = journal.begin(item("woken"), INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    got: list[object] = []

    def waiter() -> None:
        began = time.monotonic()
        got.append(journal.begin(item("woken"), INPUTS, DEFINITION, wait=20))
        got.append(time.monotonic() - began)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.2)
    settled = time.monotonic()
    journal.complete(claim, "r-1")
    thread.join(10)
    assert isinstance(got[0], Reuse) and got[0].receipt == "r-1"
    assert isinstance(got[1], float) and got[1] < 0.2 + (time.monotonic() - settled) + 2.0


def test_a_timed_out_wait_is_refused_in_progress(open_sync: SyncOpener) -> None:
    journal = open_sync()
    assert isinstance(journal.begin(item("held"), INPUTS, DEFINITION), Claim)
    began = time.monotonic()
    with pytest.raises(ConflictError) as refused:
        journal.begin(item("held"), INPUTS, DEFINITION, wait=0.5)
    assert refused.value.code == "IN_PROGRESS"
    assert 0.5 <= time.monotonic() - began < 1.5


# ---------------------------------------------------------------------------- event loops


def _newcomer(journal: itemjournal.Journal, runner: str, wait: float | None) -> object:
    """One thread's call, as a newcomer writes it: its own event loop per thread."""

    async def call() -> object:
        outcome = await journal.begin(item("newcomer"), INPUTS, DEFINITION, wait=wait)
        if isinstance(outcome, Claim):
            await anyio.sleep(1.0)
            await journal.complete(outcome, "r-newcomer")
            return "claimed"
        return outcome

    try:
        if runner == "trio":
            return trio.run(call)
        return asyncio.run(call())
    except JournalError as error:
        return error.code


@pytest.mark.parametrize("waiter_loop", ["asyncio", "trio"])
def test_the_newcomers_threads_each_in_their_own_event_loop_never_hang(
    store_kind: str, memory_ok: None, request: pytest.FixtureRequest, waiter_loop: str
) -> None:
    """One async ``Journal``, a holder and two waiters (``wait=2``), each thread in an event
    loop of its own: every thread returns within 5 s, with an answer or the documented
    refusal (``INVALID_ARGUMENT``, "OTHER_EVENT_LOOP")."""
    if store_kind == "memory":
        journal = itemjournal.Journal(MemoryStore())
    else:
        location = str(request.getfixturevalue("location"))
        journal = anyio.run(itemjournal.Journal.open, location)
    results: dict[str, object] = {}
    holder = threading.Thread(
        target=lambda: results.__setitem__("holder", _newcomer(journal, "asyncio", None))
    )
    holder.start()
    time.sleep(0.3)
    waiters = [
        threading.Thread(
            target=lambda n=n: results.__setitem__(f"waiter{n}", _newcomer(journal, waiter_loop, 2))
        )
        for n in range(2)
    ]
    began = time.monotonic()
    for thread in waiters:
        thread.start()
    for thread in [holder, *waiters]:
        thread.join(5)
    assert not any(thread.is_alive() for thread in [holder, *waiters]), results
    assert time.monotonic() - began < 5
    assert results["holder"] == "claimed"
    for name in ("waiter0", "waiter1"):
        answer = results[name]
        assert answer == "INVALID_ARGUMENT" or (
            isinstance(answer, Reuse) and answer.receipt == "r-newcomer"
        ), answer
    anyio.run(journal.aclose)


def test_an_async_journal_refuses_another_threads_event_loop_at_once(
    store_kind: str, memory_ok: None, request: pytest.FixtureRequest
) -> None:
    if store_kind == "memory":
        journal = itemjournal.Journal(MemoryStore())
    else:
        journal = anyio.run(itemjournal.Journal.open, str(request.getfixturevalue("location")))
    used = threading.Event()
    done = threading.Event()

    def owner() -> None:
        async def use() -> None:
            await journal.inspect(item("owned"))
            used.set()
            await anyio.to_thread.run_sync(done.wait)

        anyio.run(use)

    thread = threading.Thread(target=owner)
    thread.start()
    assert used.wait(10)
    began = time.monotonic()
    with pytest.raises(JournalError) as refused:
        anyio.run(journal.inspect, item("owned"))
    assert time.monotonic() - began < 1
    assert refused.value.code == "INVALID_ARGUMENT"
    assert "OTHER_EVENT_LOOP" in str(refused.value)
    assert "itemjournal.sync" in str(refused.value)
    done.set()
    thread.join(10)
    # Its thread has ended: the journal is free for this one's event loop.
    assert anyio.run(journal.inspect, item("owned")).status == "absent"
    anyio.run(journal.aclose)


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_a_blocking_call_inside_a_running_event_loop(
    open_sync: SyncOpener, blockbuster: BlockBuster, loop: str
) -> None:
    """Sync code called from a coroutine's thread (a notebook cell, a sync helper inside an
    async framework): it blocks that thread, as sync code does, and never says "cannot be
    called from a running event loop"."""
    blockbuster.deactivate()  # blocking the loop is what this caller chose
    journal = open_sync()

    async def cell() -> str:
        with journal.claim(item(f"in-{loop}"), INPUTS, DEFINITION) as attempt:
            assert not attempt.reused
            attempt.complete("r-loop")
        with journal.claim(item(f"in-{loop}"), INPUTS, DEFINITION) as again:
            assert again.reused
            return again.receipt

    assert (trio.run(cell) if loop == "trio" else asyncio.run(cell())) == "r-loop"


# ---------------------------------------------------------------------------- beside the async face


@pytest.mark.anyio
async def test_a_sync_and_an_async_journal_on_one_location_exclude_each_other(
    open_sync: SyncOpener, store_kind: str, request: pytest.FixtureRequest
) -> None:
    blocking = await anyio.to_thread.run_sync(open_sync)
    if store_kind == "memory":
        store = blocking.store
        assert isinstance(store, MemoryStore)
        awaited = itemjournal.Journal(store)
    else:
        awaited = await itemjournal.Journal.open(str(request.getfixturevalue("location")))
    try:
        held = await awaited.begin(item("a-holds"), INPUTS, DEFINITION)
        assert isinstance(held, Claim)
        with pytest.raises(ConflictError) as refused:
            await anyio.to_thread.run_sync(blocking.begin, item("a-holds"), INPUTS, DEFINITION)
        assert refused.value.code == "IN_PROGRESS"
        await awaited.complete(held, "r-async")
        reused = await anyio.to_thread.run_sync(blocking.begin, item("a-holds"), INPUTS, DEFINITION)
        assert isinstance(reused, Reuse) and reused.receipt == "r-async"

        claim = await anyio.to_thread.run_sync(blocking.begin, item("s-holds"), INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        with pytest.raises(ConflictError) as refused:
            await awaited.begin(item("s-holds"), INPUTS, DEFINITION)
        assert refused.value.code == "IN_PROGRESS"
        await anyio.to_thread.run_sync(blocking.complete, claim, "r-sync")
        again = await awaited.begin(item("s-holds"), INPUTS, DEFINITION)
        assert isinstance(again, Reuse) and again.receipt == "r-sync"
        statuses = {view.identity.item: view.status async for view in awaited.records()}
        assert statuses == {"a-holds": "succeeded", "s-holds": "succeeded"}
    finally:
        await awaited.aclose()


# ---------------------------------------------------------------------------- fork


def test_a_journal_opened_before_fork_works_in_the_child(
    open_sync: SyncOpener, store_kind: str
) -> None:
    journal = open_sync()
    done = journal.begin(item("before"), INPUTS, DEFINITION)
    assert isinstance(done, Claim)
    journal.complete(done, "r-before")
    held = journal.begin(item("held"), INPUTS, DEFINITION)
    assert isinstance(held, Claim)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it saw, never return into pytest
        code = 1
        try:
            seen: dict[str, object] = {}
            reused = journal.begin(item("before"), INPUTS, DEFINITION)
            seen["before"] = reused.receipt if isinstance(reused, Reuse) else repr(reused)
            try:
                journal.begin(item("held"), INPUTS, DEFINITION)
                seen["held"] = "claimed"
            except ConflictError as refusal:
                seen["held"] = refusal.code
            with journal.claim(item("child"), INPUTS, DEFINITION) as attempt:
                attempt.complete("r-child")
            seen["child"] = journal.inspect(item("child")).status
            os.write(write, json.dumps(seen).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        seen = json.loads(pipe.read() or "{}")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, seen
    assert seen == {"before": "r-before", "held": "IN_PROGRESS", "child": "succeeded"}
    # The parent's journal goes on, and (on a shared store) sees the child's record.
    journal.complete(held, "r-held")
    if store_kind != "memory":
        assert journal.inspect(item("child")).status == "succeeded"


# ---------------------------------------------------------------------------- SIGKILL

_HOLDER = textwrap.dedent(
    """
    import sys, time
    from itemjournal.sync import Journal
    journal = Journal.open(sys.argv[1])
    claim = journal.begin(("shop", "billing", "charge", "killed"), {"amount_cents": 1250},
                          "billing-v1")
    print("claimed", flush=True)
    time.sleep(120)
    """
)


def test_a_sigkill_in_the_middle_of_a_sync_claim_is_found_at_the_next_begin(
    location: str, store_kind: str
) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", _HOLDER, location], stdout=subprocess.PIPE, text=True
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "claimed"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
    with sync.Journal.open(location) as journal:
        deadline = time.monotonic() + 60
        # The PostgreSQL server ends the killed process's session (and its owner lock)
        # once it has seen the connection go; until then the owner rightly looks alive.
        while journal.inspect(item("killed")).owner_alive is not False:
            assert time.monotonic() < deadline, "the killed owner never looked gone"
            time.sleep(0.1)
        with pytest.raises(ConflictError) as refused:
            journal.begin(item("killed"), INPUTS, DEFINITION)
        assert refused.value.code == "REVIEW_REQUIRED"
        view = journal.inspect(item("killed"))
        assert view.status == "needs_review"
        assert view.review_reason is not None and "gone" in view.review_reason
    print(f"{store_kind}: the SIGKILLed owner's claim needs review")


# ---------------------------------------------------------------------------- interruptions


def test_a_keyboard_interrupt_in_a_claim_block_marks_the_record_for_review(
    open_sync: SyncOpener,
) -> None:
    journal = open_sync()
    with pytest.raises(KeyboardInterrupt), journal.claim(item("stopped"), INPUTS, DEFINITION):
        raise KeyboardInterrupt
    view = journal.inspect(item("stopped"))
    assert view.status == "needs_review"
    assert view.review_reason == "block interrupted (KeyboardInterrupt)"


def test_a_keyboard_interrupt_while_preparing_withdraws_the_claim(open_sync: SyncOpener) -> None:
    journal = open_sync()
    with (
        pytest.raises(KeyboardInterrupt),
        journal.claim(item("prep"), INPUTS, DEFINITION) as attempt,
        attempt.preparing(),
    ):
        raise KeyboardInterrupt
    view = journal.inspect(item("prep"))
    assert view.status == "released"
    assert view.history[-1].note == "interrupted (KeyboardInterrupt) while preparing"


def test_a_withdraw_from_a_sync_block_releases_the_item(open_sync: SyncOpener) -> None:
    journal = open_sync()
    with pytest.raises(Withdraw), journal.claim(item("w"), INPUTS, DEFINITION):
        raise Withdraw("card declined before sending")
    assert journal.inspect(item("w")).status == "released"


# ---------------------------------------------------------------------------- once, reconcile


def test_sync_once_runs_a_plain_function_once_per_item(open_sync: SyncOpener) -> None:
    journal = open_sync()
    effects: list[str] = []

    @sync.once(journal, identity=item, inputs={}, definition="v1")
    def charge(order: str) -> str:
        effects.append(order)
        return f"ch-{order}"

    assert charge("o-1") == "ch-o-1"
    assert charge("o-1") == "ch-o-1"
    assert effects == ["o-1"]
    with pytest.raises(itemjournal.InvalidArgument):

        @sync.once(journal, identity=item("x"))
        async def not_plain() -> str:  # pragma: no cover - refused when decorated
            return "never"


def test_sync_reconcile_takes_a_plain_or_an_async_check(open_sync: SyncOpener) -> None:
    journal = open_sync()
    for name in ("happened", "not-happened"):
        claim = journal.begin(item(name), INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        journal.mark_review(item(name), "timeout")

    def plain(view: itemjournal.RecordView) -> object:
        if view.identity.item == "happened":
            return itemjournal.Happened("ch-1")
        return itemjournal.Unknown("ask later")

    async def awaited(view: itemjournal.RecordView) -> object:
        await anyio.lowlevel.checkpoint()
        return itemjournal.DidNotHappen("the provider has no such charge")

    report = journal.reconcile(plain)
    assert [view.identity.item for view in report.happened] == ["happened"]
    report = journal.reconcile(awaited)
    assert [view.identity.item for view in report.did_not_happen] == ["not-happened"]
    assert journal.inspect(item("not-happened")).status == "released"


def test_a_store_without_blocking_calls_is_refused(tmp_path: Path) -> None:
    class OnlyAsync:
        location = "nowhere"

    with pytest.raises(itemjournal.InvalidArgument) as refused:
        sync.Journal(OnlyAsync())  # type: ignore[arg-type]
    assert "itemjournal.sync" in str(refused.value)


class _InterruptedOnce(MemoryStore):
    """A store whose next write lands, and then the caller is interrupted (Ctrl-C) before
    the answer reaches it: as a ``KeyboardInterrupt`` after the store's save."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupt_next = False

    def apply_blocking(self, identity: itemjournal.Identity, step: Callable[..., object]) -> object:
        answer = super().apply_blocking(identity, step)  # type: ignore[arg-type]
        if self.interrupt_next:
            self.interrupt_next = False
            raise KeyboardInterrupt
        return answer


def test_an_interrupt_after_begin_wrote_takes_the_claim_back() -> None:
    store = _InterruptedOnce()
    journal = sync.Journal(store)
    store.interrupt_next = True
    with pytest.raises(KeyboardInterrupt):
        journal.begin(item("taken-back"), INPUTS, DEFINITION)
    assert journal.inspect(item("taken-back")).status == "absent"
    assert isinstance(journal.begin(item("taken-back"), INPUTS, DEFINITION), Claim)


def test_an_interrupt_during_the_blocks_exit_lets_the_write_finish() -> None:
    store = _InterruptedOnce()
    journal = sync.Journal(store)
    with (
        pytest.raises(KeyboardInterrupt) as interrupted,
        journal.claim(item("exit"), INPUTS, DEFINITION),
    ):
        store.interrupt_next = True  # the exit's write lands, then Ctrl-C
        raise RuntimeError("the provider timed out")
    # The interrupt goes on, carrying what the exit did; the exit's write stands.
    assert any("needs_review" in note for note in interrupted.value.__notes__)
    view = journal.inspect(item("exit"))
    assert view.status == "needs_review"
    assert view.review_reason == "block raised RuntimeError: the provider timed out"


def test_sync_reconcile_runs_at_most_limit_plain_checks_at_once(open_sync: SyncOpener) -> None:
    """The blocking face's checks run in a pool of ``limit`` threads: the first checks are
    held until ``limit`` of them are in flight, so fewer at once would never gather."""
    journal = open_sync()
    for n in range(12):
        claim = journal.begin(item(f"limit-{n}"), INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        journal.mark_review(item(f"limit-{n}"), "timeout")
    for limit in (1, 3, 5):
        lock = threading.Condition()
        in_flight = 0
        most = 0
        gathered = False

        def check(
            view: itemjournal.RecordView, limit: int = limit, lock: threading.Condition = lock
        ) -> object:
            nonlocal in_flight, most, gathered
            with lock:
                in_flight += 1
                most = max(most, in_flight)
                if in_flight >= limit:
                    gathered = True
                    lock.notify_all()
                assert lock.wait_for(lambda: gathered, timeout=30), "never gathered"
                in_flight -= 1
            return itemjournal.Unknown("ask later")

        report = journal.reconcile(check, limit=limit, dry_run=True)
        assert len(report.unknown) == 12
        assert most == limit, (limit, most)


# ---------------------------------------------------------------------------- turns of threads


def test_a_turn_let_go_before_the_wait_is_taken_at_once() -> None:
    from itemjournal._sync.turns import Turns

    turns = Turns()
    identity = itemjournal.Identity(*item("turn"))
    turns.wait_turn(identity)  # nobody has it (any more): taken, no waiting
    assert identity in turns.busy
    turns.release(identity)
    assert turns.busy == {}


def test_sync_once_takes_a_function_that_gives_the_journal(open_sync: SyncOpener) -> None:
    journal = open_sync()
    effects: list[str] = []

    @sync.once(lambda: journal, identity=item("from-a-function"), definition="v1")
    def charge() -> str:
        effects.append("charged")
        return "ch-f"

    assert charge() == "ch-f" and charge() == "ch-f"
    assert effects == ["charged"]

    @sync.once(lambda: "not a journal", identity=item("wrong"), definition="v1")  # type: ignore[arg-type, return-value]
    def wrong() -> str:  # pragma: no cover - refused before it runs
        return "never"

    with pytest.raises(itemjournal.InvalidArgument) as refused:
        wrong()
    assert "not a Journal" in str(refused.value)


def test_sync_once_replays_a_pair_and_sends_a_bad_return_to_review(open_sync: SyncOpener) -> None:
    journal = open_sync()

    @sync.once(journal, identity=lambda n: item(f"pair-{n}"), definition="v1")
    def charge(n: int) -> tuple[str, str | None]:
        return f"ch-{n}", '{"ok": true}'

    assert charge(1) == ("ch-1", '{"ok": true}')
    assert charge(1) == ("ch-1", '{"ok": true}')  # the stored pair, replayed

    @sync.once(journal, identity=item("bad-return"), definition="v1")
    def broken() -> str:
        return 42  # type: ignore[return-value]

    with pytest.raises(itemjournal.InvalidArgument) as refused:
        broken()
    assert refused.value.code == "INVALID_RECEIPT"
    assert journal.inspect(item("bad-return")).status == "needs_review"
