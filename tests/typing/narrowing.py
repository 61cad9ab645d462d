"""What a type checker learns from the journal's own checks, with no cast and no assert.

Checked by ``mypy --strict`` and pyright (``make lint``) and never run, like
``user_code.py``: ``assert_type`` pins what a caller sees; each ``type: ignore[...]`` marks a
mistake that must stay one.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import assert_type

from itemjournal import (
    Attempt,
    Check,
    Claim,
    ClaimedAttempt,
    DidNotHappen,
    Happened,
    Journal,
    RecordInvalid,
    RecordView,
    ReusedAttempt,
    StorageFailed,
    Unknown,
    definition_digest,
    sync,
)

CHARGE = definition_digest("charge-v1")


async def the_receipt(journal: Journal, order_id: str) -> str:
    """The README's claim block, in a function that returns ``str``."""
    async with journal.claim(("shop", "billing", "charge", order_id), {}, CHARGE) as attempt:
        assert_type(attempt, ReusedAttempt | ClaimedAttempt)
        if isinstance(attempt, ReusedAttempt):
            assert_type(attempt.receipt, str)
            assert_type(attempt.result, str | None)
            return attempt.receipt
        assert_type(attempt, ClaimedAttempt)
        assert_type(attempt.claim, Claim)
        assert_type(attempt.receipt, str | None)  # None until complete
        await attempt.complete(f"ch_{order_id}")
        return f"ch_{order_id}"


async def by_the_flag(journal: Journal) -> str:
    """``reused`` is ``Literal[True]`` or ``Literal[False]``: a discriminated union."""
    async with journal.claim(("s", "p", "j", "i"), {}, CHARGE) as attempt:
        if attempt.reused is True:
            assert_type(attempt, ReusedAttempt)
            return attempt.receipt
        assert_type(attempt, ClaimedAttempt)
        view = await attempt.complete("r-1", result="{}")
        assert_type(view, RecordView)
        return "r-1"


async def by_truthiness(journal: Journal) -> str:
    """SPEC's own spelling. mypy narrows on it; pyright narrows a union only on ``is``,
    ``==`` or ``isinstance`` (by design), hence the pyright-only ignores: should pyright
    learn it, the ignores become errors of their own."""
    async with journal.claim(("s", "p", "j", "i"), {}, CHARGE) as attempt:
        if attempt.reused:
            assert_type(attempt, ReusedAttempt)  # pyright: ignore[reportAssertTypeFailure]
            return attempt.receipt  # pyright: ignore[reportReturnType]
        assert_type(attempt, ClaimedAttempt)  # pyright: ignore[reportAssertTypeFailure]
        return "r-1"


async def still_attempts(journal: Journal) -> None:
    """Both are ``Attempt``s: code written against ``Attempt`` keeps working."""

    def settled(attempt: Attempt) -> bool:
        return attempt.settled

    async with journal.claim(("s", "p", "j", "i"), {}, CHARGE) as attempt:
        settled(attempt)
        assert_type(attempt.reused, bool)


async def not_narrowed(journal: Journal) -> str:
    async with journal.claim(("s", "p", "j", "i"), {}, CHARGE) as attempt:
        return attempt.receipt  # type: ignore[return-value]


async def listing(journal: Journal) -> None:
    async for view in journal.records():
        assert_type(view, RecordView)
    async for view in journal.records("needs_review", scope="shop", problems=False):
        assert_type(view, RecordView)
    async with aclosing(journal.records(problems=True)) as items:
        async for item in items:
            assert_type(item, RecordView | RecordInvalid | StorageFailed)
    asked: bool = True
    async for item in journal.records(problems=asked):
        assert_type(item, RecordView | RecordInvalid | StorageFailed)
    async for each in journal.records(problems=True):
        print(each.status)  # type: ignore[union-attr]


async def charge_status(view: RecordView) -> Happened | DidNotHappen | Unknown:
    return Unknown(f"no provider to ask about {view.key}")


def ledger_status(view: RecordView) -> Happened:
    return Happened(f"ch_{view.identity.item}")


async def not_a_verdict(view: RecordView) -> str:
    return view.key


async def reconciling(journal: Journal) -> None:
    checks: list[Check] = [charge_status, ledger_status]
    for check in checks:
        await journal.reconcile(check, scope="shop")
    wrong: Check = not_a_verdict  # type: ignore[assignment]
    await journal.reconcile(wrong)


# ---------------------------------------------------------------------------- the blocking face


def the_receipt_blocking(journal: sync.Journal, order_id: str) -> str:
    """The same block on ``itemjournal.sync``: the attempts narrow exactly as the async ones."""
    with journal.claim(("shop", "billing", "charge", order_id), {}, CHARGE) as attempt:
        assert_type(attempt, sync.ReusedAttempt | sync.ClaimedAttempt)
        if isinstance(attempt, sync.ReusedAttempt):
            assert_type(attempt.receipt, str)
            return attempt.receipt
        assert_type(attempt, sync.ClaimedAttempt)
        assert_type(attempt.claim, Claim)
        view = attempt.complete(f"ch_{order_id}")
        assert_type(view, RecordView)
        return f"ch_{order_id}"


def by_the_flag_blocking(journal: sync.Journal) -> str:
    with journal.claim(("s", "p", "j", "i"), {}, CHARGE) as attempt:
        if attempt.reused is True:
            assert_type(attempt, sync.ReusedAttempt)
            return attempt.receipt
        assert_type(attempt, sync.ClaimedAttempt)
        return "r-1"


def listing_blocking(journal: sync.Journal) -> list[str]:
    """``records`` is an iterator of views; with ``problems=True`` the errors come too."""
    keys = [view.key for view in journal.records("needs_review")]
    for item in journal.records(problems=True):
        assert_type(item, RecordView | RecordInvalid | StorageFailed)
    return keys


def once_blocking(journal: sync.Journal) -> str:
    @sync.once(journal, identity=("s", "p", "j", "i"))
    def charge() -> str:
        return "ch_1"

    assert_type(charge(), str)
    return charge()
