"""What the claim block yields: a ``ReusedAttempt`` or a ``ClaimedAttempt``, both
``Attempt``s, told apart by ``reused``; and the public ``Check`` type of a reconciliation
check. What a type checker makes of them is in ``tests/typing/narrowing.py``."""

from __future__ import annotations

import pytest

import itemjournal
from itemjournal import (
    Attempt,
    Check,
    ClaimedAttempt,
    Happened,
    Identity,
    InvalidArgument,
    Journal,
    RecordView,
    ReusedAttempt,
    definition_digest,
)

pytestmark = pytest.mark.anyio
# The contract holds on both faces of the journal (tests/_faces.py).
FACES = ("async", "sync")

DEFINITION = definition_digest("attempt-types-v1")


def test_the_attempt_types_and_check_are_public() -> None:
    for name in ("Attempt", "ClaimedAttempt", "ReusedAttempt", "Check"):
        assert name in itemjournal.__all__
    assert issubclass(ClaimedAttempt, Attempt)
    assert issubclass(ReusedAttempt, Attempt)
    assert Check.__doc__


async def test_a_fresh_claim_then_a_reuse(journal: Journal) -> None:
    identity = Identity("shop", "billing", "charge", "types-1")
    async with journal.claim(identity, {}, DEFINITION) as attempt:
        assert attempt.__class__ is ClaimedAttempt  # (the blocking face: its ClaimedAttempt)
        assert attempt.reused is False
        assert attempt.receipt is None
        assert attempt.claim.identity == identity
        await attempt.complete("ch_1", result="{}")
        assert attempt.receipt == "ch_1"
    async with journal.claim(identity, {}, DEFINITION) as again:
        assert again.__class__ is ReusedAttempt
        assert again.reused is True
        assert (again.receipt, again.result) == ("ch_1", "{}")
        assert again.settled
        with pytest.raises(InvalidArgument) as raised:
            again.claim  # noqa: B018
        assert raised.value.code == "INVALID_CLAIM"
        with pytest.raises(InvalidArgument):
            await again.complete("ch_2")
        with pytest.raises(InvalidArgument):
            await again.mark_review("no")
    assert (await journal.inspect(identity)).receipt == "ch_1"


async def test_a_plain_function_is_a_check(journal: Journal) -> None:
    identity = Identity("shop", "billing", "charge", "types-2")
    await journal.begin(identity, {}, DEFINITION)
    await journal.mark_review(identity, "timeout")

    def in_the_ledger(view: RecordView) -> Happened:
        return Happened(f"ch_{view.identity.item}")

    check: Check = in_the_ledger
    report = await journal.reconcile(check)
    assert [view.receipt for view in report.happened] == ["ch_types-2"]
