"""Withdrawing a claim whose effect never started: ``raise Withdraw(reason)``,
``async with attempt.preparing():``, ``attempt.withdraw`` and ``journal.withdraw``.

A withdrawn record is ``released`` under the event ``withdrawn`` and the next ``begin``
grants a fresh claim; everything outside ``preparing()`` (or without a ``Withdraw``) is
effect, and its failure needs review exactly as before.
"""

from __future__ import annotations

import asyncio
import logging

import anyio
import pytest

import itemjournal
from itemjournal import (
    Claim,
    ConflictError,
    Identity,
    InvalidArgument,
    Journal,
    JournalStatistics,
    RecordView,
    Withdraw,
    definition_digest,
)
from itemjournal._model.records import MAX_NOTE_CHARS

pytestmark = pytest.mark.anyio
# The contract holds on both faces of the journal (tests/_faces.py).
FACES = ("async", "sync")

INPUTS = {"order": "A-1001", "amount": "12.50"}
DEFINITION = definition_digest("billing-v1")


def ident(item: str) -> Identity:
    return Identity("shop", "billing", "withdraw", item)


def events(view: RecordView) -> list[str]:
    return [event.event for event in view.history]


async def assert_withdrawn(journal: Journal, identity: Identity, reason: str) -> RecordView:
    """The record is released by a withdrawal with ``reason``, and claimable afresh."""
    view = await journal.inspect(identity)
    assert view.status == "released"
    assert events(view) == ["begin", "withdrawn"]
    assert view.history[-1].note == reason
    assert view.history[-1].status == "released"
    assert view.review_reason is None
    assert view.receipt is None
    again = await journal.begin(identity, INPUTS, DEFINITION)
    assert isinstance(again, Claim)
    assert again.attempt == view.attempt + 1
    return view


# ---------------------------------------------------------------------------- Withdraw


def test_withdraw_is_public_and_carries_its_reason() -> None:
    assert "Withdraw" in itemjournal.__all__
    error = Withdraw("the order failed validation")
    assert isinstance(error, Exception)
    assert error.reason == "the order failed validation"
    assert str(error) == "the order failed validation"
    for bad in ("", "   ", None, 42):
        with pytest.raises(InvalidArgument) as caught:
            Withdraw(bad)  # type: ignore[arg-type]
        assert caught.value.code == "INVALID_ARGUMENT"


async def test_withdraw_raised_in_a_block_releases_the_claim(journal: Journal) -> None:
    identity = ident("raised")
    with pytest.raises(Withdraw, match="amount is negative") as caught:
        async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
            raise Withdraw("amount is negative")
    assert attempt.settled
    assert attempt.view is not None and attempt.view.status == "released"
    assert any("withdrew" in note for note in getattr(caught.value, "__notes__", []))
    await assert_withdrawn(journal, identity, "amount is negative")


async def test_a_subclass_of_withdraw_withdraws_too(journal: Journal) -> None:
    class OrderInvalid(Withdraw):
        pass

    identity = ident("subclass")
    with pytest.raises(OrderInvalid):
        async with journal.claim(identity, INPUTS, DEFINITION):
            raise OrderInvalid("no such product")
    await assert_withdrawn(journal, identity, "no such product")


async def test_a_long_withdrawal_reason_is_cut_to_fit(journal: Journal) -> None:
    identity = ident("long")
    with pytest.raises(Withdraw):
        async with journal.claim(identity, INPUTS, DEFINITION):
            raise Withdraw("x" * 2000)
    view = await journal.inspect(identity)
    note = view.history[-1].note
    assert note is not None and len(note) == MAX_NOTE_CHARS
    assert note.endswith("\u2026")


async def test_withdraw_after_complete_changes_nothing(journal: Journal) -> None:
    identity = ident("after-complete")
    with pytest.raises(Withdraw):
        async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
            await attempt.complete("ch_1")
            raise Withdraw("too late for that")
    view = await journal.inspect(identity)
    assert view.status == "succeeded"
    assert events(view) == ["begin", "complete"]


# ---------------------------------------------------------------------------- preparing()


async def test_an_exception_inside_preparing_withdraws(journal: Journal) -> None:
    identity = ident("prep-raises")
    with pytest.raises(ValueError, match="amount is not a number") as caught:
        async with journal.claim(identity, INPUTS, DEFINITION) as attempt, attempt.preparing():
            raise ValueError("amount is not a number")
    assert any("withdrew" in note for note in getattr(caught.value, "__notes__", []))
    await assert_withdrawn(journal, identity, "preparing raised ValueError: amount is not a number")


async def test_withdraw_inside_preparing_keeps_its_reason(journal: Journal) -> None:
    identity = ident("prep-withdraw")
    with pytest.raises(Withdraw):
        async with journal.claim(identity, INPUTS, DEFINITION) as attempt, attempt.preparing():
            raise Withdraw("customer is blocked")
    await assert_withdrawn(journal, identity, "customer is blocked")


@pytest.mark.async_only
async def test_a_cancellation_inside_preparing_withdraws_and_goes_on(journal: Journal) -> None:
    identity = ident("prep-cancelled")
    inside = anyio.Event()
    after_block = False
    with anyio.CancelScope() as scope:

        async def cancel_when_inside() -> None:
            await inside.wait()
            scope.cancel()

        async with anyio.create_task_group() as group:
            group.start_soon(cancel_when_inside)
            async with journal.claim(identity, INPUTS, DEFINITION) as attempt, attempt.preparing():
                inside.set()
                await anyio.sleep_forever()
            after_block = True
    assert scope.cancelled_caught
    assert not after_block
    await assert_withdrawn(journal, identity, "cancelled while preparing")


@pytest.mark.async_only
async def test_fail_after_inside_preparing_withdraws(journal: Journal) -> None:
    identity = ident("prep-timeout")
    with pytest.raises(TimeoutError):
        with anyio.fail_after(30) as deadline:
            async with journal.claim(identity, INPUTS, DEFINITION) as attempt, attempt.preparing():
                # The deadline is set once the claim is held, so a slow begin cannot meet it.
                deadline.deadline = anyio.current_time() + 0.05
                await anyio.sleep_forever()
    await assert_withdrawn(journal, identity, "cancelled while preparing")


async def test_an_exception_after_preparing_needs_review(journal: Journal) -> None:
    identity = ident("after-prep-raises")
    with pytest.raises(RuntimeError, match="provider timed out"):
        async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
            async with attempt.preparing():
                amount = int(INPUTS["amount"].replace(".", ""))
            assert amount == 1250
            raise RuntimeError("provider timed out")
    view = await journal.inspect(identity)
    assert view.status == "needs_review"
    assert events(view) == ["begin", "mark_review"]
    assert view.review_reason == "block raised RuntimeError: provider timed out"


@pytest.mark.async_only
async def test_a_cancellation_after_preparing_needs_review(journal: Journal) -> None:
    identity = ident("after-prep-cancelled")
    with pytest.raises(TimeoutError):
        with anyio.fail_after(30) as deadline:
            async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
                async with attempt.preparing():
                    pass
                deadline.deadline = anyio.current_time() + 0.05
                await anyio.sleep_forever()  # the charge, in flight
    view = await journal.inspect(identity)
    assert view.status == "needs_review"
    assert events(view) == ["begin", "mark_review"]


async def test_a_block_without_preparing_behaves_as_before(journal: Journal) -> None:
    identity = ident("no-prep")
    with pytest.raises(ValueError):
        async with journal.claim(identity, INPUTS, DEFINITION):
            raise ValueError("bad amount")
    view = await journal.inspect(identity)
    assert view.status == "needs_review"
    assert view.review_reason == "block raised ValueError: bad amount"


async def test_preparing_then_complete_succeeds(journal: Journal) -> None:
    identity = ident("prep-ok")
    async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
        async with attempt.preparing():
            assert (await journal.inspect(identity)).status == "started"
        await attempt.complete("ch_1")
    view = await journal.inspect(identity)
    assert view.status == "succeeded"
    assert events(view) == ["begin", "complete"]


async def test_an_exception_from_preparing_caught_in_the_block_leaves_it_withdrawn(
    journal: Journal,
) -> None:
    identity = ident("prep-caught")
    async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
        try:
            async with attempt.preparing():
                raise LookupError("no such customer")
        except LookupError:
            pass
        assert attempt.settled
    # The block ended normally and its claim was withdrawn: no UnresolvedClaim.
    await assert_withdrawn(journal, identity, "preparing raised LookupError: no such customer")


# ---------------------------------------------------------------------------- misuse


async def test_preparing_after_complete_or_mark_review_is_refused(journal: Journal) -> None:
    for settle in ("complete", "mark_review"):
        identity = ident(f"late-prep-{settle}")
        async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
            if settle == "complete":
                await attempt.complete("ch_1")
            else:
                await attempt.mark_review("timeout")
            before = await journal.inspect(identity)
            with pytest.raises(InvalidArgument) as caught:
                async with attempt.preparing():
                    pass
            assert caught.value.code == "INVALID_ARGUMENT"
            assert "settled" in caught.value.message
        assert await journal.inspect(identity) == before


async def test_nested_or_repeated_preparing_is_refused(journal: Journal) -> None:
    identity = ident("nested")
    with pytest.raises(InvalidArgument) as nested:
        async with (
            journal.claim(identity, INPUTS, DEFINITION) as attempt,
            attempt.preparing(),
            attempt.preparing(),
        ):
            pass
    assert nested.value.code == "INVALID_ARGUMENT"
    assert "nested" in nested.value.message
    # Raised inside the outer preparing(): nothing was sent, the claim is withdrawn.
    assert (await journal.inspect(identity)).status == "released"

    identity = ident("repeated")
    async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
        async with attempt.preparing():
            pass
        with pytest.raises(InvalidArgument) as repeated:
            async with attempt.preparing():
                pass
        assert repeated.value.code == "INVALID_ARGUMENT"
        assert "once" in repeated.value.message
        await attempt.complete("ch_1")
    assert (await journal.inspect(identity)).status == "succeeded"


async def test_preparing_on_a_reused_attempt_is_refused(journal: Journal) -> None:
    identity = ident("reused")
    async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
        await attempt.complete("ch_1")
    before = await journal.inspect(identity)
    async with journal.claim(identity, INPUTS, DEFINITION) as again:
        assert again.reused
        with pytest.raises(InvalidArgument) as preparing:
            async with again.preparing():
                pass
        assert preparing.value.code == "INVALID_CLAIM"
        with pytest.raises(InvalidArgument) as withdrawing:
            await again.withdraw("nothing to withdraw")
        assert withdrawing.value.code == "INVALID_CLAIM"
    assert await journal.inspect(identity) == before


# ---------------------------------------------------------------------------- explicit calls


async def test_attempt_withdraw_releases_and_the_block_ends_quietly(journal: Journal) -> None:
    identity = ident("explicit")
    async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
        view = await attempt.withdraw("the cart was emptied")
        assert view.status == "released"
        assert attempt.settled and attempt.view == view
    await assert_withdrawn(journal, identity, "the cart was emptied")


async def test_journal_withdraw_is_keyed_by_the_claim(journal: Journal) -> None:
    identity = ident("journal-call")
    claim = await journal.begin(identity, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    for bad in ("", "x" * (MAX_NOTE_CHARS + 1)):
        with pytest.raises(InvalidArgument) as caught:
            await journal.withdraw(claim, bad)
        assert caught.value.code == "INVALID_ARGUMENT"
    with pytest.raises(InvalidArgument) as not_a_claim:
        await journal.withdraw("not a claim", "why")  # type: ignore[arg-type]
    assert not_a_claim.value.code == "INVALID_CLAIM"
    view = await journal.withdraw(claim, "nothing was sent")
    assert view.status == "released"
    with pytest.raises(ConflictError) as twice:
        await journal.withdraw(claim, "nothing was sent")
    assert twice.value.code == "NOT_STARTED"
    await assert_withdrawn(journal, identity, "nothing was sent")
    with pytest.raises(ConflictError) as stale:  # the fresh claim is someone else's now
        await journal.withdraw(claim, "nothing was sent")
    assert stale.value.code == "CLAIM_MISMATCH"
    assert (await journal.inspect(identity)).status == "started"


# ---------------------------------------------------------------------------- moved records


async def test_a_record_marked_for_review_meanwhile_is_left_as_it_is(journal: Journal) -> None:
    identity = ident("moved-review")
    with pytest.raises(ValueError) as caught:
        async with journal.claim(identity, INPUTS, DEFINITION) as attempt, attempt.preparing():
            await journal.mark_review(identity, "an operator looked first")
            raise ValueError("bad amount")
    view = await journal.inspect(identity)
    assert view.status == "needs_review"
    assert view.review_reason == "an operator looked first"
    assert events(view) == ["begin", "mark_review"]
    notes = getattr(caught.value, "__notes__", [])
    assert any("did not withdraw" in note and "NOT_STARTED" in note for note in notes)
    assert attempt.view == view

    identity = ident("moved-review-raised")
    with pytest.raises(Withdraw):
        async with journal.claim(identity, INPUTS, DEFINITION):
            await journal.mark_review(identity, "swept")
            raise Withdraw("nothing was sent")
    assert (await journal.inspect(identity)).review_reason == "swept"


async def test_a_record_claimed_again_meanwhile_is_left_as_it_is(journal: Journal) -> None:
    identity = ident("moved-claim")
    with pytest.raises(Withdraw) as caught:
        async with journal.claim(identity, INPUTS, DEFINITION) as attempt, attempt.preparing():
            await journal.mark_review(identity, "stuck")
            await journal.resolve(identity, retry=True, note="verified not charged")
            newer = await journal.begin(identity, INPUTS, DEFINITION)
            assert isinstance(newer, Claim)
            raise Withdraw("nothing was sent")
    view = await journal.inspect(identity)
    assert view.status == "started"
    assert view.attempt == 2
    assert events(view) == ["begin", "mark_review", "resolve", "begin"]
    notes = getattr(caught.value, "__notes__", [])
    assert any("did not withdraw" in note and "CLAIM_MISMATCH" in note for note in notes)
    await journal.complete(newer, "ch_2")  # the newer claim still owns its record


# ---------------------------------------------------------------------------- what it tells


async def test_a_withdrawal_is_counted_and_logged(
    journal: Journal, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="itemjournal")
    identity = ident("told")
    with pytest.raises(Withdraw):
        async with journal.claim(identity, INPUTS, DEFINITION):
            raise Withdraw("nothing was sent")
    assert journal.statistics() == JournalStatistics(claims=1, withdrawals=1)
    [record] = [r for r in caplog.records if getattr(r, "itemjournal_event", "") == "withdrawn"]
    assert record.levelno == logging.INFO
    assert record.itemjournal_operation == "withdraw"  # type: ignore[attr-defined]
    assert record.itemjournal_status == "released"  # type: ignore[attr-defined]
    assert record.itemjournal_note == "nothing was sent"  # type: ignore[attr-defined]
    assert "started -> released" in record.getMessage()


# ---------------------------------------------------------------------------- native cancel


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.async_only
async def test_a_native_cancel_inside_preparing_withdraws(journal: Journal) -> None:
    identity = ident("native-inside")
    inside = asyncio.Event()

    async def handler() -> None:
        async with journal.claim(identity, INPUTS, DEFINITION) as attempt, attempt.preparing():
            inside.set()
            await asyncio.sleep(3600)

    task = asyncio.ensure_future(handler())
    await asyncio.wait(
        [task, asyncio.ensure_future(inside.wait())], timeout=10, return_when="FIRST_COMPLETED"
    )
    assert inside.is_set() and not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await assert_withdrawn(journal, identity, "cancelled while preparing")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.async_only
async def test_a_native_cancel_after_preparing_needs_review(journal: Journal) -> None:
    identity = ident("native-after")
    charging = asyncio.Event()

    async def handler() -> None:
        async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
            async with attempt.preparing():
                pass
            charging.set()
            await asyncio.sleep(3600)

    task = asyncio.ensure_future(handler())
    await asyncio.wait(
        [task, asyncio.ensure_future(charging.wait())], timeout=10, return_when="FIRST_COMPLETED"
    )
    assert charging.is_set() and not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    view = await journal.inspect(identity)
    assert view.status == "needs_review"
    assert events(view) == ["begin", "mark_review"]
