"""``async with journal.claim(identity, inputs, definition) as attempt``: how each way
out of the block leaves the record."""

from __future__ import annotations

import anyio
import pytest

from itemjournal import (
    Attempt,
    Claim,
    ConflictError,
    Identity,
    InvalidArgument,
    Journal,
    UnresolvedClaim,
    definition_digest,
)

pytestmark = pytest.mark.anyio
# The contract holds on both faces of the journal (tests/_faces.py).
FACES = ("async", "sync")

INPUTS = {"order": "A-1001", "amount": "12.50"}
DEFINITION = definition_digest("billing-v1")
OTHER_DEFINITION = definition_digest("billing-v2")


def ident(item: str) -> Identity:
    return Identity("shop", "billing", "nightly", item)


async def test_happy_path_then_reuse(journal: Journal) -> None:
    identity = ident("happy")

    async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
        assert isinstance(attempt, Attempt)
        assert attempt.reused is False
        assert isinstance(attempt.claim, Claim)
        assert attempt.claim.identity == identity
        assert attempt.receipt is None
        assert (await journal.inspect(identity)).status == "started"
        view = await attempt.complete("r1")
        assert view.status == "succeeded"
        assert view.receipt == "r1"

    assert attempt.receipt == "r1"
    assert attempt.view is not None
    assert attempt.view.status == "succeeded"
    record = await journal.inspect(identity)
    assert record.status == "succeeded"
    assert record.receipt == "r1"
    assert record.review_reason is None

    body_ran = False
    async with journal.claim(list(identity), dict(INPUTS), DEFINITION) as again:
        body_ran = True
        assert again.reused is True
        with pytest.raises(InvalidArgument):
            again.claim  # noqa: B018
        assert again.receipt == "r1"
    assert body_ran
    after = await journal.inspect(identity)
    assert after.status == "succeeded"
    assert after.updated_at == record.updated_at  # a reuse writes nothing


async def test_body_raises_marks_review_and_propagates(journal: Journal) -> None:
    identity = ident("raises")

    with pytest.raises(ValueError, match="card declined by the test"):
        async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
            raise ValueError("card declined by the test")

    assert attempt.settled
    record = await journal.inspect(identity)
    assert record.status == "needs_review"
    assert record.review_reason is not None
    assert "ValueError" in record.review_reason
    assert record.receipt is None


@pytest.mark.async_only
async def test_body_cancelled_marks_review_and_the_cancellation_goes_on(
    journal: Journal,
) -> None:
    identity = ident("cancelled")
    in_body = anyio.Event()
    after_block_ran = False
    after_sleep_ran = False

    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()

        async def worker() -> None:
            nonlocal after_block_ran, after_sleep_ran
            with scope:
                async with journal.claim(identity, INPUTS, DEFINITION):
                    in_body.set()
                    await anyio.sleep_forever()
                    after_sleep_ran = True
                after_block_ran = True

        tg.start_soon(worker)
        await in_body.wait()
        scope.cancel()

    assert scope.cancelled_caught
    assert not after_sleep_ran
    assert not after_block_ran
    record = await journal.inspect(identity)
    assert record.status == "needs_review"
    assert record.review_reason is not None
    assert record.review_reason == "block cancelled"  # on asyncio and trio alike


async def test_body_ends_without_settling_raises_unresolved_claim(journal: Journal) -> None:
    identity = ident("unresolved")

    with pytest.raises(UnresolvedClaim) as caught:
        async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
            assert attempt.claim is not None

    error = caught.value
    assert error.code == "UNRESOLVED_CLAIM"
    assert error.view is not None
    assert error.view.status == "needs_review"
    assert error.view.identity == identity
    record = await journal.inspect(identity)
    assert record.status == "needs_review"
    assert record.review_reason
    assert attempt.view == error.view


async def test_body_marks_review_itself(journal: Journal) -> None:
    identity = ident("timeout")

    async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
        view = await attempt.mark_review("timeout")
        assert view.status == "needs_review"

    record = await journal.inspect(identity)
    assert record.status == "needs_review"
    assert record.review_reason == "timeout"
    assert [event.event for event in record.history] == ["begin", "mark_review"]


async def test_entry_errors_propagate_and_the_body_does_not_run(journal: Journal) -> None:
    in_review = ident("in-review")
    claim = await journal.begin(in_review, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    await journal.mark_review(in_review, "unknown outcome")
    succeeded = ident("succeeded")
    claim = await journal.begin(succeeded, INPUTS, DEFINITION)
    assert isinstance(claim, Claim)
    await journal.complete(claim, "r1")
    other_inputs = {**INPUTS, "amount": "99.00"}

    cases = [
        (in_review, INPUTS, DEFINITION, "REVIEW_REQUIRED", "needs_review"),
        (in_review, other_inputs, DEFINITION, "INPUT_CHANGED", "needs_review"),
        (succeeded, other_inputs, DEFINITION, "INPUT_CHANGED", "succeeded"),
        (succeeded, INPUTS, OTHER_DEFINITION, "DEFINITION_CHANGED", "succeeded"),
    ]
    for identity, inputs, definition, code, status in cases:
        before = await journal.inspect(identity)
        body_ran = False
        with pytest.raises(ConflictError) as caught:
            async with journal.claim(identity, inputs, definition):
                body_ran = True
        assert caught.value.code == code
        assert caught.value.view is not None
        assert caught.value.view.status == status
        assert not body_ran
        assert await journal.inspect(identity) == before  # nothing was written


async def test_a_reused_attempt_cannot_complete_or_mark_review(journal: Journal) -> None:
    identity = ident("reused")
    async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
        await attempt.complete("r1")
    before = await journal.inspect(identity)

    attempts: list[Attempt] = []

    async def complete_a_reused_attempt() -> None:
        async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
            attempts.append(attempt)
            assert attempt.reused
            await attempt.complete("r2")

    with pytest.raises(InvalidArgument) as inside:
        await complete_a_reused_attempt()
    assert inside.value.code == "INVALID_CLAIM"
    [reused] = attempts

    with pytest.raises(InvalidArgument) as after_block:
        await reused.complete("r2")
    assert after_block.value.code == "INVALID_CLAIM"
    with pytest.raises(InvalidArgument) as review:
        await reused.mark_review("oops")
    assert review.value.code == "INVALID_CLAIM"

    assert reused.receipt == "r1"
    assert await journal.inspect(identity) == before


async def test_body_raises_after_complete_keeps_the_success(journal: Journal) -> None:
    identity = ident("late-error")

    async def complete_then_fail() -> None:
        async with journal.claim(identity, INPUTS, DEFINITION) as attempt:
            await attempt.complete("r1")
            raise RuntimeError("after the charge")

    with pytest.raises(RuntimeError, match="after the charge"):
        await complete_then_fail()

    record = await journal.inspect(identity)
    assert record.status == "succeeded"
    assert record.receipt == "r1"
    assert record.review_reason is None
    assert [event.event for event in record.history] == ["begin", "complete"]


async def test_a_claim_context_enters_only_once(journal: Journal) -> None:
    context = journal.claim(ident("once"), INPUTS, DEFINITION)
    async with context as attempt:
        await attempt.complete("r1")
    with pytest.raises(InvalidArgument) as caught:
        async with context:
            pass
    assert caught.value.code == "INVALID_ARGUMENT"


async def test_a_block_whose_record_someone_else_moved_is_still_unresolved(
    journal: Journal,
) -> None:
    identity = ident("moved")
    with pytest.raises(UnresolvedClaim) as caught:
        async with journal.claim(identity, INPUTS, DEFINITION):
            await journal.mark_review(identity, "an operator looked first")
    assert caught.value.view is not None
    assert caught.value.view.review_reason == "an operator looked first"
