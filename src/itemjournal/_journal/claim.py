"""The claim block: ``async with journal.claim(...) as attempt``.

``ClaimContext`` begins on entry and settles the record on exit: left by an exception or
a cancellation (anyio's or a bare asyncio ``task.cancel()``), or without ``complete`` or
``mark_review``, the record is marked ``needs_review``, shielded, and what happened is
told as a note on the exception that goes on; left by a ``Withdraw`` (or from inside
``attempt.preparing()``, see ``withdrawal``), the claim is withdrawn instead.
``Attempt`` is what the block holds: a ``ReusedAttempt`` or a ``ClaimedAttempt``, told
apart by ``reused`` (``Literal[True]`` or ``Literal[False]``), so ``if attempt.reused:``
narrows it for a type checker. They stand on the journal through the operations they use
(``ClaimJournal``), so the journal can make them without either module importing the
other.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Literal, Protocol

import anyio

from .._model import machine
from .._model.conflicts import ConflictError, UnresolvedClaim
from .._model.errors import InvalidArgument
from .._model.identity import DefinitionLike, Identity, IdentityLike, InputValue, coerce_identity
from .._model.records import Record, utc_now
from .._model.refusals import unresolved
from .._model.view import Claim, RecordView, Reuse
from .._model.withdrawal import Withdraw, fit_note
from .._stores.seam import Step
from .arguments import check_note
from .decisions import refusing, view_of
from .reasons import block_reason
from .runner import Runner, to_the_end
from .withdrawal import NOT_YET, Preparing, withdraw_on_exit

__all__ = ["Attempt", "ClaimContext", "ClaimJournal", "ClaimedAttempt", "ReusedAttempt"]


class ClaimJournal(Protocol):
    """What the claim block needs of a journal."""

    async def begin(
        self,
        identity: IdentityLike,
        inputs: Mapping[str, InputValue],
        definition: DefinitionLike,
        *,
        wait: float | None = None,
        compatible: Iterable[DefinitionLike] = (),
    ) -> Claim | Reuse: ...

    async def complete(
        self, claim: Claim, receipt: str, *, result: str | None = None
    ) -> RecordView: ...

    async def _mark_review(
        self, ident: Identity, reason: str | None, claim_id: str | None
    ) -> RecordView: ...

    async def _withdraw(
        self, claim: Claim, reason: str, own: list[Record] | None = None
    ) -> RecordView: ...


class Attempt:
    """What ``journal.claim()`` yields: a ``ClaimedAttempt`` (a fresh claim) or a
    ``ReusedAttempt`` (a reused receipt); ``if attempt.reused:`` tells which, also to a type
    checker."""

    def __init__(self, journal: ClaimJournal, outcome: Claim | Reuse) -> None:
        self._journal = journal
        self._claim: Claim | None = outcome if isinstance(outcome, Claim) else None
        self._receipt = outcome.receipt if isinstance(outcome, Reuse) else None
        # The result stored with a reused receipt (or given to ``complete``), if any.
        self.result: str | None = outcome.result if isinstance(outcome, Reuse) else None
        self.settled = isinstance(outcome, Reuse)
        self.view: RecordView | None = None
        self._preparing = NOT_YET  # where the block stands with ``preparing()``

    @property
    def reused(self) -> bool:
        """True when the item already succeeded and ``receipt`` holds its receipt."""
        return self._claim is None

    @property
    def receipt(self) -> str | None:
        """The reused receipt, or the one given to ``complete``; ``None`` before that."""
        return self._receipt

    @property
    def claim(self) -> Claim:
        """The claim granted by this attempt (``INVALID_CLAIM`` when it reused a receipt)."""
        return self._own_claim("claim")

    def _own_claim(self, what: str) -> Claim:
        if self._claim is None:
            raise InvalidArgument(
                f"nothing to {what}: this attempt reused a receipt", code="INVALID_CLAIM"
            )
        return self._claim

    async def complete(self, receipt: str, result: str | None = None) -> RecordView:
        """Declare this attempt's effect done (see ``Journal.complete``)."""
        claim = self._own_claim("complete")
        self.view = await self._journal.complete(claim, receipt, result=result)
        self.settled = True
        self._receipt = receipt
        self.result = result
        return self.view

    async def mark_review(self, reason: str | None = None) -> RecordView:
        claim = self._own_claim("mark for review")
        if reason is not None:
            reason = check_note(reason, "a review reason")
        self.view = await self._journal._mark_review(claim.identity, reason, claim.claim_id)
        self.settled = True
        return self.view

    async def withdraw(self, reason: str) -> RecordView:
        """Declare that this attempt's effect never started (see ``Journal.withdraw``):
        the record becomes ``released``, and the next ``begin`` grants a fresh claim."""
        claim = self._own_claim("withdraw")
        reason = check_note(reason, "a withdrawal reason")
        self.view = await self._journal._withdraw(claim, reason)
        self.settled = True
        return self.view

    def preparing(self) -> Preparing:
        """``async with attempt.preparing():`` marks code that has not touched the outside
        world yet (loading, validating, a read-only call).

        An exception raised inside it, or a cancellation that lands inside it, withdraws
        the claim (written shielded from cancellation) and goes on; everything after it
        is the effect, whose failure needs review. It comes once per attempt, not nested,
        before ``complete`` or ``mark_review``; otherwise ``InvalidArgument``
        (``INVALID_ARGUMENT``; ``INVALID_CLAIM`` on a reused attempt).
        """
        return Preparing(self, self._journal)


class ReusedAttempt(Attempt):
    """The item succeeded before: ``receipt`` is its receipt, and nothing is claimed."""

    def __init__(self, journal: ClaimJournal, outcome: Reuse) -> None:
        super().__init__(journal, outcome)
        self._reuse = outcome

    @property
    def reused(self) -> Literal[True]:
        return True

    @property
    def receipt(self) -> str:
        return self._reuse.receipt


class ClaimedAttempt(Attempt):
    """A fresh claim: do the effect under ``claim.key``, then ``complete`` or ``mark_review``."""

    @property
    def reused(self) -> Literal[False]:
        return False


class ClaimContext:
    """The async context manager behind ``Journal.claim``."""

    def __init__(
        self,
        journal: ClaimJournal,
        identity: IdentityLike,
        inputs: Mapping[str, InputValue],
        definition: DefinitionLike,
        *,
        runner: Runner,
        wait: float | None = None,
        compatible: Sequence[DefinitionLike] = (),
    ) -> None:
        self._journal = journal
        self._runner = runner
        self._where = runner.where
        self._args = (identity, inputs, definition)
        self._wait = wait
        self._compatible = compatible
        self._attempt: Attempt | None = None
        self._entered = False

    async def __aenter__(self) -> ReusedAttempt | ClaimedAttempt:
        if self._entered:
            raise InvalidArgument(
                "a claim context can be entered only once", code="INVALID_ARGUMENT"
            )
        self._entered = True
        outcome = await self._journal.begin(
            *self._args, wait=self._wait, compatible=self._compatible
        )
        attempt: ReusedAttempt | ClaimedAttempt = (
            ReusedAttempt(self._journal, outcome)
            if isinstance(outcome, Reuse)
            else ClaimedAttempt(self._journal, outcome)
        )
        self._attempt = attempt
        return attempt

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> Literal[False]:  # never swallows an exception: code after the block type-checks
        attempt = self._attempt
        if attempt is None or attempt.settled or attempt.reused:
            return False
        if isinstance(exc, Withdraw):  # the caller declares nothing was sent
            return await withdraw_on_exit(self._journal, attempt, exc, fit_note(exc.reason))
        claim = attempt.claim
        ident = coerce_identity(claim.identity)
        reason = (
            "block ended without complete or mark_review"
            if exc is None
            else block_reason(exc, anyio.get_cancelled_exc_class())
        )
        written: list[Record] = []

        alive = self._runner.store.owner_alive

        def settle(current: Record | None) -> Step[tuple[bool, RecordView]]:
            """(completed by this claim?, view): mark it, unless this claim settled it.

            A try cut short by a native cancellation may have written already; its own
            record, found again, counts as marked (the retry must not report otherwise).
            """
            if current is not None and current in written:
                return Step(None, (False, view_of(ident, current, alive)))
            if (
                current is not None
                and current.claim_id == claim.claim_id
                and current.status == "succeeded"
                and current.history
                and current.history[-1].event == "complete"
            ):  # completed under this very claim, by journal.complete(attempt.claim, ...)
                return Step(None, (True, view_of(ident, current, alive)))
            new = refusing(
                ident,
                current,
                alive,
                lambda: machine.mark_review(
                    current, reason=reason, claim_id=claim.claim_id, now=utc_now()
                ),
                self._where,
            )
            written.append(new)
            return Step(new, (False, view_of(ident, new, alive)))

        with self._runner.span("claim_exit", ident) as span:
            outcome, error, cancelled = await to_the_end(
                functools.partial(self._runner.apply, "claim_exit", ident, settle)
            )
            if outcome is not None:
                span.set("outcome", "completed" if outcome[0] else "marked")
                span.set("attempt", outcome[1].attempt)
            else:
                assert error is not None
                span.failed(error)
            if cancelled is not None:
                span.set("cancelled", True)
        # A native cancellation that arrived meanwhile goes on, whatever else happened:
        # the task must end cancelled. What the exit did travels with it as a note.
        carrier = cancelled if cancelled is not None else exc
        if outcome is not None:
            completed, view = outcome
            attempt.settled = True
            attempt.view = view
            if completed:
                if cancelled is not None:
                    raise cancelled
                return False
            if cancelled is not None:
                cancelled.add_note(
                    f"itemjournal marked {list(claim.identity)} needs_review: {reason}"
                )
                raise cancelled
            if exc is None:
                raise UnresolvedClaim(
                    unresolved(
                        f"the claim on {list(claim.identity)} ended unresolved; it now needs "
                        "review",
                        view,
                        where=self._where,
                    ),
                    view=view,
                )
            return False
        assert error is not None
        if isinstance(error, ConflictError):
            note = f"itemjournal did not mark {list(claim.identity)}: {error}"
        else:
            note = f"itemjournal could not mark {list(claim.identity)} for review: {error}"
        if carrier is not None:
            carrier.add_note(note)
            if cancelled is not None:
                raise cancelled
            return False
        if isinstance(error, ConflictError):  # someone else moved the record: its message says
            raise UnresolvedClaim(  # what the record is now and what to do next
                f"the claim on {list(claim.identity)} ended unresolved ({error})",
                view=error.view,
            ) from None
        raise error
