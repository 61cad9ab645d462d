"""Reconciliation: each needs_review record is settled as its check's verdict says, through
an audited resolve of the very record the check saw; everything else is left alone.

Every test runs on asyncio and trio, over the conformance stores (``journal`` /
``make_journal``)."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import sqlite3
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from itemjournal import (
    Claim,
    ConflictError,
    DidNotHappen,
    Happened,
    Identity,
    InvalidArgument,
    Journal,
    ReconcileReport,
    RecordInvalid,
    RecordView,
    Reuse,
    StorageFailed,
    Unknown,
    definition_digest,
)
from itemjournal._journal.reconcile import resolution_note
from itemjournal._model.identity import identity_digest

pytestmark = pytest.mark.anyio
# The contract holds on both faces of the journal (tests/_faces.py).
FACES = ("async", "sync")

DEFINITION = definition_digest("reconcile-tests-v1")
INPUTS = {"amount": 1250}
MAX_NOTE = 500


def ident(name: str, scope: str = "shop") -> Identity:
    return Identity(scope, "billing", "charge", name)


async def make_review(journal: Journal, names: list[str], scope: str = "shop") -> None:
    """A needs_review record for each name (begin, then mark_review), a few at a time."""
    limiter = anyio.CapacityLimiter(16)

    async def one(name: str) -> None:
        async with limiter:
            identity = ident(name, scope)
            claim = await journal.begin(identity, INPUTS, DEFINITION)
            assert isinstance(claim, Claim)
            await journal.mark_review(identity, "provider timed out")

    async with anyio.create_task_group() as group:
        for name in names:
            group.start_soon(one, name)


async def snapshot(journal: Journal) -> dict[Identity, RecordView]:
    found: dict[Identity, RecordView] = {}
    async with contextlib.aclosing(journal.records(problems=True)) as items:
        async for item in items:
            assert isinstance(item, RecordView), item
            found[item.identity] = item
    return found


def number(view: RecordView) -> int:
    return int(view.identity.item.rpartition("-")[2])


def reconciled_events(view: RecordView) -> list[str]:
    return [
        event.note or ""
        for event in view.history
        if event.event == "resolve" and (event.note or "").startswith("reconciled by ")
    ]


# ---------------------------------------------------------------------- verdicts themselves


@pytest.mark.parametrize("evidence", ["", "   ", "\n\t", None, 5, b"no charge", "\udcff"])
def test_did_not_happen_needs_real_evidence(evidence: Any) -> None:
    with pytest.raises(InvalidArgument) as refused:
        DidNotHappen(evidence)
    assert refused.value.code == "INVALID_ARGUMENT"
    assert isinstance(refused.value, ValueError)


@pytest.mark.parametrize("receipt", ["", "  ", "x" * 201, None, 7, "\udcff"])
def test_happened_follows_the_receipt_rules(receipt: Any) -> None:
    with pytest.raises(InvalidArgument) as refused:
        Happened(receipt)
    assert refused.value.code == "INVALID_RECEIPT"


@pytest.mark.parametrize(
    "options",
    [
        {"result": b"{}"},
        {"result": 5},
        {"result": "x" * (64 * 1024 + 1)},
        {"result": "\udcff"},
        {"note": ""},
        {"note": 3},
    ],
)
def test_happened_follows_the_result_and_note_rules(options: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument) as refused:
        Happened("ch_1", **options)
    assert refused.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("reason", ["", " ", None, 1])
def test_unknown_needs_a_reason(reason: Any) -> None:
    with pytest.raises(InvalidArgument):
        Unknown(reason)


def test_verdicts_are_frozen_values() -> None:
    happened = Happened("ch_1", result='{"ok": true}', note="seen on the dashboard")
    assert happened == Happened("ch_1", '{"ok": true}', "seen on the dashboard")
    assert Happened("ch_1").result is None and Happened("ch_1").note is None
    assert DidNotHappen("no charge for the key") == DidNotHappen("no charge for the key")
    assert Unknown("provider down").reason == "provider down"
    for verdict, name in (
        (happened, "receipt"),
        (DidNotHappen("none"), "evidence"),
        (Unknown("later"), "reason"),
    ):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(verdict, name, "changed")
    long_evidence = DidNotHappen("e" * 5000)  # any length: the note carries what fits
    assert len(long_evidence.evidence) == 5000


def test_a_resolution_note_names_the_reconciliation_and_fits() -> None:
    assert resolution_note(Happened("ch_1", note="seen"), "app.check") == (
        "reconciled by app.check: the provider reports it happened: seen"
    )
    assert resolution_note(Happened("ch_1"), "app.check") == (
        "reconciled by app.check: the provider reports it happened"
    )
    assert resolution_note(DidNotHappen("no charge"), "app.check") == (
        "reconciled by app.check: the provider reports it did not happen: no charge"
    )
    long = resolution_note(DidNotHappen("why " * 400), "app.check")
    assert len(long) == MAX_NOTE
    assert long.endswith("\u2026")
    assert long.startswith("reconciled by app.check: the provider reports it did not happen: why")


# ------------------------------------------------------------- resolve stores a result too


async def test_resolve_with_a_receipt_may_store_a_result(journal: Journal) -> None:
    identity = ident("with-result")
    await make_review(journal, ["with-result"])
    view = await journal.resolve(
        identity, receipt="ch_9", result='{"paid": true}', note="seen at the provider"
    )
    assert (view.status, view.receipt, view.result) == ("succeeded", "ch_9", '{"paid": true}')
    again = await journal.begin(identity, INPUTS, DEFINITION)
    assert again == Reuse("ch_9", identity, 1, result='{"paid": true}')
    assert (await journal.inspect(identity)).result == '{"paid": true}'


async def test_resolve_refuses_a_result_without_a_receipt_or_a_bad_one(journal: Journal) -> None:
    identity = ident("bad-result")
    await make_review(journal, ["bad-result"])
    before = await journal.inspect(identity)
    with pytest.raises(InvalidArgument) as refused:
        await journal.resolve(identity, retry=True, result="{}", note="no charge")
    assert refused.value.code == "INVALID_ARGUMENT"
    for bad in (b"{}", "x" * (64 * 1024 + 1)):
        with pytest.raises(InvalidArgument):
            await journal.resolve(identity, receipt="ch_1", result=bad, note="n")  # type: ignore[arg-type]
    assert await journal.inspect(identity) == before
    plain = await journal.resolve(identity, receipt="ch_1", note="seen")
    assert plain.result is None


# ----------------------------------------------------------------------- the main story


class Provider:
    """A check over a provider's ledger, with every kind of answer, counting checks in
    flight. ``meanwhile`` runs inside the check for the names it holds: another party
    changing the record while the check looks."""

    def __init__(self, journal: Journal, pause: float = 0.0) -> None:
        self.journal = journal
        self.pause = pause
        self.seen: list[RecordView] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.meanwhile: dict[str, Callable[[RecordView], Awaitable[None]]] = {}

    @staticmethod
    def verdict_of(n: int) -> str:
        return ("happened", "did_not_happen", "unknown", "raises", "nonsense")[n % 5]

    async def __call__(self, view: RecordView) -> Any:
        self.seen.append(view)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.pause:
                await anyio.sleep(self.pause)
            else:
                await anyio.lowlevel.checkpoint()
            change = self.meanwhile.get(view.identity.item)
            if change is not None:
                await change(view)
            n = number(view)
            kind = self.verdict_of(n)
            if kind == "happened":
                result = f'{{"charge": "ch_{n}"}}' if n % 2 else None
                return Happened(f"ch_{n}", result=result, note=f"ledger line {n}")
            if kind == "did_not_happen":
                return DidNotHappen(f"no charge for key {view.key[:12]}")
            if kind == "unknown":
                return Unknown("the provider is still settling")
            if kind == "raises":
                raise RuntimeError(f"provider down for {n}")
            return "yes, it happened"
        finally:
            self.in_flight -= 1


async def test_mixed_verdicts_over_hundreds_of_records(journal: Journal) -> None:
    names = [f"order-{n}" for n in range(300)]
    await make_review(journal, names)
    # Records in other statuses are never checked.
    others = {
        "done": ident("done-0"),
        "running": ident("running-0"),
        "released": ident("released-0"),
    }
    for identity in others.values():
        claim = await journal.begin(identity, INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        if identity.item == "done-0":
            await journal.complete(claim, "ch_done")
        elif identity.item == "released-0":
            await journal.mark_review(identity, "timeout")
            await journal.resolve(identity, retry=True, note="operator: no charge")
    before = await snapshot(journal)

    provider = Provider(journal)

    async def resolved_by_an_operator(view: RecordView) -> None:
        await journal.resolve(view.identity, retry=True, note="operator decided first")

    async def retried_and_stuck_again(view: RecordView) -> None:
        # Another decision and a new attempt, stuck again: still needs_review, but not the
        # record the check looked at.
        await journal.resolve(view.identity, retry=True, note="operator retried")
        claim = await journal.begin(view.identity, INPUTS, DEFINITION)
        assert isinstance(claim, Claim)
        await journal.mark_review(view.identity, "timed out again")

    meddled: dict[str, Callable[[RecordView], Awaitable[None]]] = {
        "order-5": resolved_by_an_operator,
        "order-10": retried_and_stuck_again,
    }
    meddled.update({"order-16": resolved_by_an_operator, "order-21": retried_and_stuck_again})
    provider.meanwhile = meddled

    report = await journal.reconcile(provider, limit=8)

    assert isinstance(report, ReconcileReport)
    assert not report.dry_run
    assert sorted(view.identity.item for view in provider.seen) == sorted(names)
    after = await snapshot(journal)
    for identity in others.values():
        assert after[identity] == before[identity]

    expected = {kind: 0 for kind in ("happened", "did_not_happen", "unknown", "failed")}
    for name in names:
        identity = ident(name)
        now, then = after[identity], before[identity]
        n = number(now)
        kind = Provider.verdict_of(n)
        if name in meddled:
            assert reconciled_events(now) == []
            if meddled[name] is resolved_by_an_operator:
                assert now.status == "released"
                assert now.history[-1].note == "operator decided first"
            else:
                assert (now.status, now.attempt) == ("needs_review", 2)
                assert now.review_reason == "timed out again"
            continue
        expected["failed" if kind in ("raises", "nonsense") else kind] += 1
        if kind == "happened":
            assert now.status == "succeeded"
            assert now.receipt == f"ch_{n}"
            assert now.result == (f'{{"charge": "ch_{n}"}}' if n % 2 else None)
            assert now.history[:-1] == then.history
            assert now.history[-1].event == "resolve"
            (note,) = reconciled_events(now)
            assert note.endswith(f": the provider reports it happened: ledger line {n}")
            assert "Provider" in note  # the check that decided is named
        elif kind == "did_not_happen":
            assert now.status == "released"
            assert now.receipt is None
            (note,) = reconciled_events(now)
            assert note.endswith(f"it did not happen: no charge for key {now.key[:12]}")
        else:
            assert now == then, name  # left exactly as it was

    counts = report.counts()
    assert counts == {
        "happened": expected["happened"],
        "did_not_happen": expected["did_not_happen"],
        "unknown": expected["unknown"],
        "left": len(meddled),
        "failed": expected["failed"],
        "problems": 0,
    }
    assert report.checked == len(names)
    assert not report.ok
    assert {view.identity.item for view in report.left} == set(meddled)
    for view in report.left:  # shown as they are now
        assert view == after[view.identity]
    assert all(view.status == "succeeded" for view in report.happened)
    assert all(view.status == "released" for view in report.did_not_happen)
    assert all(view == before[view.identity] for view in report.unknown)
    texts = {view.identity.item: text for view, text in report.failed}
    assert texts["order-3"] == "RuntimeError: provider down for 3"
    assert texts["order-4"] == ("the check returned str, not Happened, DidNotHappen or Unknown")
    keys = [view.key for view in report.happened]
    assert keys == sorted(keys)  # each outcome in key order
    assert report.verdicts[identity_digest(ident("order-0"))] == Happened(
        "ch_0", note="ledger line 0"
    )
    assert isinstance(report.verdicts[identity_digest(ident("order-2"))], Unknown)
    assert identity_digest(ident("order-3")) not in report.verdicts

    # A second run checks only what is still in review: the records it left as they were,
    # and the new attempts, which it now settles (no one meddles any more).
    second = Provider(journal)
    again = await journal.reconcile(second)
    still = {view.identity for view in second.seen}
    assert still == {i for i, view in after.items() if view.status == "needs_review"}
    assert [view.identity.item for view in again.happened] == ["order-10"]
    assert [view.identity.item for view in again.did_not_happen] == ["order-21"]
    last = await snapshot(journal)
    assert {i for i in last if last[i] != after[i]} == {ident("order-10"), ident("order-21")}


@pytest.mark.async_only  # its faults are injected through the async journal or store
async def test_a_record_changed_between_the_check_and_the_write_is_left(
    make_journal: Callable[..., Awaitable[Journal]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resolution acts only on the record the check saw, checked in the same atomic
    step: a new attempt that is needs_review again is not resolved by the old verdict."""
    journal = await make_journal()
    other = await make_journal()
    identity = ident("order-1")
    await make_review(journal, ["order-1"])
    store = journal.store
    original = store.apply
    entered: list[bool] = []
    interfered: list[RecordView] = []

    async def new_attempt_first(ident_: Identity, step: Any) -> Any:
        if not entered:  # just before the reconciliation's own write; the rest go through
            entered.append(True)
            await other.resolve(identity, retry=True, note="operator retried")
            claim = await other.begin(identity, INPUTS, DEFINITION)
            assert isinstance(claim, Claim)
            interfered.append(await other.mark_review(identity, "timed out again"))
        return await original(ident_, step)

    async def happened(view: RecordView) -> Happened:
        monkeypatch.setattr(store, "apply", new_attempt_first)
        return Happened("ch_old", note="the first attempt's charge")

    report = await journal.reconcile(happened)
    monkeypatch.undo()
    now = await journal.inspect(identity)
    assert (now.status, now.attempt, now.receipt) == ("needs_review", 2, None)
    assert now == interfered[0]
    assert report.left == (now,)
    assert report.happened == ()
    assert reconciled_events(now) == []


async def test_the_same_record_unchanged_is_resolved_by_the_guarded_step(
    journal: Journal,
) -> None:
    identity = ident("order-7")
    await make_review(journal, ["order-7"])
    view = await journal.inspect(identity)
    stale = dataclasses.replace(view, updated_at="2020-01-01T00:00:00.000000+00:00")
    with pytest.raises(ConflictError) as changed:
        await journal._resolve(identity, None, "reconciled by x: gone", None, expect=stale)
    assert changed.value.code == "NOT_IN_REVIEW"
    assert changed.value.view == view
    assert await journal.inspect(identity) == view
    done = await journal._resolve(identity, None, "reconciled by x: gone", None, expect=view)
    assert done.status == "released"


class GatheringProvider(Provider):
    """Holds the first checks until ``limit`` of them are in flight: how many run at once
    then depends on the reconciliation alone, not on how fast this machine reads records
    (under load, 5 ms checks could end before the twelfth began)."""

    def __init__(self, journal: Journal, limit: int) -> None:
        super().__init__(journal)
        self.limit = limit
        self.gathered = anyio.Event()

    async def __call__(self, view: RecordView) -> Any:
        if self.in_flight + 1 >= self.limit:
            self.gathered.set()
        self.in_flight += 1
        try:
            await self.gathered.wait()
        finally:
            self.in_flight -= 1
        return await super().__call__(view)


@pytest.mark.async_only  # its checks meet on one event loop; the blocking face's in test_sync_face
async def test_limit_bounds_the_checks_in_flight(journal: Journal) -> None:
    await make_review(journal, [f"order-{n}" for n in range(40)])
    for limit in (1, 3, 12):
        provider = GatheringProvider(journal, limit)
        with anyio.fail_after(30):  # fewer than ``limit`` at once would never gather
            report = await journal.reconcile(provider, limit=limit, dry_run=True)
        assert report.checked == 40
        assert provider.most_in_flight == limit, (limit, provider.most_in_flight)


async def test_a_plain_function_check_runs_in_a_worker_thread(journal: Journal) -> None:
    await make_review(journal, ["order-0", "order-1"])
    loop_thread = threading.get_ident()
    threads: list[bool] = []

    def check(view: RecordView) -> Happened | DidNotHappen:
        threads.append(threading.get_ident() != loop_thread)
        if number(view) == 0:
            return Happened("ch_0")
        return DidNotHappen("no charge")

    report = await journal.reconcile(check)
    assert threads == [True, True]
    assert [view.receipt for view in report.happened] == ["ch_0"]
    assert [view.status for view in report.did_not_happen] == ["released"]
    (note,) = reconciled_events(report.happened[0])
    assert "check" in note


async def test_filters_narrow_the_records_checked(journal: Journal) -> None:
    await make_review(journal, ["order-1", "order-2"], scope="shop")
    await make_review(journal, ["order-3"], scope="outlet")
    provider = Provider(journal)
    report = await journal.reconcile(provider, scope="outlet", program="billing", job="charge")
    assert [view.identity for view in provider.seen] == [ident("order-3", "outlet")]
    assert report.unknown == () and report.did_not_happen == ()
    assert report.failed[0][0].identity == ident("order-3", "outlet")
    none = await journal.reconcile(Provider(journal), job="refund")
    assert none.checked == 0 and none.ok


async def test_dry_run_checks_everything_and_writes_nothing(journal: Journal) -> None:
    await make_review(journal, [f"order-{n}" for n in range(25)])
    before = await snapshot(journal)
    provider = Provider(journal)
    report = await journal.reconcile(provider, dry_run=True, limit=4)
    assert report.dry_run
    assert len(provider.seen) == 25
    assert await snapshot(journal) == before
    assert report.counts() == {
        "happened": 5,
        "did_not_happen": 5,
        "unknown": 5,
        "left": 0,
        "failed": 10,
        "problems": 0,
    }
    # It reports what it would do: the records as the check saw them, and each verdict.
    for view in (*report.happened, *report.did_not_happen):
        assert view == before[view.identity]
        assert view.status == "needs_review"
    assert {type(report.verdicts[view.key]) for view in report.happened} == {Happened}
    assert {type(report.verdicts[view.key]) for view in report.did_not_happen} == {DidNotHappen}
    # Then for real: the same verdicts settle the same records.
    real = await journal.reconcile(Provider(journal))
    assert [v.identity for v in real.happened] == [v.identity for v in report.happened]
    assert [v.identity for v in real.did_not_happen] == [v.identity for v in report.did_not_happen]


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"status": "started"}, "sweep"),
        ({"status": "succeeded"}, "only needs_review"),
        ({"status": None}, "only needs_review"),
        ({"limit": 0}, "limit"),
        ({"limit": -3}, "limit"),
        ({"limit": True}, "limit"),
        ({"limit": "4"}, "limit"),
        ({"limit": 2.0}, "limit"),
        ({"dry_run": "yes"}, "dry_run"),
        ({"scope": "bad label"}, "scope"),
        ({"job": ""}, "job"),
    ],
)
async def test_bad_arguments_are_refused_before_any_check(
    journal: Journal, options: dict[str, Any], words: str
) -> None:
    await make_review(journal, ["order-0"])
    provider = Provider(journal)
    with pytest.raises(InvalidArgument) as refused:
        await journal.reconcile(provider, **options)
    assert words in refused.value.message
    assert provider.seen == []


async def test_started_records_are_never_reconciled(journal: Journal) -> None:
    identity = ident("running")
    claim = await journal.begin(identity, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    provider = Provider(journal)
    with pytest.raises(InvalidArgument) as refused:
        await journal.reconcile(provider, status="started")
    assert refused.value.code == "INVALID_ARGUMENT"
    assert "started records are not reconciled" in refused.value.message
    report = await journal.reconcile(provider)  # the default: needs_review only
    assert report.checked == 0
    assert provider.seen == []
    assert (await journal.inspect(identity)).status == "started"


async def test_a_check_must_be_callable_and_a_journal_a_journal(journal: Journal) -> None:
    from itemjournal._journal.reconcile import reconcile

    with pytest.raises(InvalidArgument) as refused:
        await journal.reconcile("module:function")  # type: ignore[arg-type]
    assert refused.value.code == "INVALID_ARGUMENT"
    with pytest.raises(InvalidArgument):
        await reconcile(object(), Provider(journal))  # type: ignore[arg-type]


async def test_a_check_that_builds_a_bad_verdict_fails_alone(journal: Journal) -> None:
    await make_review(journal, ["order-0", "order-1"])
    before = await snapshot(journal)

    async def check(view: RecordView) -> DidNotHappen:
        if number(view) == 0:
            return DidNotHappen("")  # refused when built: the check raises
        return DidNotHappen("no charge")

    report = await journal.reconcile(check)
    ((view, text),) = report.failed
    assert view == before[ident("order-0")]
    assert text.startswith("InvalidArgument: INVALID_ARGUMENT: ")
    assert await journal.inspect(ident("order-0")) == before[ident("order-0")]
    assert [v.identity for v in report.did_not_happen] == [ident("order-1")]


async def test_long_notes_are_cut_to_fit(journal: Journal) -> None:
    await make_review(journal, ["order-0", "order-1"])

    async def check(view: RecordView) -> Happened | DidNotHappen:
        if number(view) == 0:
            return Happened("ch_0", note="n" * 3000)
        return DidNotHappen("e" * 3000)

    report = await journal.reconcile(check)
    for view in (*report.happened, *report.did_not_happen):
        note = view.history[-1].note
        assert note is not None
        assert len(note) == MAX_NOTE
        assert note.endswith("\u2026")


class _Mute(Exception):
    def __str__(self) -> str:
        raise ValueError("this message cannot be shown")


async def test_failures_name_the_exception_whatever_its_message(journal: Journal) -> None:
    await make_review(journal, ["order-0", "order-1", "order-2"])

    async def check(view: RecordView) -> Unknown:
        if number(view) == 0:
            raise _Mute
        if number(view) == 1:
            raise KeyError
        raise ValueError("x" * 5000)

    report = await journal.reconcile(check)
    texts = {view.identity.item: text for view, text in report.failed}
    assert texts["order-0"] == "_Mute: (its message cannot be shown)"
    assert texts["order-1"] == "KeyError"
    assert len(texts["order-2"]) == 1000
    assert texts["order-2"].startswith("ValueError: xxx")


@pytest.mark.async_only  # its faults are injected through the async journal or store
async def test_a_resolution_that_cannot_be_written_fails_alone(
    journal: Journal, monkeypatch: pytest.MonkeyPatch
) -> None:
    await make_review(journal, ["order-1", "order-6"])
    before = await snapshot(journal)
    store = journal.store
    original = store.apply

    async def disk_full_for_one(ident_: Identity, step: Any) -> Any:
        if ident_ == ident("order-1"):
            raise StorageFailed("no space left on the device")
        return await original(ident_, step)

    monkeypatch.setattr(store, "apply", disk_full_for_one)
    report = await journal.reconcile(lambda view: DidNotHappen("no charge"))
    monkeypatch.undo()
    ((view, text),) = report.failed
    assert view == before[ident("order-1")]
    assert text == "the resolution was not written: STORAGE_FAILED: no space left on the device"
    assert await journal.inspect(ident("order-1")) == before[ident("order-1")]
    assert [v.identity for v in report.did_not_happen] == [ident("order-6")]


async def test_progress_is_told_of_each_record_settled(journal: Journal) -> None:
    from itemjournal._journal.reconcile import reconcile

    await make_review(journal, [f"order-{n}" for n in range(7)])
    told: list[Identity] = []
    report = await reconcile(
        journal, Provider(journal), dry_run=True, progress=lambda view: told.append(view.identity)
    )
    assert sorted(told) == sorted(ident(f"order-{n}") for n in range(7))
    assert report.checked == 7
    with pytest.raises(InvalidArgument):
        await reconcile(journal, Provider(journal), progress=5)  # type: ignore[arg-type]


def _spoil(location: str, identity: Identity) -> None:
    digest = identity_digest(identity)
    if location.startswith("sqlite://"):
        with contextlib.closing(sqlite3.connect(location[len("sqlite://") :])) as connection:
            connection.execute(
                "UPDATE itemjournal_records SET document = ? WHERE digest = ?",
                (b"{broken", digest),
            )
            connection.commit()
    else:
        Path(location, digest[:2], f"{digest}.json").write_bytes(b"{broken")


async def test_an_unreadable_record_is_a_problem_and_the_rest_goes_on(
    store_kind: str, location: str, journal: Journal
) -> None:
    if store_kind not in ("file", "sqlite"):
        pytest.skip("spoils a record through the file or the SQLite database")
    await make_review(journal, ["order-1", "order-6", "order-11"])
    await anyio.to_thread.run_sync(_spoil, location, ident("order-6"))
    report = await journal.reconcile(Provider(journal))
    assert [type(problem) for problem in report.problems] == [RecordInvalid]
    assert {view.identity.item for view in report.did_not_happen} == {"order-1", "order-11"}
    assert not report.ok


# ---------------------------------------------------------------------------- cancellation


def _ledger_check(
    pauses: dict[str, float], stop_at: str | None, run: anyio.CancelScope
) -> Callable[[RecordView], Awaitable[Happened | DidNotHappen]]:
    """Odd orders happened, even ones did not; each check takes its pause, and the check of
    ``stop_at`` cancels the whole run."""

    async def check(view: RecordView) -> Happened | DidNotHappen:
        await anyio.sleep(pauses[view.identity.item])
        if view.identity.item == stop_at:
            run.cancel()
            await anyio.lowlevel.checkpoint()
        if number(view) % 2:
            return Happened(f"ch_{number(view)}", note="in the ledger")
        return DidNotHappen("not in the ledger")

    return check


@pytest.mark.async_only
async def test_cancellation_at_random_points_leaves_no_record_half_way(
    journal: Journal,
) -> None:
    """Each round cancels a reconciliation at a random moment (a deadline, or a check
    cancelling the run itself); every record is then exactly as before or resolved as its
    verdict says."""
    outcomes = {"untouched": 0, "resolved": 0}
    for seed in range(12):
        rng = random.Random(seed)
        names = [f"order-{n}" for n in range(30)]
        scope = f"round{seed}"
        await make_review(journal, names, scope=scope)
        before = {
            identity: view
            for identity, view in (await snapshot(journal)).items()
            if identity.scope == scope
        }
        pauses = {name: rng.uniform(0, 0.004) for name in names}
        stop_at = rng.choice(names) if seed % 2 else None
        deadline = rng.uniform(0.001, 0.03)

        with anyio.CancelScope() as scope_of_run:
            if stop_at is None:
                scope_of_run.deadline = anyio.current_time() + deadline
            check = _ledger_check(pauses, stop_at, scope_of_run)
            await journal.reconcile(check, scope=scope, limit=rng.randint(1, 8))

        for identity, then in before.items():
            now = await journal.inspect(identity)
            if now == then:
                outcomes["untouched"] += 1
                continue
            outcomes["resolved"] += 1
            n = number(now)
            assert now.history[:-1] == then.history, identity
            (note,) = reconciled_events(now)
            if n % 2:
                assert (now.status, now.receipt) == ("succeeded", f"ch_{n}")
                assert note.endswith("it happened: in the ledger")
            else:
                assert (now.status, now.receipt) == ("released", None)
                assert note.endswith("it did not happen: not in the ledger")
    # The rounds did cut runs short: both outcomes were seen.
    assert outcomes["untouched"] > 0 and outcomes["resolved"] > 0, outcomes
