"""Withdrawing a claim from its own block: ``attempt.preparing()``, and the block's exit
when a ``Withdraw`` goes by.

Both write the same thing: the claim's record ``released`` under ``withdrawn``, shielded
from cancellation (and retried after a bare asyncio ``task.cancel()``, as the claim
block's own exit is). A record someone else changed meanwhile is refused by the state
machine and left as it is. What happened travels as a note on the exception that goes on.
Kept beside ``claim``, which imports it; this module imports nothing of ``claim``.
"""

from __future__ import annotations

import functools
from types import TracebackType
from typing import Literal, Protocol

import anyio

from .._model.conflicts import ConflictError
from .._model.errors import InvalidArgument
from .._model.records import Record
from .._model.view import Claim, RecordView
from .reasons import preparing_reason
from .runner import to_the_end

__all__ = ["Preparable", "Preparing", "WithdrawingJournal", "withdraw_on_exit"]

# Where an attempt stands with ``preparing()``: not used yet, inside it, or past it.
NOT_YET, INSIDE, PAST = "not yet", "inside", "past"


class WithdrawingJournal(Protocol):
    """What a withdrawal needs of a journal."""

    async def _withdraw(
        self, claim: Claim, reason: str, own: list[Record] | None = None
    ) -> RecordView: ...


class Preparable(Protocol):
    """What ``preparing()`` needs of the attempt it belongs to."""

    settled: bool
    view: RecordView | None
    _preparing: str

    @property
    def reused(self) -> bool: ...

    @property
    def claim(self) -> Claim: ...


class Preparing:
    """``async with attempt.preparing():`` code that has not touched the outside world.

    An exception raised inside, or a cancellation that lands inside, withdraws the
    claim on the way out (the record becomes ``released``, event ``withdrawn``), then
    goes on. Entering is not a checkpoint; leaving by an exception writes, shielded.
    """

    def __init__(self, attempt: Preparable, journal: WithdrawingJournal) -> None:
        self._attempt = attempt
        self._journal = journal

    async def __aenter__(self) -> None:
        attempt = self._attempt
        if attempt.reused:
            raise InvalidArgument(
                "nothing to prepare: this attempt reused a receipt", code="INVALID_CLAIM"
            )
        if attempt.settled:
            raise InvalidArgument(
                "preparing() after complete, mark_review or a withdrawal: this attempt is "
                "settled already",
                code="INVALID_ARGUMENT",
            )
        if attempt._preparing == INSIDE:
            raise InvalidArgument(
                "preparing() cannot be nested: this attempt is preparing already",
                code="INVALID_ARGUMENT",
            )
        if attempt._preparing == PAST:
            raise InvalidArgument(
                "preparing() comes once, before the effect: this attempt's preparation is over",
                code="INVALID_ARGUMENT",
            )
        attempt._preparing = INSIDE

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> Literal[False]:
        attempt = self._attempt
        attempt._preparing = PAST
        if exc is None or attempt.settled:  # completed inside, say: the receipt stands
            return False
        reason = preparing_reason(exc, anyio.get_cancelled_exc_class())
        return await withdraw_on_exit(self._journal, attempt, exc, reason)


async def withdraw_on_exit(
    journal: WithdrawingJournal, attempt: Preparable, exc: BaseException, reason: str
) -> Literal[False]:
    """Withdraw ``attempt``'s claim as ``exc`` leaves, shielded; ``exc`` goes on.

    A native cancellation that arrived meanwhile goes on instead, whatever else
    happened. Refused (someone else changed the record), the attempt counts as settled:
    whatever the block's exit would write would be refused the same way. A storage
    failure leaves it unsettled, for the block's exit to mark the record for review.
    """
    claim = attempt.claim
    own: list[Record] = []  # what this withdrawal wrote, should a retry find it again
    view, error, cancelled = await to_the_end(
        functools.partial(journal._withdraw, claim, reason, own)
    )
    where = list(claim.identity)
    if view is not None:
        attempt.settled = True
        attempt.view = view
        note = f"itemjournal withdrew the claim on {where} (released): {reason}"
    elif isinstance(error, ConflictError):
        attempt.settled = True
        attempt.view = error.view
        note = f"itemjournal did not withdraw the claim on {where}, left as it is: {error}"
    else:
        note = f"itemjournal could not withdraw the claim on {where}: {error}"
    carrier = cancelled if cancelled is not None else exc
    carrier.add_note(note)
    if cancelled is not None:
        raise cancelled
    return False
