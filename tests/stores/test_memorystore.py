"""The in-memory store's own tests: ready without ``open``, as strict as the durable
stores, one claim under contention, cancellation, ``aclose``, settings and scans.

The conformance tests (``journal``/``make_journal``) run on it too, through conftest."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import anyio.lowlevel
import pytest
from _builders import started_record

from itemjournal import (
    Claim,
    ConflictError,
    Identity,
    InvalidArgument,
    Journal,
    RecordInvalid,
    Reuse,
    StorageFailed,
    Store,
    definition_digest,
)
from itemjournal._model.codec import decode_record, encode_record
from itemjournal._model.identity import identity_digest
from itemjournal._model.records import MAX_RECORD_BYTES, Record
from itemjournal._stores.seam import Step, StepFunction
from itemjournal.testing import MemoryStore

pytestmark = pytest.mark.anyio

T = TypeVar("T")

INPUTS = {"order": "o-1", "amount": "12.50"}
DEFINITION = definition_digest("billing-v1")


def ident(item: str) -> Identity:
    return Identity("shop", "billing", "charge", item)


ITEM = ident("order-1")
OTHER = ident("order-2")


# ---------------------------------------------------------------------------- no open


async def test_a_journal_over_a_new_memory_store_works_without_open() -> None:
    store = MemoryStore()
    journal = Journal(store)
    claim = await journal.begin(ITEM, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    assert (await journal.inspect(ITEM)).status == "started"
    await journal.complete(claim, "ch_1")
    again = await journal.begin(ITEM, INPUTS, DEFINITION)
    assert isinstance(again, Reuse)
    assert again.receipt == "ch_1"
    assert again.executed_here is False
    await journal.aclose()


async def test_open_may_still_be_called_and_changes_nothing() -> None:
    store = MemoryStore()
    journal = Journal(store)
    assert isinstance(await journal.begin(ITEM, INPUTS, DEFINITION), Claim)
    await store.open()
    await store.open()
    assert (await journal.inspect(ITEM)).status == "started"
    assert await store.check() == []  # nothing of its own can be damaged


async def test_each_store_is_its_own_location_and_journals_over_one_share_it() -> None:
    first, second = MemoryStore(), MemoryStore()
    assert first.location.startswith("memory:")
    assert first.location != second.location
    assert repr(first) == f"MemoryStore({first.location!r})"
    typed: Store = first  # the protocol, as mypy sees it
    assert typed is first

    await Journal(first).begin(ITEM, INPUTS, DEFINITION)
    assert (await Journal(second).inspect(ITEM)).status == "absent"
    shared = Journal(first)
    assert (await shared.inspect(ITEM)).status == "started"
    with pytest.raises(ConflictError):
        await shared.begin(ITEM, INPUTS, DEFINITION)


async def test_a_keyed_journal_over_a_memory_store_fingerprints_with_its_key() -> None:
    journal = Journal(MemoryStore(), input_key=b"k" * 32)
    claim = await journal.begin(ITEM, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    data = journal.store.document(ITEM)  # type: ignore[attr-defined]
    assert decode_record(data, ITEM).input_kind == journal.input_kind
    assert journal.input_kind.startswith("hmac-sha256:")


async def test_steps_run_on_the_event_loop_with_no_worker_thread() -> None:
    store = MemoryStore()
    seen: list[int] = []

    def step(current: Record | None) -> Step[None]:
        seen.append(threading.get_ident())
        return Step(None, None)

    await store.apply(ITEM, step)
    await store.peek(ITEM, lambda record: seen.append(threading.get_ident()))
    assert seen == [threading.get_ident()] * 2


async def test_a_step_that_must_read_proc_to_judge_an_owner_runs_again_in_a_thread() -> None:
    """Another process's liveness is read from ``/proc``: not on the event loop (the
    blocking-call detector would fail this test on asyncio). The step is stopped there
    and run again in a worker thread, which answers."""
    store = MemoryStore()
    gone = dataclasses.replace(store.owner(), pid=2**22 + 17)  # no such process
    ran: list[tuple[int, bool | None]] = []

    def step(current: Record | None) -> Step[bool | None]:
        alive = store.owner_alive(gone)
        ran.append((threading.get_ident(), alive))
        return Step(None, alive)

    assert await store.apply(ITEM, step) is False
    assert await store.peek(ITEM, lambda record: store.owner_alive(gone)) is False
    assert len(ran) == 1  # the run on the loop stopped before it got an answer
    assert ran[0][0] != threading.get_ident()


async def test_this_process_as_owner_is_judged_on_the_loop() -> None:
    store = MemoryStore()
    me = await anyio.to_thread.run_sync(store.owner)  # named once (reads /proc)
    threads: list[int] = []

    def step(current: Record | None) -> Step[tuple[object, bool | None]]:
        threads.append(threading.get_ident())
        return Step(None, (store.owner(), store.owner_alive(me)))

    assert await store.apply(ITEM, step) == (me, True)
    assert threads == [threading.get_ident()]


async def test_a_step_on_the_loop_waits_in_a_thread_for_an_identity_a_thread_holds() -> None:
    store = MemoryStore()
    release = threading.Event()
    entered = threading.Event()
    order: list[str] = []

    def slow(current: Record | None) -> Step[None]:
        order.append("slow")
        entered.set()
        release.wait(5)
        return Step(None, None)

    def slow_owner_step(current: Record | None) -> Step[None]:
        store.gone_reason(None)  # always read in a thread
        return slow(current)

    def quick(current: Record | None) -> Step[None]:
        order.append("quick")
        return Step(None, None)

    async with anyio.create_task_group() as tg:
        tg.start_soon(store.apply, ITEM, slow_owner_step)
        await anyio.to_thread.run_sync(entered.wait, 5)
        tg.start_soon(store.apply, ITEM, quick)
        await anyio.sleep(0.05)
        assert order == ["slow"]  # the quick step did not run beside the held identity
        release.set()
    assert order == ["slow", "quick"]


# ---------------------------------------------------------------------------- strictness


async def test_what_is_kept_is_the_record_document_and_never_the_inputs() -> None:
    store = MemoryStore()
    journal = Journal(store)
    secret = "4242-4242-4242-4242"
    claim = await journal.begin(ITEM, {"card": secret}, DEFINITION)
    assert isinstance(claim, Claim)
    await journal.complete(claim, "ch_1")
    data = store.document(ITEM)
    assert isinstance(data, bytes)
    record = decode_record(data, ITEM)
    assert record.status == "succeeded"
    assert encode_record(record) == data
    assert b"ch_1" in data
    assert secret.encode() not in data
    assert store.document(OTHER) is None


def _oversize() -> bytes:
    document = encode_record(started_record(ITEM))
    return document[:-2] + b" " * (MAX_RECORD_BYTES - len(document) + 1) + document[-2:]


def _edited(old: bytes, new: bytes) -> bytes:
    document = encode_record(started_record(ITEM))
    assert old in document, document
    return document.replace(old, new)


BAD_DOCUMENTS: dict[str, Callable[[], bytes]] = {
    "empty": lambda: b"",
    "not json": lambda: b"{not json",
    "not utf-8": lambda: b'{"status": "\xff"}',
    "not an object": lambda: b"[]",
    "unknown field": lambda: _edited(b'"version"', b'"extra": 1, "version"'),
    "unknown status": lambda: _edited(b'"status": "started"', b'"status": "paused"'),
    "another identity's record": lambda: encode_record(started_record(OTHER)),
    "oversize": _oversize,
}


@pytest.mark.parametrize("name", sorted(BAD_DOCUMENTS))
async def test_a_planted_bad_document_is_record_invalid_and_left_as_found(name: str) -> None:
    data = BAD_DOCUMENTS[name]()
    store = MemoryStore()
    journal = Journal(store)
    store.put_document(ITEM, data)
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: journal.inspect(ITEM),
        lambda: journal.begin(ITEM, INPUTS, DEFINITION),
        lambda: journal.mark_review(ITEM),
        lambda: journal.resolve(ITEM, retry=True, note="checked"),
    ]
    for call in calls:
        with pytest.raises(RecordInvalid) as caught:
            await call()
        assert caught.value.code == "RECORD_INVALID"
        assert store.document(ITEM) == data

    for status in (None, "started", "succeeded"):
        found = [item async for item in store.scan(status=status)]
        assert len(found) == 1
        assert isinstance(found[0], RecordInvalid)
        assert found[0].location == f"{store.location}#{identity_digest(ITEM)}"
    report = await journal.sweep()
    assert report.marked == ()
    assert [problem.code for problem in report.problems] == ["RECORD_INVALID"]
    assert store.document(ITEM) == data


async def test_a_step_that_raises_writes_nothing() -> None:
    store = MemoryStore()
    journal = Journal(store)
    assert isinstance(await journal.begin(ITEM, INPUTS, DEFINITION), Claim)
    before = store.document(ITEM)

    def refuse(current: Record | None) -> Step[None]:
        assert current is not None
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        await store.apply(ITEM, refuse)
    assert store.document(ITEM) == before


async def test_a_record_the_strict_reader_would_refuse_is_never_written() -> None:
    store = MemoryStore()
    # Text from outside the journal is where a record could break the reader's rules.
    bad = dataclasses.replace(started_record(ITEM), review_reason="r" * 501)

    with pytest.raises(RecordInvalid):
        await store.apply(ITEM, lambda current: Step(bad, None))
    assert store.document(ITEM) is None


async def test_put_document_plants_and_removes_and_takes_only_bytes() -> None:
    store = MemoryStore()
    document = encode_record(started_record(ITEM))
    store.put_document(list(ITEM), document)
    assert (await Journal(store).inspect(ITEM)).status == "started"
    store.put_document(ITEM, None)
    assert store.document(ITEM) is None
    store.put_document(ITEM, None)  # removing what is not there is no error
    with pytest.raises(InvalidArgument):
        store.put_document(ITEM, "text")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- aclose


async def test_aclose_waits_for_a_call_under_way_then_refuses_every_later_call() -> None:
    store = MemoryStore()
    entered, release = threading.Event(), threading.Event()
    record = started_record(ITEM)

    def slow(current: Record | None) -> Step[str]:
        store.gone_reason(None)  # a question only a worker thread answers: the step runs there
        entered.set()
        release.wait(10)
        return Step(record, "written")

    answers: list[str] = []
    closed = anyio.Event()

    async def call() -> None:
        answers.append(await store.apply(ITEM, slow))

    async def close() -> None:
        await store.aclose()
        closed.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        await anyio.to_thread.run_sync(entered.wait)
        tg.start_soon(close)
        for _ in range(20):
            await anyio.sleep(0.001)
        assert not closed.is_set()  # the step is still running
        assert answers == []
        release.set()
    assert closed.is_set()
    assert answers == ["written"]
    assert store.document(ITEM) == encode_record(record)  # it finished its write

    refused: list[Callable[[], Awaitable[object]]] = [
        lambda: store.apply(ITEM, lambda current: Step(None, None)),
        lambda: store.peek(ITEM, lambda current: current),
        lambda: store.setting("input_kind", "sha256"),
        store.open,
        store.check,
        lambda: anext(store.scan()),
        lambda: Journal(store).begin(OTHER, INPUTS, DEFINITION),
    ]
    for refuse in refused:
        with pytest.raises(StorageFailed) as caught:
            await refuse()
        assert caught.value.code == "STORAGE_FAILED"
        assert isinstance(caught.value, OSError)
        assert "closed" in str(caught.value)
    await store.aclose()  # a second close is no error
    assert store.document(OTHER) is None


async def test_a_cancelled_aclose_still_waits_for_the_call_under_way() -> None:
    store = MemoryStore()
    entered, release = threading.Event(), threading.Event()

    def slow(current: Record | None) -> Step[str]:
        store.gone_reason(None)  # a question only a worker thread answers: the step runs there
        entered.set()
        release.wait(10)
        return Step(started_record(ITEM), "written")

    answers: list[str] = []

    async def call() -> None:
        answers.append(await store.apply(ITEM, slow))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        await anyio.to_thread.run_sync(entered.wait)
        with anyio.CancelScope() as scope:
            scope.cancel()
            threading.Timer(0.02, release.set).start()
            await store.aclose()
        assert answers == ["written"]  # aclose returned only after the call ended


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_natively_cancelled_aclose_still_waits_then_stays_cancelled(
    anyio_backend: str,
) -> None:
    store = MemoryStore()
    entered, release = threading.Event(), threading.Event()

    def slow(current: Record | None) -> Step[str]:
        store.gone_reason(None)  # a question only a worker thread answers: the step runs there
        entered.set()
        release.wait(10)
        return Step(started_record(ITEM), "written")

    call = asyncio.ensure_future(store.apply(ITEM, slow))
    await anyio.to_thread.run_sync(entered.wait)
    closing = asyncio.ensure_future(store.aclose())
    await asyncio.sleep(0.005)
    closing.cancel()
    await asyncio.sleep(0.005)
    assert not closing.done()  # still waiting for the call under way
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert await call == "written"


# ---------------------------------------------------------------------------- settings


async def test_settings_are_recorded_once_and_the_first_value_wins() -> None:
    store = MemoryStore()
    assert await store.setting("input_kind", "sha256") == "sha256"
    assert await store.setting("input_kind", "hmac-sha256:0123456789abcdef") == "sha256"
    assert await store.setting("other", "x") == "x"
    assert await MemoryStore().setting("input_kind", "y") == "y"  # one store's alone
    for name, value in (("", "v"), (1, "v"), ("name", None)):
        with pytest.raises(InvalidArgument):
            await store.setting(name, value)  # type: ignore[arg-type]


async def test_of_many_first_setters_one_wins_and_all_are_told_which() -> None:
    store = MemoryStore()
    told: list[str] = []

    async def one(value: str) -> None:
        told.append(await store.setting("input_kind", value))

    async with anyio.create_task_group() as tg:
        for n in range(16):
            tg.start_soon(one, f"kind-{n}")
    assert len(told) == 16
    assert len(set(told)) == 1


# ---------------------------------------------------------------------------- scans


async def _make_records(journal: Journal, count: int) -> list[Identity]:
    identities = [ident(f"scan-{n}") for n in range(count)]
    for identity in identities:
        await journal.begin(identity, INPUTS, DEFINITION)
    return identities


def _digest_of(item: Record | RecordInvalid | StorageFailed) -> str:
    """The identity digest a scanned item was stored under."""
    if isinstance(item, Record):
        return identity_digest(item.identity)
    assert isinstance(item, RecordInvalid), item
    assert item.location is not None
    return item.location.rpartition("#")[2]


async def test_a_scan_yields_every_record_in_digest_order() -> None:
    store = MemoryStore()
    journal = Journal(store)
    identities = await _make_records(journal, 10)
    claim = await journal.begin(ITEM, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    await journal.complete(claim, "ch_1")
    store.put_document(OTHER, b"{")

    wanted = sorted(identity_digest(i) for i in (*identities, ITEM, OTHER))
    for batch in (1, 3, 256):
        found = [_digest_of(item) async for item in store.scan(batch=batch)]
        assert found == wanted
    started = [item async for item in store.scan(status="started", batch=4)]
    assert sum(isinstance(item, RecordInvalid) for item in started) == 1
    assert sorted(item.identity for item in started if isinstance(item, Record)) == sorted(
        identities
    )
    succeeded = [item async for item in store.scan(status="succeeded")]
    assert [item.identity for item in succeeded if isinstance(item, Record)] == [ITEM]
    assert [item async for item in MemoryStore().scan()] == []
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidArgument):
            await anext(store.scan(batch=bad))  # type: ignore[arg-type]


async def test_a_scan_reads_each_batch_when_it_gets_there() -> None:
    """The digests are taken at the start; each batch's records are read when its turn
    comes: one removed meanwhile is skipped, one changed is seen changed, one added is
    not seen."""
    store = MemoryStore()
    journal = Journal(store)
    identities = await _make_records(journal, 9)
    ordered = sorted(identities, key=identity_digest)
    removed, changed = ordered[7], ordered[8]
    seen: list[Record | RecordInvalid | StorageFailed] = []
    async for item in store.scan(batch=3):
        seen.append(item)
        if len(seen) == 1:  # the first batch is read; the last is not yet
            store.put_document(removed, None)
            await journal.mark_review(changed, "checked by hand")
            await journal.begin(ITEM, INPUTS, DEFINITION)
    records = [item for item in seen if isinstance(item, Record)]
    assert len(records) == len(seen) == 8
    assert [r.identity for r in records] == [i for i in ordered if i != removed]
    assert records[-1].status == "needs_review"
    assert ITEM not in {r.identity for r in records}


# ---------------------------------------------------------------------------- one claim


def _split(results: list[object]) -> tuple[list[Claim], list[ConflictError]]:
    claims = [r for r in results if isinstance(r, Claim)]
    errors = [r for r in results if isinstance(r, ConflictError)]
    assert len(claims) + len(errors) == len(results), results
    return claims, errors


@pytest.mark.parametrize("journals", [1, 2, 64])
async def test_64_concurrent_begins_grant_exactly_one_claim(journals: int) -> None:
    """Over one journal, two, or one journal per begin (64 steps racing in worker
    threads): the store's lock per identity leaves exactly one claim."""
    store = MemoryStore()
    opened = [Journal(store) for _ in range(journals)]
    results: list[object] = []
    gate = anyio.Event()

    async def one(journal: Journal) -> None:
        await gate.wait()
        try:
            results.append(await journal.begin(ITEM, INPUTS, DEFINITION))
        except ConflictError as error:
            results.append(error)

    async with anyio.create_task_group() as tg:
        for n in range(64):
            tg.start_soon(one, opened[n % journals])
        gate.set()
    claims, errors = _split(results)
    assert len(claims) == 1
    assert len(errors) == 63
    assert all(e.view is not None and e.view.status == "started" for e in errors)
    view = await opened[-1].inspect(ITEM)
    assert view.status == "started"
    assert [event.event for event in view.history] == ["begin"]


async def test_steps_on_one_identity_never_overlap() -> None:
    """Half the steps run on the loop, half in worker threads (they ask what only a
    thread may read); none of them runs while another of the same identity does."""
    store = MemoryStore()
    inside = 0
    overlaps = 0
    threads = 0
    guard = threading.Lock()

    def step(in_a_thread: bool) -> StepFunction[None]:
        def run(current: Record | None) -> Step[None]:
            nonlocal inside, overlaps, threads
            if in_a_thread:
                store.gone_reason(None)
            with guard:
                inside += 1
                overlaps += inside > 1
                threads += in_a_thread
            if in_a_thread:
                time.sleep(0.0002)
            with guard:
                inside -= 1
            return Step(None, None)

        return run

    async with anyio.create_task_group() as tg:
        for index in range(32):
            tg.start_soon(store.apply, ITEM, step(index % 2 == 1))
    assert threads == 16
    assert overlaps == 0


# ---------------------------------------------------------------------------- cancellation


async def _cancel_after(scope: anyio.CancelScope, rounds: int) -> None:
    for _ in range(rounds):
        await anyio.lowlevel.checkpoint()
    scope.cancel()


async def test_a_cancelled_begin_leaves_nothing_or_its_claim() -> None:
    store = MemoryStore()
    journal = Journal(store)
    rng = random.Random(0x3E3)
    started = time.perf_counter()
    await journal.begin(ident("calibrate"), INPUTS, DEFINITION)
    one = max(time.perf_counter() - started, 1e-5)

    outcomes: dict[Identity, Claim | Reuse | None] = {}
    for n in range(200):
        identity = ident(f"cancel-{n}")
        got: Claim | Reuse | None = None
        if n % 2 == 0:
            delay = 0.0 if rng.random() < 0.1 else 10 ** rng.uniform(-6.5, math.log10(2 * one))
            with anyio.move_on_after(delay):
                got = await journal.begin(identity, INPUTS, DEFINITION)
        else:
            rounds = min(int(rng.expovariate(0.4)), 60)
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_after, tg.cancel_scope, rounds)
                got = await journal.begin(identity, INPUTS, DEFINITION)
                tg.cancel_scope.cancel()
        outcomes[identity] = got

    claimed = 0
    for identity, got in outcomes.items():
        view = await journal.inspect(identity)
        if isinstance(got, Claim):
            claimed += 1
            assert view.status == "started", (identity, view)
        else:
            assert got is None
            assert view.status == "absent", (identity, view)
            assert store.document(identity) is None
    assert 0 < claimed < len(outcomes)  # both outcomes happened, or this proved nothing
    print(f"memory store: {len(outcomes) - claimed} of {len(outcomes)} begins cancelled")


class GatedStore(MemoryStore):
    """Once armed, each step runs in a worker thread and waits there after deciding, until let go:
    a native cancellation can then land while the write is under way."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.entered = threading.Event()
        self.proceed = threading.Event()

    async def apply(self, identity: Identity, step: StepFunction[T]) -> T:
        armed = self.armed

        def gated(current: Record | None) -> Step[T]:
            if armed:
                self.gone_reason(None)  # only a worker thread answers: the step runs there
            decision = step(current)
            if armed:
                self.entered.set()
                self.proceed.wait(10)
            return decision

        return await super().apply(identity, gated)


async def _natively_cancel_a_begin(journal: Journal, store: GatedStore, identity: Identity) -> None:
    store.armed, store.entered, store.proceed = True, threading.Event(), threading.Event()
    task = asyncio.ensure_future(journal.begin(identity, INPUTS, DEFINITION))
    while not store.entered.is_set():  # noqa: ASYNC110 - a worker thread sets it
        await asyncio.sleep(0.001)
    store.armed = False
    task.cancel()
    task.cancel()  # twice: the second must not cut the wait for the write short
    await asyncio.sleep(0.01)
    store.proceed.set()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_natively_cancelled_first_begin_is_taken_back(anyio_backend: str) -> None:
    """The claim was written but never returned: the journal deletes it again."""
    store = GatedStore()
    journal = Journal(store)
    await _natively_cancel_a_begin(journal, store, ITEM)
    assert store.document(ITEM) is None
    assert (await journal.inspect(ITEM)).status == "absent"
    assert isinstance(await journal.begin(ITEM, INPUTS, DEFINITION), Claim)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_natively_cancelled_retry_restores_the_released_record(anyio_backend: str) -> None:
    store = GatedStore()
    journal = Journal(store)
    assert isinstance(await journal.begin(ITEM, INPUTS, DEFINITION), Claim)
    await journal.mark_review(ITEM, "timeout")
    released = await journal.resolve(ITEM, retry=True, note="verified not charged")
    document = store.document(ITEM)
    await _natively_cancel_a_begin(journal, store, ITEM)
    assert store.document(ITEM) == document
    assert await journal.inspect(ITEM) == released
